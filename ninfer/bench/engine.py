"""``ninfer bench ARTIFACT``: an offline throughput/latency benchmark through the resident Engine.

Each round submits ``--concurrency`` requests at once with synthetic prompts of random token ids (seeded)
and greedy decoding of exactly ``--output-len`` tokens (end-of-sequence ignored). Token commit times are
stamped by the executor, so consuming the events never skews the numbers.
"""

from __future__ import annotations

import json
import random
from typing import Any, Sequence

import attrs
import click

from ninfer.bench.stats import percentile
from ninfer.core.errors import NinferError

WEIGHT_DTYPES = ("auto", "bfloat16", "float16", "float32")


@attrs.frozen
class RequestSample:
    """What one benchmark request measured (seconds, monotonic clock)."""

    submitted_at: float
    admitted_at: float
    prompt_done_at: float
    token_times: tuple[float, ...]
    prompt_tokens: int


@attrs.frozen
class BenchResult:
    prefill_tokens_per_second: float
    decode_tokens_per_second_per_stream: float
    decode_tokens_per_second_aggregate: float
    ttft_ms: dict[str, float]
    inter_token_ms: dict[str, float]

    @classmethod
    def from_rounds(cls, rounds: list[list[RequestSample]]) -> "BenchResult":
        prefill_rates, stream_rates, aggregate_rates, ttfts, gaps = [], [], [], [], []
        for samples in rounds:
            prompt_span = max(s.prompt_done_at for s in samples) - min(s.admitted_at for s in samples)
            prefill_rates.append(_rate(sum(s.prompt_tokens for s in samples), prompt_span))
            # Aggregate decode: the steady state once every stream has its first token.
            all_decoding = max(s.token_times[0] for s in samples)
            decoded = sum(1 for s in samples for t in s.token_times if t > all_decoding)
            aggregate_rates.append(_rate(decoded, max(s.token_times[-1] for s in samples) - all_decoding))
            for sample in samples:
                times = sample.token_times
                stream_rates.append(_rate(len(times) - 1, times[-1] - times[0]))
                ttfts.append((times[0] - sample.submitted_at) * 1000.0)
                gaps.extend((b - a) * 1000.0 for a, b in zip(times, times[1:]))
        return cls(
            prefill_tokens_per_second=_mean(prefill_rates),
            decode_tokens_per_second_per_stream=_mean(stream_rates),
            decode_tokens_per_second_aggregate=_mean(aggregate_rates),
            ttft_ms=_percentiles(ttfts),
            inter_token_ms=_percentiles(gaps),
        )


def _rate(count: int, seconds: float) -> float:
    return count / seconds if count > 0 and seconds > 0 else 0.0


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _percentiles(values: Sequence[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99)}


def run_round(engine: Any, prompts: list[list[int]], output_len: int) -> list[RequestSample]:
    """Submit every prompt at once, then read each request's events (buffered by its handle)."""
    from ninfer.core.request import GenerationRequest, SamplingParams
    from ninfer.engine import TokensEvent

    sampling = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    handles = [engine.submit(GenerationRequest(prompt, sampling)) for prompt in prompts]
    samples = []
    for handle, prompt in zip(handles, prompts):
        times = [event.time for event in handle if isinstance(event, TokensEvent) for _ in event.token_ids]
        timings = handle.outcome.timings
        samples.append(RequestSample(timings.submitted_at, timings.admitted_at, timings.prompt_done_at, tuple(times), len(prompt)))
    return samples


def synthetic_prompts(rng: random.Random, count: int, length: int, vocab_limit: int) -> list[list[int]]:
    return [[rng.randrange(vocab_limit) for _ in range(length)] for _ in range(count)]


@click.command("bench")
@click.argument("artifact", type=click.Path(exists=True), required=False)
@click.option("--synthetic", metavar="NAME", default=None,
              help="instead of an artifact: a random-weight model of a named real configuration (qwen3.6-27b, "
                   "qwen3.6-35b-a3b, ...) built on the device, measured against transformers and the roofline")
@click.option("--no-transformers", is_flag=True, help="--synthetic: skip the transformers comparison")
@click.option("--no-cuda-graph", is_flag=True, help="decode without CUDA graphs")
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True, help="prompt tokens per request")
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True, help="output tokens per request")
@click.option("--concurrency", type=click.IntRange(1, 8), default=1, show_default=True, help="requests per round (1..8)")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="unmeasured rounds first")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True, help="measured rounds")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=1024, show_default=True, help="text-prefill chunk")
@click.option("--device", default=None, help="torch device (default: cuda when available, else cpu)")
@click.option("--dtype", type=click.Choice(WEIGHT_DTYPES), default="auto", show_default=True, help="weight dtype")
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the synthetic prompts")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@click.option("--spec", default=None, metavar="NAME",
              help="speculative backend (mtp); needs --draft-tokens; with --synthetic: the cost of one round "
                   "(draft + verify + acceptance/rollback) against a plain decode step, and the projected decode rate")
@click.option("--draft-tokens", type=click.IntRange(min=1), default=None, help="draft tokens per speculative round")
@click.option("--lm-head-draft", is_flag=True, help="draft with the reduced (frequency-ranked) proposal head")
@click.option("--kv-dtype", default="bf16", show_default=True, metavar="NAME",
              help="KV-cache storage of an artifact's run (bf16, int8, fp8, nvfp4, k8v4; quantized: CPU only)")
@click.pass_context
def bench_command(
    ctx: click.Context,
    artifact: str | None,
    synthetic: str | None,
    no_transformers: bool,
    no_cuda_graph: bool,
    prompt_len: int,
    output_len: int,
    concurrency: int,
    warmup: int,
    repeats: int,
    prefill_chunk: int,
    device: str | None,
    dtype: str,
    seed: int,
    as_json: bool,
    spec: str | None,
    draft_tokens: int | None,
    lm_head_draft: bool,
    kv_dtype: str,
) -> None:
    """Offline benchmark: prefill and decode throughput, TTFT and inter-token latency percentiles."""
    if (spec is None) != (draft_tokens is None) or (lm_head_draft and spec is None):
        raise click.UsageError("--spec and --draft-tokens go together (--lm-head-draft needs both)")
    if synthetic is not None:
        explicit = lambda name: ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE  # noqa: E731
        if spec is not None:
            assert draft_tokens is not None
            _synthetic_spec_bench(
                synthetic, spec, draft_tokens, lm_head_draft,
                concurrency=(concurrency,) if explicit("concurrency") else (1, 4),
                context=prompt_len if explicit("prompt_len") else 256,
                rounds=repeats if explicit("repeats") else 12, warmup=warmup if explicit("warmup") else 3,
                cuda_graphs=not no_cuda_graph, device=device, as_json=as_json,
            )
            return
        from ninfer.bench.synthetic import run_synthetic_bench

        try:
            run_synthetic_bench(
                synthetic,
                concurrency=(concurrency,) if explicit("concurrency") else (1, 2, 4, 8),
                prompt_len=prompt_len if explicit("prompt_len") else 8192,
                compare_transformers=not no_transformers,
                cuda_graphs=not no_cuda_graph,
                device=device,
                json=as_json,
                echo=click.echo,
            )
        except NinferError as exc:
            raise click.ClickException(exc.message) from None
        return
    if artifact is None:
        raise click.UsageError("give an ARTIFACT or --synthetic NAME")
    from ninfer.core.runtime import LoadOptions
    from ninfer.engine import EngineConfig
    from ninfer.llm import _default_device
    from ninfer.server.compose import load_engine

    device = device or _default_device()
    tokens_per_request = prompt_len + output_len
    from ninfer.core.drafting import SpeculativeConfig

    speculative = SpeculativeConfig(spec, draft_tokens, lm_head_draft) if spec is not None and draft_tokens else None
    try:
        config = EngineConfig(
            max_concurrency=concurrency,
            max_pending_requests=0,
            pending_timeout_ms=None,
            prefill_chunk=prefill_chunk,
            max_context=tokens_per_request,
            kv_capacity=tokens_per_request * concurrency,
            prefix_reuse=False,
            kv_dtype=kv_dtype,
        )
        loaded = load_engine(
            artifact, config, load_options=LoadOptions(device=device, dtype=dtype, cuda_graphs=not no_cuda_graph),
            speculative=speculative,
        )
    except NinferError as exc:
        raise click.ClickException(exc.message) from None
    try:
        loaded.engine.warm_up()  # as the server does before it is ready: compiles and captures are not request time
        specials = loaded.tokenizer.special_token_ids
        vocab_limit = min([loaded.engine.vocab_limit or loaded.runtime.spec.vocab_size, *specials])
        rng = random.Random(seed)
        rounds = []
        for index in range(warmup + repeats):
            samples = run_round(loaded.engine, synthetic_prompts(rng, concurrency, prompt_len, vocab_limit), output_len)
            if index >= warmup:
                rounds.append(samples)
        result = BenchResult.from_rounds(rounds)
    finally:
        loaded.close()
    report = {
        "model_id": loaded.artifact.manifest.identity.model_id,
        "device": str(loaded.runtime.spec.device),
        "dtype": str(loaded.runtime.spec.dtype).removeprefix("torch."),
        "prompt_len": prompt_len,
        "output_len": output_len,
        "concurrency": concurrency,
        "warmup": warmup,
        "repeats": repeats,
        "prefill_chunk": prefill_chunk,
        **attrs.asdict(result),
    }
    click.echo(json.dumps(report) if as_json else _pretty(report))


def _synthetic_spec_bench(
    name: str, spec: str, draft_tokens: int, lm_head_draft: bool, *, concurrency: tuple[int, ...], context: int,
    rounds: int, warmup: int, cuda_graphs: bool, device: str | None, as_json: bool,
) -> None:
    """``--synthetic NAME --spec mtp``: the cost of one speculative round (``ninfer.bench.spec``); ``--prompt-len``
    is the context, ``--repeats`` / ``--warmup`` count timed / untimed rounds per acceptance."""
    from ninfer.bench.spec import run_spec_bench

    try:
        run_spec_bench(
            name, draft_tokens=draft_tokens, backend=spec, lm_head_draft=lm_head_draft, concurrency=concurrency,
            context=context, rounds=rounds, warmup=warmup, cuda_graphs=cuda_graphs, device=device, json=as_json,
            echo=click.echo,
        )
    except NinferError as exc:
        raise click.ClickException(exc.message) from None


def _pretty(report: dict[str, Any]) -> str:
    lines = [
        f"ninfer bench: {report['model_id']} on {report['device']} ({report['dtype']}), prompt {report['prompt_len']}, "
        f"output {report['output_len']}, concurrency {report['concurrency']}, "
        f"{report['repeats']} repeats after {report['warmup']} warmup",
        f"  prefill            {report['prefill_tokens_per_second']:12.1f} tok/s",
        f"  decode per stream  {report['decode_tokens_per_second_per_stream']:12.1f} tok/s",
        f"  decode aggregate   {report['decode_tokens_per_second_aggregate']:12.1f} tok/s",
    ]
    for label, key in (("TTFT", "ttft_ms"), ("inter-token", "inter_token_ms")):
        stats = report[key]
        lines.append(
            f"  {label:<12} ms    p50 {stats['p50']:9.2f}   p90 {stats['p90']:9.2f}   p99 {stats['p99']:9.2f}"
        )
    return "\n".join(lines)
