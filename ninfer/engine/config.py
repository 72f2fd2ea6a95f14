"""Engine configuration: the startup-fixed capacities and defaults the resident Engine runs with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping

import attrs

from ninfer.core.errors import ConfigError
from ninfer.core.request import SAMPLER_FIELDS, RequestPolicy
from ninfer.engine.context_cost import ContextCost
from ninfer.quant.kv_codecs import KV_CODECS

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.config import ServeConfig

MAX_CONCURRENCY = 8
AUTO = "auto"
#: Sizing headroom left free on the device when ``kv_capacity`` is ``auto``.
AUTO_HEADROOM_BYTES = 1 << 30


def _positive(name: str) -> Any:
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"engine option {name}: expected a positive integer, got {value!r}", param=name)

    return check


def _non_negative(name: str) -> Any:
    def check(_instance: Any, _attribute: Any, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"engine option {name}: expected a non-negative integer, got {value!r}", param=name)

    return check


def _concurrency(_instance: Any, _attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CONCURRENCY:
        raise ConfigError(
            f"engine option max_concurrency: expected 1..{MAX_CONCURRENCY}, got {value!r}", param="max_concurrency"
        )


def _kv_capacity(_instance: Any, _attribute: Any, value: Any) -> None:
    if value == AUTO:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"engine option kv_capacity: expected a positive token count or 'auto', got {value!r}", param="kv_capacity"
        )


def _timeout(_instance: Any, _attribute: Any, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"engine option pending_timeout_ms: expected a positive integer or None, got {value!r}",
            param="pending_timeout_ms",
        )


def _kv_dtype(_instance: Any, _attribute: Any, value: str) -> None:
    if value not in KV_CODECS:
        raise ConfigError(
            f"engine option kv_dtype: expected one of {', '.join(KV_CODECS)}, got {value!r}", param="kv_dtype"
        )


def _overrides(_instance: Any, _attribute: Any, value: Mapping[str, Any]) -> None:
    unknown = sorted(set(value) - {*SAMPLER_FIELDS, "seed"})
    if unknown:
        raise ConfigError(
            f"engine option sampling_overrides: unknown sampler fields {unknown}", param="sampling_overrides"
        )


@attrs.frozen
class EngineConfig:
    """Startup-fixed engine settings.

    ``kv_capacity`` is the Main Text KV pool in tokens or ``"auto"`` (CUDA: free memory less 1 GiB; CPU:
    ``max_context * max_concurrency``), stored as ``kv_dtype`` (``bf16``: the model dtype; the others through their
    ``KV_CODECS`` codec, on the reference path only). ``device_state_slots`` is H, the checkpoint StateImage slots
    beyond the C active lanes (None: H = C). ``host_state_slots`` / ``host_kv_mib`` size the host tier that takes
    checkpoints the device evicts (either 0: no host tier, the engine's default; the server's defaults of 8 slots
    and 8192 MiB arrive through :meth:`from_serve_config`). ``pending_timeout_ms`` None waits without a deadline
    (offline use).
    ``sampling_overrides`` are the process-level sampler flags (None values are unset);
    ``greedy`` forces temperature 0 for every request. ``overlap_decode``: while only the decode batch waits for
    the device and no row has stop strings, each round launches the next one's forward on the ids it sampled
    before they reach the host, so the host's commit work overlaps device time (same tokens, same checkpoints).
    None (the default) turns it on where the runtime runs on CUDA; on the CPU the runtime is synchronous, so it
    would only delay each token by one forward.
    """

    max_concurrency: int = attrs.field(default=1, validator=_concurrency)
    max_pending_requests: int = attrs.field(default=16, validator=_non_negative("max_pending_requests"))
    pending_timeout_ms: int | None = attrs.field(default=30000, validator=_timeout)
    prefill_chunk: int = attrs.field(default=1024, validator=_positive("prefill_chunk"))
    max_context: int = attrs.field(default=8192, validator=_positive("max_context"))
    kv_capacity: int | Literal["auto"] = attrs.field(default=AUTO, validator=_kv_capacity)
    kv_dtype: str = attrs.field(default="bf16", validator=_kv_dtype)
    device_state_slots: int | None = attrs.field(default=None, validator=_non_negative("device_state_slots"))
    host_state_slots: int = attrs.field(default=0, validator=_non_negative("host_state_slots"))
    host_kv_mib: int = attrs.field(default=0, validator=_non_negative("host_kv_mib"))
    prefix_reuse: bool = True
    page_size: int = attrs.field(default=16, validator=_positive("page_size"))
    default_max_tokens: int = attrs.field(default=8192, validator=_positive("default_max_tokens"))
    sampling_overrides: Mapping[str, Any] = attrs.field(factory=dict, validator=_overrides)
    greedy: bool = False
    overlap_decode: bool | None = None
    max_private_continuations: int | None = attrs.field(
        default=None, validator=_non_negative("max_private_continuations")
    )
    max_shared_prefixes: int | None = attrs.field(default=None, validator=_non_negative("max_shared_prefixes"))
    max_long_anchors_per_continuation: int = attrs.field(
        default=2, validator=_non_negative("max_long_anchors_per_continuation")
    )
    context_cost: ContextCost = ContextCost()  # how admission ranks reuse candidates

    @property
    def private_continuations(self) -> int:
        """How many conversation histories the context cache retains checkpoints of (default 2 x concurrency)."""
        limit = self.max_private_continuations
        return 2 * self.max_concurrency if limit is None else limit

    @property
    def shared_prefixes(self) -> int:
        """How many shared-prefix checkpoints the context cache retains (default max(concurrency, 4))."""
        return max(self.max_concurrency, 4) if self.max_shared_prefixes is None else self.max_shared_prefixes

    @property
    def checkpoint_slots(self) -> int:
        """H: StateImage slots that hold prefix checkpoints (0 when prefix reuse is off)."""
        if not self.prefix_reuse:
            return 0
        return self.max_concurrency if self.device_state_slots is None else self.device_state_slots

    @property
    def request_policy(self) -> RequestPolicy:
        """The request rules this engine applies to requests submitted without them."""
        return RequestPolicy(self.max_context, self.default_max_tokens, self.sampling_overrides, self.greedy)

    @classmethod
    def from_serve_config(cls, config: "ServeConfig", **changes: Any) -> "EngineConfig":
        """The engine part of the serve options; ``changes`` override individual fields."""
        policy = config.request_policy
        values: dict[str, Any] = dict(
            max_concurrency=config.max_concurrency,
            max_pending_requests=config.max_pending_requests,
            pending_timeout_ms=config.pending_timeout_ms,
            prefill_chunk=config.prefill_chunk,
            max_context=policy.max_context,
            kv_capacity=config.kv_capacity,
            kv_dtype=config.kv_dtype,
            device_state_slots=config.device_state_slots,
            host_state_slots=config.host_state_slots,
            host_kv_mib=config.host_kv_mib,
            prefix_reuse=not config.no_prefix_reuse,
            max_private_continuations=config.max_private_continuations,
            max_shared_prefixes=config.max_shared_prefixes,
            max_long_anchors_per_continuation=config.max_long_anchors_per_continuation,
            default_max_tokens=policy.default_max_tokens,
            sampling_overrides=policy.sampling_overrides,
            greedy=policy.greedy,
        )
        values.update(changes)
        return cls(**values)
