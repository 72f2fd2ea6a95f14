"""The .ninfer artifact: one safetensors file, read zero-copy through mmap.

Layout: the standard safetensors header (8-byte little-endian length + JSON) whose ``__metadata__``
carries the JSON manifest under ``ninfer.manifest``; weights keep their Hugging Face names; text
resources (chat template, tokenizer.json, ...) are 1-D uint8 tensors named ``resource/<path>``.
Any safetensors reader can open the file; ninfer maps it once and hands out tensor views.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import attrs
import cattrs
import torch

from ninfer.core.errors import ArtifactError

FORMAT_NAME = "ninfer"
FORMAT_VERSION = 1
MANIFEST_KEY = "ninfer.manifest"
RESOURCE_PREFIX = "resource/"
CHAT_TEMPLATE_RESOURCE = "frontend/chat_template.jinja"
TOKENIZER_RESOURCE = "tokenizer/tokenizer.json"
_MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


@attrs.frozen
class Identity:
    model_id: str


@attrs.frozen
class Manifest:
    """What an artifact is. ``config`` is the Hugging Face ``config.json`` (with ``text_config``) verbatim.

    ``quantized`` maps each quantized weight to its format (``ninfer.core.artifact.quantized``); every tensor it does
    not name is stored dense.
    """

    identity: Identity
    architecture: str
    config: Mapping[str, Any]
    weight_format: Mapping[str, Any] = attrs.field(factory=lambda: {"dtype": "bfloat16", "quantization": None})
    companions: tuple[str, ...] = ()
    generation_defaults: Mapping[str, Any] = attrs.field(factory=dict)
    quantized: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    family: str | None = None
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    @property
    def text_config(self) -> Mapping[str, Any]:
        return self.config.get("text_config", self.config)

    @property
    def text_model_type(self) -> str | None:
        return self.text_config.get("model_type")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids: the generation defaults' ``eos_token_ids``, else the config's ``eos_token_id``."""
        ids = self.generation_defaults.get("eos_token_ids")
        if ids is None:
            ids = self.text_config.get("eos_token_id", self.config.get("eos_token_id"))
        if ids is None:
            return ()
        return tuple(int(token) for token in ([ids] if isinstance(ids, int) else ids))

    def to_json(self) -> str:
        return json.dumps(_converter.unstructure(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str, *, source: str) -> "Manifest":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{source}: the ninfer manifest is not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
            raise ArtifactError(f"{source}: the manifest does not declare format {FORMAT_NAME!r}")
        if data.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(
                f"{source}: manifest format_version {data.get('format_version')!r} is not supported "
                f"(this ninfer reads version {FORMAT_VERSION})"
            )
        try:
            return _converter.structure(data, cls)
        except (cattrs.BaseValidationError, KeyError, TypeError, ValueError) as exc:
            detail = "; ".join(cattrs.transform_error(exc)) if isinstance(exc, cattrs.BaseValidationError) else exc
            raise ArtifactError(f"{source}: the ninfer manifest is incomplete or malformed: {detail}") from None


_converter = cattrs.Converter()


@attrs.frozen
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class MappedSafetensors:
    """One safetensors file mapped once (private, copy-on-write) that hands out zero-copy tensor views.

    A view keeps the mapping alive, so :meth:`close` is safe while views exist: the mapping goes away
    with the last of them.
    """

    def __init__(self, path: Path, data_start: int) -> None:
        self.path = path
        self._data_start = data_start
        self._closed = False
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            self._mmap = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) if size else None

    def view(self, info: TensorInfo) -> torch.Tensor:
        """The tensor described by ``info`` (offsets relative to the data section) as a view of the mapping."""
        if self._closed:
            raise ArtifactError(f"{self.path}: read after the file was closed")
        count = 1
        for dim in info.shape:
            count *= dim
        if count == 0 or self._mmap is None:
            return torch.empty(info.shape, dtype=info.dtype)
        # Through a memoryview: the tensor holds it, and it holds a buffer export that keeps the mapping open
        # (torch.frombuffer on the mmap itself does not, so closing would unmap memory under live views).
        flat = torch.frombuffer(
            memoryview(self._mmap), dtype=info.dtype, count=count, offset=self._data_start + info.begin
        )
        return flat.view(info.shape)

    def close(self) -> None:
        self._closed = True
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # tensor views are still alive; the mapping closes when they are gone
                pass
            self._mmap = None


class ModelSource:
    """What serving reads a model from: a manifest, named weight tensors and named text resources.

    Implemented by :class:`Artifact` (a .ninfer file) and by the Hugging Face directory view
    (``ninfer.core.artifact.hf_directory.HFDirectoryArtifact``).
    """

    path: Path
    manifest: Manifest

    @property
    def tensor_names(self) -> list[str]:
        raise NotImplementedError

    def tensor_info(self, name: str) -> TensorInfo:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def tensors(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensor_names:
            if name.startswith(prefix):
                yield name, self.tensor(name)

    @property
    def resource_names(self) -> list[str]:
        raise NotImplementedError

    def resource(self, name: str) -> bytes:
        raise NotImplementedError

    def resource_text(self, name: str) -> str:
        try:
            return self.resource(name).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ArtifactError(f"{self.path}: resource {name!r} is not valid UTF-8 ({exc})") from None

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> "ModelSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Artifact(ModelSource):
    """An opened .ninfer file. Tensors are zero-copy views into a private (copy-on-write) mapping."""

    def __init__(self, path: Path, manifest: Manifest, tensors: dict[str, TensorInfo], data_start: int) -> None:
        self.path = path
        self.manifest = manifest
        self._infos = tensors
        self._mapped = MappedSafetensors(path, data_start)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Artifact":
        path = Path(path)
        infos, metadata, data_start = read_safetensors_header(path)
        if MANIFEST_KEY not in metadata:
            raise ArtifactError(f"{path}: a safetensors file but not a ninfer artifact (no {MANIFEST_KEY!r} metadata)")
        manifest = Manifest.from_json(metadata[MANIFEST_KEY], source=str(path))
        return cls(path, manifest, infos, data_start)

    # -- tensors -----------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        """Weight tensor names (resources excluded), in file order."""
        return [name for name in self._infos if not name.startswith(RESOURCE_PREFIX)]

    def tensor_info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise ArtifactError(f"{self.path}: no tensor named {name!r}") from None

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a zero-copy CPU view of the mapped file."""
        return self._mapped.view(self.tensor_info(name))

    # -- resources ---------------------------------------------------------------------------------

    @property
    def resource_names(self) -> list[str]:
        return [name[len(RESOURCE_PREFIX):] for name in self._infos if name.startswith(RESOURCE_PREFIX)]

    def resource(self, name: str) -> bytes:
        key = RESOURCE_PREFIX + name
        if key not in self._infos:
            raise ArtifactError(f"{self.path}: the artifact has no resource {name!r}")
        return self.tensor(key).numpy().tobytes()

    def close(self) -> None:
        self._mapped.close()

    def __enter__(self) -> "Artifact":
        return self


def read_safetensors_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate a safetensors header; every problem becomes an ArtifactError naming the file."""
    if not path.exists():
        raise ArtifactError(f"{path}: no such file")
    if path.is_dir():
        raise ArtifactError(f"{path}: is a directory, not a .ninfer file")
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ArtifactError(f"{path}: truncated ({size} bytes); not a safetensors/.ninfer file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len == 0 or header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
            raise ArtifactError(
                f"{path}: not a safetensors/.ninfer file or truncated (header claims {header_len} bytes, "
                f"file has {size})"
            )
        raw = handle.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{path}: corrupt header, not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: corrupt header, expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    data_len = size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype = CODE_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ArtifactError(f"{path}: corrupt header entry for tensor {name!r}: {entry!r}") from None
        expected = dtype.itemsize
        for dim in shape:
            expected *= dim
        if end - begin != expected or begin < 0:
            raise ArtifactError(f"{path}: tensor {name!r} has {end - begin} bytes, its shape needs {expected}")
        if end > data_len:
            raise ArtifactError(
                f"{path}: truncated: tensor {name!r} ends at byte {data_start + end} but the file has {size} bytes"
            )
        infos[name] = TensorInfo(dtype, shape, begin, end)
    return infos, metadata, data_start


@attrs.frozen
class TensorEntry:
    """A tensor to write: its name, dtype, shape and a function that produces it when its turn comes."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


def write_artifact(
    path: str | os.PathLike[str],
    manifest: Manifest,
    entries: Iterable[TensorEntry],
    resources: Mapping[str, bytes],
) -> Path:
    """Write a .ninfer file streaming one tensor at a time (memory bounded by the largest tensor).

    The file is written to a temporary name and renamed, so a crash never leaves a half artifact.
    """
    path = Path(path)
    entries = list(entries)
    for name, data in resources.items():
        buf = bytes(data)
        entries.append(
            TensorEntry(RESOURCE_PREFIX + name, torch.uint8, (len(buf),), lambda buf=buf: torch.frombuffer(bytearray(buf), dtype=torch.uint8))
        )
    header: dict[str, Any] = {"__metadata__": {MANIFEST_KEY: manifest.to_json(), "format": "pt"}}
    offset = 0
    seen: set[str] = set()
    for entry in entries:
        if entry.name in seen:
            raise ArtifactError(f"{path}: tensor {entry.name!r} would be written twice")
        seen.add(entry.name)
        nbytes = entry.dtype.itemsize
        for dim in entry.shape:
            nbytes *= dim
        header[entry.name] = {
            "dtype": DTYPE_CODES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header_bytes = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(header_bytes)))
            out.write(header_bytes)
            for entry in entries:
                tensor = entry.load()
                if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
                    raise ArtifactError(
                        f"{path}: tensor {entry.name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                        f"declared {entry.dtype} {entry.shape}"
                    )
                out.write(_tensor_bytes(tensor))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def tensor_entries(tensors: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """Entries for in-memory tensors (tiny artifacts, tests)."""
    return [TensorEntry(name, t.dtype, tuple(t.shape), lambda t=t: t) for name, t in tensors.items()]
