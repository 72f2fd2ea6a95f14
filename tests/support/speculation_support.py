"""Shared helpers of the speculative-decoding tests: a tiny artifact with companion weights, engines over it,
batched runs, the pool-idle check and a plain greedy run beside a speculative one."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from ninfer.core.artifact.source import open_model_source
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.engine import Engine, EngineConfig
from ninfer.server.compose import artifact_tokenizer, build_drafter
from ninfer.core.drafting import Draft, SpeculativeConfig
from ninfer.core.runtime import LoadOptions

MAX_CONTEXT = 256


def open_tiny(path: Any, registries: Any) -> Iterator[tuple[Any, Any, Any]]:
    """Yield ``(artifact, runtime, tokenizer)`` of a tiny artifact, closing it afterwards (a fixture body)."""
    artifact = open_model_source(path)
    runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, LoadOptions())
    yield artifact, runtime, artifact_tokenizer(artifact)
    artifact.close()


def make_engine(tiny: tuple[Any, Any, Any], drafter: Any = None, **options: Any) -> Engine:
    artifact, runtime, tokenizer = tiny
    # the KV pool sized as on CPU: "auto" on CUDA takes the free device memory, which an earlier engine of the same
    # process may still hold in torch's caching allocator
    config = dict(max_concurrency=4, max_context=MAX_CONTEXT, kv_capacity=4 * MAX_CONTEXT, pending_timeout_ms=None)
    config.update(options)
    return Engine(
        runtime, EngineConfig(**config), tokenizer=tokenizer, eos_token_ids=artifact.manifest.eos_token_ids,
        drafter=drafter,
    )


def drafter_for(tiny: tuple[Any, Any, Any], registries: Any, backend: str, k: int, lm_head_draft: bool = False) -> Any:
    return build_drafter(tiny[0], tiny[1], SpeculativeConfig(backend, k, lm_head_draft), registries)


def run(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], **sampling: Any) -> list[Any]:
    """Submit every prompt at once and collect the outcomes in order."""
    handles = [
        engine.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=m, **sampling)))
        for p, m in zip(prompts, max_tokens)
    ]
    return [handle.result(120) for handle in handles]


def assert_idle(engine: Engine) -> None:
    """No reservation outstanding; every page and slot is free or held by a checkpoint."""
    memory = engine.stats().memory
    assert memory.promised_pages == 0
    assert memory.free_pages + memory.checkpoint_pages == memory.total_pages
    assert memory.free_slots + memory.checkpoints == memory.total_slots


def greedy_plain_then_speculative(
    tiny: tuple[Any, Any, Any],
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    make_drafter: Callable[[dict[tuple[int, ...], list[int]]], Any],
) -> tuple[list[Any], list[Any], Any]:
    """Greedy runs of ``prompts`` without speculation, then with ``make_drafter(references)`` (each prompt's whole
    plain sequence, prompt and output, keyed by the prompt); ``(plain results, speculative results, drafter)``,
    the speculative engine idle after its run."""
    with make_engine(tiny) as engine:
        plain = run(engine, prompts, max_tokens, temperature=0.0)
    drafter = make_drafter({tuple(p): [*p, *o.output_token_ids] for p, o in zip(prompts, plain)})
    with make_engine(tiny, drafter) as engine:
        results = run(engine, prompts, max_tokens, temperature=0.0)
        assert_idle(engine)
    return plain, results, drafter


def reference_drafts(
    rows: Sequence[Any], counts: Sequence[int], references: dict[tuple[int, ...], list[int]],
    wrong: Callable[[int], bool], filler: int,
) -> list[Draft]:
    """Each row's next ``count`` tokens of its known continuation (``references``: prompt -> prompt + continuation;
    ``filler`` past its end), each one made wrong (+1 mod 1000) where ``wrong(output position)``."""
    drafts = []
    for seq, count in zip(rows, counts):
        reference = references[tuple(seq.prompt)]
        tokens = []
        for position in range(len(seq.tokens), len(seq.tokens) + count):
            token = reference[position] if position < len(reference) else filler
            tokens.append((token + 1) % 1000 if wrong(position - seq.prompt_len) else token)
        drafts.append(Draft(tuple(tokens)))
    return drafts
