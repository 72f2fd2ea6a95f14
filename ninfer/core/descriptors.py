"""Typed descriptors that plugins return from the registration hooks.

Every extension kind is a small frozen attrs class. A descriptor whose implementation has not landed
yet leaves its factory as ``None``; selecting it fails at startup with :class:`NotYetAvailableError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import attrs

from ninfer.core.errors import NotYetAvailableError

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.artifact.container import Manifest, ModelSource, TensorInfo
    from ninfer.core.artifact.hf_directory import FusedTensor
    from ninfer.core.artifact.tiny import TinyModel, TinyOptions
    from ninfer.core.config import ServeConfig
    from ninfer.core.drafting import Drafter, SpeculativeConfig
    from ninfer.core.frontend import Frontend
    from ninfer.core.runtime import LoadOptions, ModelRuntime
    from ninfer.core.serving import ServerView
    from ninfer.core.tokenizer import Tokenizer


def _not_available(kind: str, name: str, detail: str) -> NotYetAvailableError:
    return NotYetAvailableError(f"{kind} {name!r} is registered but not yet available: {detail}")


@attrs.frozen
class SamplingPreset:
    """Family-recommended sampler values for one thinking mode."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float = 0.0


@attrs.frozen
class ModelFamily:
    """A model family: recognizes artifacts by architecture and builds their runtime and frontend.

    ``expected_weights(config)`` maps every tensor name of a checkpoint with that config to its shape; the
    converter, the loader and ``make-tiny`` share it. ``load_runtime(artifact, options)`` builds the
    model runtime the engine drives. ``build_frontend(artifact, serve_config, tokenizer)`` builds the prompt renderer
    and output decoder. ``make_tiny(options)`` returns ``(manifest, tensors, resources)`` of a tiny
    random-weight artifact. ``sampling_presets(manifest)`` returns ``{"thinking": ..., "non_thinking": ...}``.

    ``checkpoint_layout(config, stored)`` (optional) reconciles a Hugging Face checkpoint that stores some weights
    differently from ``expected_weights``: given the config and the stored tensors (name -> ``TensorInfo``), it
    returns ``{target name: FusedTensor}``, each saying which stored tensors build that expected tensor and how
    (e.g. per-expert MoE matrices stacked into one). The directory view then shows the targets instead of their
    sources, so ``ninfer convert`` and ``ninfer serve HF_DIR`` see one layout. It returns ``{}`` when the
    checkpoint already matches, and raises ``WeightMismatchError`` for a source it finds mis-shaped; missing
    sources are reported by the view.

    ``quantizable_weights(config)`` (optional) names the weights ``ninfer convert --quantize`` encodes: the
    projection matrices the family's runtime applies through its quantization-aware linear; everything else stays
    as stored.

    ``synthetic_presets()`` (optional; light, no torch) names the real configurations this family builds with
    random weights for ``ninfer serve --synthetic PRESET``; preset names are unique across families.
    ``synthetic_source(preset, options, seed)`` returns a ``ModelSource`` of that preset: its tensors are drawn
    deterministically from ``seed`` on ``options.device`` in the dtype ``load_runtime`` resolves from ``options``
    (so loading copies nothing and no full-size copy touches disk or host memory), and its resources are the ones
    a real artifact of the family embeds (tokenizer, chat template). The ordinary ``load_runtime`` and
    ``build_frontend`` consume it like any artifact.
    """

    name: str
    architectures: tuple[str, ...]
    description: str = ""
    model_types: tuple[str, ...] = ()
    expected_weights: Callable[[Mapping[str, Any]], dict[str, tuple[int, ...]]] | None = None
    load_runtime: Callable[["ModelSource", "LoadOptions"], "ModelRuntime"] | None = None
    build_frontend: Callable[["ModelSource", "ServeConfig", "Tokenizer"], "Frontend"] | None = None
    make_tiny: Callable[["TinyOptions"], "TinyModel"] | None = None
    sampling_presets: Callable[["Manifest"], Mapping[str, SamplingPreset]] | None = None
    checkpoint_layout: (
        Callable[[Mapping[str, Any], Mapping[str, "TensorInfo"]], Mapping[str, "FusedTensor"]] | None
    ) = None
    quantizable_weights: Callable[[Mapping[str, Any]], Sequence[str]] | None = None
    synthetic_presets: Callable[[], Sequence[str]] | None = None
    synthetic_source: Callable[[str, "LoadOptions", int], "ModelSource"] | None = None

    def matches(self, manifest: "Manifest") -> bool:
        """True when the artifact's architecture (and text model_type, if declared) belongs to this family."""
        if manifest.architecture not in self.architectures:
            return False
        if not self.model_types:
            return True
        return manifest.text_model_type in self.model_types

    def require(self, what: str) -> Callable[..., Any]:
        """Return the factory named ``what`` or raise a clear "not yet available" error."""
        factory = getattr(self, what)
        if factory is None:
            raise _not_available("model family", self.name, f"{what.replace('_', ' ')} has not been implemented")
        return factory


@attrs.frozen
class SpeculativeBackend:
    """A speculative-decoding backend selectable with ``--spec NAME``.

    ``companion_prefix`` names the tensor prefix its drafter weights use in the artifact (``mtp.``,
    ``dflash.``...). ``build_drafter(runtime, artifact, config)`` builds the drafter; ``None`` means the
    backend is registered but not yet available. ``open_companion(path)`` (optional) opens a separately
    published drafter checkpoint for ``ninfer convert --NAME DIR``: the returned object checks the target
    (``check_target(manifest)``), records itself in the manifest (``manifest_with_companion(manifest)``), yields
    its tensor entries (``entries()``) and is closed after the write (``close()``).
    """

    name: str
    min_draft_tokens: int
    max_draft_tokens: int
    companion_prefix: str
    description: str = ""
    supports_lm_head_draft: bool = True
    build_drafter: Callable[["ModelRuntime", "ModelSource", "SpeculativeConfig"], "Drafter"] | None = None
    open_companion: Callable[[Any], Any] | None = None

    def validate_draft_tokens(self, draft_tokens: int) -> None:
        if not self.min_draft_tokens <= draft_tokens <= self.max_draft_tokens:
            from ninfer.core.errors import ConfigError

            raise ConfigError(
                f"--draft-tokens {draft_tokens} is out of range for --spec {self.name}: "
                f"expected {self.min_draft_tokens}..{self.max_draft_tokens}",
                param="draft_tokens",
            )

    def require_drafter(self) -> Callable[..., Any]:
        if self.build_drafter is None:
            raise _not_available("speculative backend", self.name, "its drafter has not been implemented")
        return self.build_drafter

    def require_companion(self) -> Callable[..., Any]:
        if self.open_companion is None:
            raise _not_available("speculative backend", self.name, "it has no separately published drafter to convert")
        return self.open_companion


@attrs.frozen
class KVDtype:
    """A KV-cache storage format selectable with ``--kv-dtype NAME``.

    ``key_bits``/``value_bits`` are storage bits per element including block-scale overhead, so
    :attr:`bytes_per_token_per_head_dim` is the K+V bytes one token costs per KV head dimension.
    ``make_storage`` builds the quantize-on-write storage; ``None`` means not yet available.
    """

    name: str
    key_bits: float
    value_bits: float
    description: str = ""
    make_storage: Callable[..., Any] | None = None

    @property
    def bytes_per_token_per_head_dim(self) -> float:
        return (self.key_bits + self.value_bits) / 8.0

    def kv_bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> float:
        return self.bytes_per_token_per_head_dim * num_layers * num_kv_heads * head_dim

    def require_storage(self) -> Callable[..., Any]:
        if self.make_storage is None:
            raise _not_available("KV dtype", self.name, "its quantized storage path has not been implemented")
        return self.make_storage


@attrs.frozen
class Route:
    method: str
    path: str


@attrs.frozen
class ProtocolAdapter:
    """A set of HTTP routes mounted on the falcon app, e.g. OpenAI Chat Completions.

    ``mount(app, server)`` adds the routes to a ``falcon.asgi.App``; ``server`` is the running server's
    :class:`~ninfer.core.serving.ServerView`. ``None`` means not yet available.
    """

    name: str
    routes: tuple[Route, ...]
    description: str = ""
    mount: Callable[[Any, "ServerView"], None] | None = None

    def require_mount(self) -> Callable[[Any, "ServerView"], None]:
        if self.mount is None:
            raise _not_available("protocol adapter", self.name, "its HTTP routes have not been implemented")
        return self.mount
