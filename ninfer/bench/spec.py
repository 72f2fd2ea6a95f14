"""``ninfer bench --synthetic NAME --spec mtp --draft-tokens K``: the cost of one speculative round on random weights.

The preset's trunk and a random MTP module (``mtp.*``, one layer as the real checkpoints ship) are built on the
device; the real ``MTPDrafter`` drafts and the engine's own ``SpeculativeRound`` runs each round over sequences
prefilled with random prompts, exactly as the executor drives it (same verify ``ForwardBatch``: k+1 tokens per row,
state capture, all logits, hidden states for the drafter; same acceptance, commit and rollback code).

Random weights accept almost nothing, and acceptance changes the cost only a little (how many tokens are committed,
whether the recurrent state is restored, how many hidden states the drafter keeps, how many tail positions the next
draft writes), so acceptance is *forced*: the verify logits are edited after the timed forward (asynchronously, while
the device still runs it) so that either no draft (``zero``) or every draft (``full``) is the target's greedy choice.
Before any timing, rounds accepting 0, 1, .., k drafts in turn (``SpecRows.warm_shapes``) make every draft tail
length 1..k+1 appear twice, so every kernel variant is compiled and every CUDA graph (draft, verify) captured and
replayed. Measured per concurrency, medians over the timed rounds:

* ``plain_step_ms``: one plain decode step as ``ninfer bench --synthetic`` measures it (graphs, host round trip);
* ``round_ms``: a whole round back to back (``SpeculativeRound.run`` between two device syncs), per acceptance;
* its parts from separately instrumented rounds (a device sync at each boundary): ``draft_ms`` (the k chained MTP
  steps), ``verify_ms`` (``runtime.forward`` of the verify batch) and ``accept_rollback_ms`` (the rest: batch
  building, the argmax transfer, acceptance, commits, state restore, the drafter's bookkeeping; not the forcing);
* ``projected_tok_s``: rows x the expected tokens per round at a published acceptance profile ÷ the slower of the two
  round times. It is a projection: the acceptance is borrowed, only the cost is measured here.
"""

from __future__ import annotations

import json as json_module
import statistics
import time
from typing import Any, Callable, Literal, Mapping
from typing import Sequence as Seq
from typing import Union

import attrs
import torch

from ninfer.bench.synthetic import Clock, bench_ninfer_decode
from ninfer.core.drafting import Drafter, DraftRow
from ninfer.core.errors import ConfigError
from ninfer.core.runtime import ForwardBatch, ForwardOutput, KVCache, ModelRuntime, StateCache
from ninfer.engine import RoundHarness
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import (
    InMemorySource,
    build_runtime,
    random_mtp_weights,
    random_text_weights,
)
from ninfer.plugins.qwen3_5.speculative.mtp_drafter import MTPDrafter

SPEC_BACKENDS = ("mtp",)
Acceptance = Literal["zero", "full"]
Forcing = Union[Acceptance, int]  # "zero", "full", or how many drafts each row accepts


@attrs.frozen
class AcceptanceProfile:
    """Published per-position acceptance rates (draft i accepted given drafts < i were) and where they come from."""

    name: str
    source: str
    rates: tuple[float, ...]

    def expected_tokens(self, draft_tokens: int) -> float:
        """Tokens one round commits on average with ``draft_tokens`` drafts: 1 + the first k position rates."""
        if not 1 <= draft_tokens <= len(self.rates):
            raise ConfigError(
                f"the {self.name} profile covers 1..{len(self.rates)} draft tokens, not {draft_tokens}",
                param="draft_tokens",
            )
        return 1.0 + sum(self.rates[:draft_tokens])


#: Per-position MTP acceptance of Qwen3.8-27B (shared/reference/speculative.md §2 and §3.2).
MTP_PROFILE = AcceptanceProfile(
    "Qwen3.8-27B MTP",
    "vllm-ascend PR #14533 (GSM8K, T=0, 8 drafts), per shared/reference/speculative.md §3.2",
    (0.94, 0.86, 0.77, 0.68, 0.59, 0.51, 0.44, 0.38),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedRuntime:
    """The runtime as the round sees it: times ``forward`` (device-synced) and can force the acceptance outcome."""

    def __init__(self, runtime: Qwen35Runtime) -> None:
        self.runtime = runtime
        self.spec = runtime.spec
        self.timing = False
        self.force: Forcing | None = None
        self.times: list[float] = []
        self.force_times: list[float] = []  # instrumented rounds: the forcing's own host and device time
        self.graph_batches = 0  # verify batches the runtime's CUDA verify runner takes

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        verifier = getattr(self.runtime, "verifier", None)
        if verifier is not None and verifier.supports(batch):
            self.graph_batches += 1
        if self.timing:
            _sync(self.spec.device)
            start = time.perf_counter()
        output = self.runtime.forward(batch, kv, state)
        if self.timing:
            _sync(self.spec.device)
            self.times.append((time.perf_counter() - start) * 1e3)
        if self.force is not None and output.logits is not None:
            forcing = time.perf_counter()
            _force_acceptance(output.logits, batch, self.force)
            if self.timing:
                _sync(self.spec.device)
                self.force_times.append((time.perf_counter() - forcing) * 1e3)
        return output


def _force_acceptance(logits: torch.Tensor, batch: ForwardBatch, force: Forcing) -> None:
    """Make the first ``n`` drafts of each row the greedy target token and the next one not (``zero``: n = 0,
    ``full``: every draft), without a host sync: the edit is queued behind the forward."""
    accepted = 0 if force == "zero" else None if force == "full" else int(force)
    index, value = [], []
    start = 0
    for length in batch.query_lens:
        drafts = length - 1  # a verify row: its pending token, then its drafts
        take = drafts if accepted is None else min(accepted, drafts)
        index.extend(range(start, start + take))
        value.extend([1] * take)
        if take < drafts:
            index.append(start + take)
            value.append(0)
        start += length
    if not index:
        return
    host = batch.token_ids.cpu()
    staged = torch.tensor([index, host[torch.tensor(index) + 1].tolist(), value], dtype=torch.int64)
    if logits.device.type == "cuda":
        staged = staged.pin_memory()
    rows, following, accept = staged.to(logits.device, non_blocking=True)
    limits = torch.finfo(logits.dtype)
    logits[rows, following] = torch.where(accept.bool(), limits.max, limits.min).to(logits.dtype)


class TimedDrafter:
    """The drafter as the round sees it: ``draft`` timed (device-synced), everything else passed through."""

    def __init__(self, drafter: MTPDrafter) -> None:
        self._drafter = drafter
        self.timing = False
        self.times: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def draft(self, rows: Seq[DraftRow], counts: Seq[int]) -> Any:
        if not self.timing:
            return self._drafter.draft(rows, counts)
        device = self._drafter.runtime.model.device
        _sync(device)
        start = time.perf_counter()
        drafts = self._drafter.draft(rows, counts)
        _sync(device)
        self.times.append((time.perf_counter() - start) * 1e3)
        return drafts


class SpecRows(RoundHarness):
    """The engine's round harness with a timed drafter and a timed, acceptance-forcing runtime."""

    def round_parts(self, runtime: ModelRuntime, drafter: Drafter) -> tuple[Any, Any]:
        self.timed_runtime = TimedRuntime(runtime)  # type: ignore[arg-type]
        self.timed_drafter = TimedDrafter(drafter)  # type: ignore[arg-type]
        return self.timed_runtime, self.timed_drafter

    def run_round(self, force: Forcing, *, instrumented: bool) -> float:
        """One round with the given forced acceptance; returns its ms (device-synced around it)."""
        self.timed_runtime.force = force
        self.timed_runtime.timing = self.timed_drafter.timing = instrumented
        _sync(self.device)
        start = time.perf_counter()
        finished = self.run()
        _sync(self.device)
        elapsed = (time.perf_counter() - start) * 1e3
        if finished:
            raise ConfigError("a benchmark sequence finished early; its output budget was sized too small")
        return elapsed

    def warm_shapes(self) -> None:
        """Rounds accepting 0, 1, .., k drafts in turn, twice, then 0 once more: the drafts write tails of every
        length 1..k+1 at least twice, so each shape is compiled and captured, then replayed."""
        k = self.drafter.draft_tokens
        for accepted in [*range(k + 1), *range(k + 1), 0]:
            self.run_round(accepted, instrumented=False)


def measure_rounds(rows: SpecRows, force: Acceptance, rounds: int, warmup: int) -> dict[str, Any]:
    """Whole-round ms (uninstrumented) and the parts (instrumented rounds) at one forced acceptance (medians)."""
    for _ in range(warmup):
        rows.run_round(force, instrumented=False)
    accepted_before = rows.accepted_tokens()
    whole = [rows.run_round(force, instrumented=False) for _ in range(rounds)]
    accepted = (rows.accepted_tokens() - accepted_before) / (rounds * len(rows.sequences))
    timed_runtime, timed_drafter = rows.timed_runtime, rows.timed_drafter
    timed_runtime.times.clear()
    timed_runtime.force_times.clear()
    timed_drafter.times.clear()
    instrumented = [rows.run_round(force, instrumented=True) for _ in range(rounds)]
    rest = [
        t - d - v - f
        for t, d, v, f in zip(instrumented, timed_drafter.times, timed_runtime.times, timed_runtime.force_times)
    ]
    return {
        "round_ms": statistics.median(whole),
        "draft_ms": statistics.median(timed_drafter.times),
        "verify_ms": statistics.median(timed_runtime.times),
        "accept_rollback_ms": statistics.median(rest),
        "forcing_ms": statistics.median(timed_runtime.force_times),
        "instrumented_round_ms": statistics.median(instrumented),
        "accepted_per_row_round": accepted,
    }


def check_settings(
    backend: str, draft_tokens: int, concurrency: Seq[int], context: int, rounds: int, warmup: int, decode_steps: int
) -> float:
    """A ``ConfigError`` for settings the benchmark cannot run; else the expected tokens per round (MTP profile)."""
    if backend not in SPEC_BACKENDS:
        raise ConfigError(
            f"--synthetic benchmarks --spec {' or '.join(SPEC_BACKENDS)}, not {backend!r}: a synthetic model has no "
            "trained companion drafter",
            param="spec",
        )
    if not concurrency or min(concurrency) < 1 or context < 1 or rounds < 1 or warmup < 0 or decode_steps < 1:
        raise ConfigError("concurrency values, context, rounds and decode_steps must be positive, warmup >= 0")
    return MTP_PROFILE.expected_tokens(draft_tokens)


def build_spec_runtime(
    name: str, *, device: str | torch.device | None = None, cuda_graphs: bool = True, seed: int = 0
) -> Qwen35Runtime:
    """The named preset's trunk plus one MTP layer, random weights built on ``device`` (bf16 on CUDA, else fp32)."""
    config_dict = {**preset_config(name), "mtp_num_hidden_layers": 1}
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    tensors = random_text_weights(config_dict, device=target, dtype=dtype, seed=seed)
    tensors.update(random_mtp_weights(config_dict, device=target, dtype=dtype, seed=seed))
    source = InMemorySource(name, config_dict, tensors)
    return build_runtime(source, dtype=dtype, device=target, cuda_graphs=cuda_graphs)


def spec_bench(
    runtime: Qwen35Runtime,
    name: str,
    *,
    draft_tokens: int,
    backend: str = "mtp",
    lm_head_draft: bool = False,
    concurrency: Seq[int] = (1, 4),
    context: int = 256,
    rounds: int = 12,
    warmup: int = 3,
    decode_steps: int = 32,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure one speculative round against a plain decode step on ``runtime`` (from :func:`build_spec_runtime`)."""
    expected = check_settings(backend, draft_tokens, concurrency, context, rounds, warmup, decode_steps)
    device = runtime.spec.device
    drafter = MTPDrafter(runtime, draft_tokens, lm_head_draft)
    generator = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, runtime.config.vocab_size, (max(concurrency), context), generator=generator)
    result: dict[str, Any] = {
        "model": name,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(runtime.spec.dtype).removeprefix("torch."),
        "cuda_graphs": bool(runtime.decoder is not None and runtime.decoder.use_graphs),
        "spec": backend,
        "draft_tokens": draft_tokens,
        "lm_head_draft": lm_head_draft,
        "context": context,
        "rounds": rounds,
        "profile": {**attrs.asdict(MTP_PROFILE), "expected_tokens_per_round": expected},
        "concurrency": {},
    }
    clock = Clock(device)
    for count in concurrency:
        result["concurrency"][str(count)] = _measure_concurrency(
            runtime, drafter, prompts[:count], rounds, warmup, decode_steps, clock, expected
        )
    return result


def run_spec_bench(
    name: str,
    *,
    draft_tokens: int,
    backend: str = "mtp",
    lm_head_draft: bool = False,
    concurrency: Seq[int] = (1, 4),
    context: int = 256,
    rounds: int = 12,
    warmup: int = 3,
    decode_steps: int = 32,
    cuda_graphs: bool = True,
    device: str | None = None,
    seed: int = 0,
    json: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build the named synthetic model with an MTP layer and benchmark one speculative round (see the module doc);
    prints a table (or JSON) and returns the numbers."""
    check_settings(backend, draft_tokens, concurrency, context, rounds, warmup, decode_steps)  # before building
    runtime = build_spec_runtime(name, device=device, cuda_graphs=cuda_graphs, seed=seed)
    result = spec_bench(
        runtime, name, draft_tokens=draft_tokens, backend=backend, lm_head_draft=lm_head_draft,
        concurrency=concurrency, context=context, rounds=rounds, warmup=warmup, decode_steps=decode_steps, seed=seed,
    )
    echo(json_module.dumps(result, indent=2) if json else format_spec_table(result))
    return result


def _measure_concurrency(
    runtime: Qwen35Runtime, drafter: MTPDrafter, prompts: torch.Tensor, rounds: int, warmup: int,
    decode_steps: int, clock: Clock, expected: float,
) -> dict[str, Any]:
    count = prompts.shape[0]
    plain_ms = bench_ninfer_decode(runtime, prompts, decode_steps, clock)[0] / decode_steps
    rows = SpecRows(runtime, drafter, prompts, 2 * (warmup + 2 * rounds) + 2 * drafter.draft_tokens + 3)
    try:
        rows.warm_shapes()
        by_acceptance = {force: measure_rounds(rows, force, rounds, warmup) for force in ("zero", "full")}
        verify_on_graph_runner = rows.timed_runtime.graph_batches > 0
        draft_path = _draft_path(drafter)
    finally:
        rows.close()
    slower = max(entry["round_ms"] for entry in by_acceptance.values())
    projected = count * expected / (slower / 1e3)
    return {
        "plain_step_ms": plain_ms,
        "plain_tok_s": count / (plain_ms / 1e3),
        **by_acceptance,
        "round_over_plain": {force: entry["round_ms"] / plain_ms for force, entry in by_acceptance.items()},
        "verify_path": "cuda verify runner" if verify_on_graph_runner else "eager",
        "draft_path": draft_path,
        "projected_tok_s": projected,
        "projected_speedup": projected / (count / (plain_ms / 1e3)),
    }


def _draft_path(drafter: MTPDrafter) -> str:
    """How the drafter ran the rounds' drafts: captured graphs, the fused kernels eagerly, or the generic path."""
    runner = drafter.fused_runner
    if runner is None:
        return "generic"
    return "cuda graphs" if runner.captured() else "fused eager"


def format_spec_table(result: Mapping[str, Any]) -> str:
    """A short human-readable summary of ``run_spec_bench``'s result."""
    profile = result["profile"]
    k = result["draft_tokens"]
    lines = [
        f"{result['model']} on {result['device']} ({result['dtype']}, cuda graphs {result['cuda_graphs']}), "
        f"--spec {result['spec']} --draft-tokens {k}{' --lm-head-draft' if result['lm_head_draft'] else ''}, "
        f"context {result['context']}, medians of {result['rounds']} rounds",
        f"projected with {profile['name']} acceptance {'/'.join(f'{r:.0%}' for r in profile['rates'][:k])} "
        f"({profile['source']}): {profile['expected_tokens_per_round']:.2f} tokens per round",
        f"{'rows':>4} | {'accept':>6} | {'plain ms':>8} | {'draft ms':>8} | {'verify ms':>9} | {'acc+rb ms':>9} | "
        f"{'round ms':>8} | {'÷ plain':>7} | {'verify path':>18} | {'draft path':>11}",
    ]
    for rows, entry in result["concurrency"].items():
        for force in ("zero", "full"):
            part = entry[force]
            lines.append(
                f"{rows:>4} | {force:>6} | {entry['plain_step_ms']:8.3f} | {part['draft_ms']:8.3f} | "
                f"{part['verify_ms']:9.3f} | {part['accept_rollback_ms']:9.3f} | {part['round_ms']:8.3f} | "
                f"{entry['round_over_plain'][force]:7.3f} | {entry['verify_path']:>18} | {entry['draft_path']:>11}"
            )
        lines.append(
            f"{rows:>4} rows: plain {entry['plain_tok_s']:.1f} tok/s; PROJECTED {entry['projected_tok_s']:.1f} tok/s "
            f"({entry['projected_speedup']:.2f}x plain; slower round time, published acceptance)"
        )
    return "\n".join(lines)
