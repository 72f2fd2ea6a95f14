"""Random-weight Qwen3.5 models built directly in memory (on the GPU for benchmarks): weights never touch disk.

``random_text_weights`` draws every text-model tensor of a config with the real initialisation style,
``random_mtp_weights`` those of the multi-token-prediction module (``mtp.*``, for speculative benchmarks);
``InMemorySource`` serves such tensors (or tensors borrowed from a transformers model) to the ordinary loader, so a
synthetic model goes through exactly the checks and code paths of a real artifact. ``SyntheticSource`` is the model
``ninfer serve --synthetic PRESET`` serves: a preset whose tensors are drawn on the load device when the loader
reads them (seeded per tensor name, never retained), with the real Qwen tokenizer and ninfer's chat template.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ninfer.core.artifact.container import Identity, Manifest, ModelSource, TensorInfo
from ninfer.core.artifact.synthetic import synthetic_model_id
from ninfer.core.errors import ArtifactError, ConfigError
from ninfer.core.runtime import LoadOptions
from ninfer.plugins.qwen3_5.frontend.templates import DEFAULT_TEMPLATE, artifact_resources
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig, resolve_architecture
from ninfer.plugins.qwen3_5.model.layers import DecoderLayerWeights
from ninfer.plugins.qwen3_5.model.model import Qwen35Model, WeightLoader
from ninfer.plugins.qwen3_5.model.presets import GENERATION_DEFAULTS, preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime, accelerate, load_target
from ninfer.plugins.qwen3_5.model.weights import Shapes, expected_weights, mtp_weights
from ninfer.plugins.qwen3_5.speculative.mtp import Qwen35MTP

INIT_STD = 0.02


class InMemorySource(ModelSource):
    """A model source over a name -> tensor mapping (and optional name -> bytes resources)."""

    def __init__(
        self,
        name: str,
        config: Mapping[str, Any],
        tensors: Mapping[str, torch.Tensor],
        resources: Mapping[str, bytes] | None = None,
    ) -> None:
        self.path = Path(f"<synthetic {name}>")
        self.manifest = Manifest(identity=Identity(name), architecture=resolve_architecture(config), config=config)
        self._tensors = dict(tensors)
        self._resources = dict(resources or {})

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> TensorInfo:
        tensor = self.tensor(name)
        return TensorInfo(dtype=tensor.dtype, shape=tuple(tensor.shape), begin=0, end=tensor.nbytes)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise ArtifactError(f"{self.path}: no tensor {name!r}")
        return self._tensors[name]

    def tensors(self, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        return ((name, t) for name, t in self._tensors.items() if name.startswith(prefix))

    @property
    def resource_names(self) -> list[str]:
        return list(self._resources)

    def resource(self, name: str) -> bytes:
        if name not in self._resources:
            raise ArtifactError(f"{self.path}: a synthetic model has no resource {name!r}")
        return self._resources[name]

    def close(self) -> None:
        self._tensors.clear()


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` under model seed ``seed``: a tensor's values do not depend on which
    tensors were drawn before it, so a source can draw each one when it is read and keep none."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class SyntheticSource(ModelSource):
    """The random-weight model of a preset, as the loader sees an artifact (``ninfer serve --synthetic``).

    Every text-model tensor of the preset is drawn when it is read, on ``device`` in ``dtype`` with the real
    initialisation style, from a generator seeded by (``seed``, tensor name), and is not retained: a 27B model never
    exists at full size anywhere but in the loaded runtime (the fused projections replace the tensors they were
    built from). The resources are those of a real Qwen artifact: the Qwen tokenizer and ninfer's chat template.
    """

    def __init__(
        self, preset: str, *, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
        template: str = DEFAULT_TEMPLATE,
    ) -> None:
        config = preset_config(preset)
        self.preset = preset
        self.device = torch.device(device)
        self.dtype = dtype
        self.seed = int(seed)
        self.path = Path(f"<synthetic {preset}>")
        self.manifest = Manifest(
            identity=Identity(synthetic_model_id(preset)),
            architecture=resolve_architecture(config),
            config=config,
            weight_format={"dtype": str(dtype).removeprefix("torch."), "quantization": None, "random_weights": True,
                           "synthetic_seed": self.seed},
            generation_defaults=dict(GENERATION_DEFAULTS),
        )
        self._shapes = expected_weights(config, text_only=True)
        self._resources = artifact_resources(template)
        self._closed = False

    @property
    def tensor_names(self) -> list[str]:
        return list(self._shapes)

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self._shapes:
            raise ArtifactError(f"{self.path}: no tensor named {name!r}")
        shape = tuple(self._shapes[name])
        return TensorInfo(dtype=self.dtype, shape=shape, begin=0, end=math.prod(shape) * self.dtype.itemsize)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, freshly drawn (the same values on every read)."""
        shape = self.tensor_info(name).shape
        if self._closed:
            raise ArtifactError(f"{self.path}: read after the source was closed")
        generator = torch.Generator(device=self.device).manual_seed(tensor_seed(self.seed, name))
        tensor = torch.empty(shape, dtype=self.dtype, device=self.device)
        _init_(name, tensor, generator)
        return tensor

    @property
    def resource_names(self) -> list[str]:
        return list(self._resources)

    def resource(self, name: str) -> bytes:
        if name not in self._resources:
            raise ArtifactError(f"{self.path}: the synthetic model has no resource {name!r}")
        return self._resources[name]

    def close(self) -> None:
        self._closed = True


def synthetic_source(preset: str, options: LoadOptions, seed: int = 0) -> SyntheticSource:
    """``ModelFamily.synthetic_source``: preset ``preset`` for ``options`` (weights on ``options.device`` in the dtype
    ``load_runtime`` resolves: ``auto`` is bf16 on CUDA, fp32 on the CPU)."""
    dtype, device = load_target(options)
    return SyntheticSource(preset, device=device, dtype=dtype, seed=seed)


def _init_(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    """Real-style init in place: (1+w) norms near 0, GDN output norm near 1, A/dt like HF, linears N(0, 0.02)."""
    if name.endswith("linear_attn.A_log"):
        tensor.uniform_(0.01, 16, generator=generator).log_()
    elif name.endswith("linear_attn.dt_bias"):
        tensor.fill_(1.0)
    elif name.endswith("linear_attn.conv1d.weight"):
        bound = 1.0 / math.sqrt(tensor.shape[-1])
        tensor.uniform_(-bound, bound, generator=generator)
    elif name.endswith("linear_attn.norm.weight"):
        tensor.normal_(1.0, INIT_STD, generator=generator)
    else:
        tensor.normal_(0.0, INIT_STD, generator=generator)


def _draw(shapes: Shapes, device: torch.device | str, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        _init_(name, tensor, generator)
        tensors[name] = tensor
    return tensors


def random_text_weights(
    config: Mapping[str, Any], *, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Every text-model tensor of ``config`` (trunk + lm_head), drawn on ``device`` in ``dtype``."""
    return _draw(expected_weights(config, text_only=True), device, dtype, seed)


def random_mtp_weights(
    config: Mapping[str, Any], *, device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of ``config`` (``mtp_num_hidden_layers`` of them), drawn on ``device`` in ``dtype``.

    A ``ConfigError`` when the config declares no MTP layer.
    """
    text = Qwen35TextConfig.from_hf(config)
    if text.mtp_num_hidden_layers == 0:
        raise ConfigError("the config declares no MTP layer (mtp_num_hidden_layers is 0)", param="spec")
    return _draw(mtp_weights(text), device, dtype, seed + 1)


def build_runtime(
    source: ModelSource,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    cuda_graphs: bool = True,
    on_layer: Callable[[int, DecoderLayerWeights], None] | None = None,
) -> Qwen35Runtime:
    """A runtime over the source's tensors; tensors already in ``dtype`` on ``device`` are not copied.

    The MTP module is loaded when the source carries ``mtp.*`` tensors (and the config declares it). On CUDA the
    input projections are fused (``on_layer`` sees each fused layer); the source is emptied afterwards so that it
    keeps no tensor alive.
    """
    config = Qwen35TextConfig.from_hf(source.manifest.config, source.manifest.architecture)
    loader = WeightLoader(source, dtype, torch.device(device))
    model = Qwen35Model.load(loader, config)
    mtp = Qwen35MTP.load(loader, model)
    source.close()
    model, decoder = accelerate(model, cuda_graphs=cuda_graphs, on_layer=on_layer)
    if mtp is not None:  # the MTP step shares the trunk's embedding and lm_head: point it at the accelerated model
        mtp = Qwen35MTP(model, mtp.weights)
    return Qwen35Runtime(model, mtp, decoder)


def random_runtime(
    name: str,
    *,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    cuda_graphs: bool = True,
) -> Qwen35Runtime:
    """The named preset's text model (``presets``) with random weights drawn on ``device``, never on the host."""
    config = preset_config(name)
    tensors = random_text_weights(config, device=device, dtype=dtype, seed=seed)
    return build_runtime(InMemorySource(name, config, tensors), dtype=dtype, device=device, cuda_graphs=cuda_graphs)
