"""What reusing a prefix costs: the coefficients admission ranks its candidate checkpoints with.

A candidate leaves two kinds of work: copying a host checkpoint back to the device (batched copies: a fixed cost
per restore and per copied tensor, or the bytes over the host-to-device bandwidth, whichever dominates) and
prefilling the prompt suffix after it (a cost per computed token plus one per attention pair: a suffix of S
tokens after B reused ones attends to ``B*S + S*(S+1)/2`` keys). Only the ranking matters: every candidate is
exact, so the choice changes the work, never the output.

The coefficients are resolved once at startup: generic defaults (an H200-class GPU with a ~27B model), replaced
entry by entry from the ``--context-cost-presets`` JSON object::

    {"transfer": {"batch_ns": 20000, "op_ns": 1000, "ns_per_byte": 0.04},
     "prefill": {"<model id>": {"token_ns": 77000, "pair_ns": 1.0}}}

Both keys are optional; a ``prefill`` entry applies when its key is the served artifact's model id. Any other key,
field or a negative value is a configuration error (startup aborts).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs

from ninfer.core.errors import ConfigError

PARAM = "context_cost_presets"


@attrs.frozen
class TransferCost:
    """Host-to-device restore cost: ``max(batch_ns + ops * op_ns, bytes * ns_per_byte)``."""

    batch_ns: float = 20_000.0
    op_ns: float = 1_000.0
    ns_per_byte: float = 0.04  # 25 GB/s pinned host-to-device

    def ns(self, num_bytes: int, ops: int) -> float:
        return max(self.batch_ns + ops * self.op_ns, num_bytes * self.ns_per_byte)


@attrs.frozen
class PrefillCost:
    """Suffix prefill cost: ``token_ns`` per computed token plus ``pair_ns`` per attention (query, key) pair."""

    token_ns: float = 50_000.0
    pair_ns: float = 1.0

    def ns(self, reused: int, suffix: int) -> float:
        pairs = reused * suffix + suffix * (suffix + 1) // 2
        return suffix * self.token_ns + pairs * self.pair_ns


@attrs.frozen
class ContextCost:
    """The resolved coefficients and where they came from (``generic`` or the presets file and its entries)."""

    transfer: TransferCost = TransferCost()
    prefill: PrefillCost = PrefillCost()
    source: str = "generic"

    def record(self) -> dict[str, Any]:
        """The operational record (startup log, ``server_start``)."""
        return {"source": self.source, "transfer": attrs.asdict(self.transfer), "prefill": attrs.asdict(self.prefill)}


def _coefficients(kind: type, value: Any, where: str) -> Any:
    if not isinstance(value, Mapping):
        raise ConfigError(f"--context-cost-presets: {where} must be a JSON object", param=PARAM)
    names = {field.name for field in attrs.fields(kind)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(
            f"--context-cost-presets: {where} has unknown fields {unknown} (expected {sorted(names)})", param=PARAM
        )
    for name, number in value.items():
        if isinstance(number, bool) or not isinstance(number, (int, float)) or number < 0:
            raise ConfigError(
                f"--context-cost-presets: {where}.{name} must be a non-negative number, got {number!r}", param=PARAM
            )
    return kind(**{name: float(number) for name, number in value.items()})


def resolve_context_cost(presets: Mapping[str, Any] | None, model_id: str, origin: str = "presets") -> ContextCost:
    """The coefficients for ``model_id``: generic defaults, replaced by the entries of ``presets`` that apply."""
    if presets is None:
        return ContextCost()
    unknown = sorted(set(presets) - {"transfer", "prefill"})
    if unknown:
        raise ConfigError(f"--context-cost-presets: unknown keys {unknown} (expected transfer, prefill)", param=PARAM)
    used = []
    transfer, prefill = TransferCost(), PrefillCost()
    if "transfer" in presets:
        transfer = _coefficients(TransferCost, presets["transfer"], "transfer")
        used.append("transfer")
    entries = presets.get("prefill", {})
    if not isinstance(entries, Mapping):
        raise ConfigError("--context-cost-presets: prefill must map model ids to objects", param=PARAM)
    for key, value in entries.items():
        coefficients = _coefficients(PrefillCost, value, f"prefill[{key!r}]")
        if key == model_id:
            prefill = coefficients
            used.append(f"prefill[{key}]")
    source = f"{origin} ({', '.join(used)})" if used else "generic"
    return ContextCost(transfer, prefill, source)
