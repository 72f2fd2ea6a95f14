"""The Engine, the offline LLM API and the bench command on a tiny random-weight Qwen3.5 artifact."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from ninfer import LLM, SamplingParams
from ninfer.bench.engine import bench_command
from ninfer.core.artifact.source import open_model_source
from ninfer.core.request import GenerationRequest
from ninfer.engine import Engine, EngineConfig
from ninfer.core.request import BudgetClose
from ninfer.server.compose import artifact_tokenizer
from ninfer.core.plugins import load_plugin_manager
from ninfer.core.runtime import LoadOptions
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from ninfer.core.tokenizer import IncrementalDetokenizer
from engine_fakes import GatedRuntime, RecordingRuntime
from kernel_support import needs_cuda

MAX_CONTEXT = 256


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    registries = load_plugin_manager(entry_points=False).registries
    return write_tiny_artifact(tmp_path_factory.mktemp("engine") / "tiny.ninfer", TinyOptions(family="qwen3_5", seed=0), registries)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    registries = load_plugin_manager(entry_points=False).registries
    artifact = open_model_source(tiny_path)
    runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, LoadOptions())
    yield artifact, runtime, artifact_tokenizer(artifact)
    artifact.close()


def make_engine(tiny, runtime=None, **options) -> Engine:
    artifact, base_runtime, tokenizer = tiny
    config = dict(max_concurrency=8, max_context=MAX_CONTEXT, pending_timeout_ms=None)
    config.update(options)
    return Engine(runtime or base_runtime, EngineConfig(**config), tokenizer=tokenizer, eos_token_ids=artifact.manifest.eos_token_ids)


def prompts_of(lengths, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 150_000) for _ in range(n)] for n in lengths]


def greedy(prompt, max_tokens, **extra) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra))


def test_greedy_alone_equals_batched_with_seven_others(tiny):
    runtime = RecordingRuntime(tiny[1])
    gate = GatedRuntime(runtime)
    prompts = prompts_of([4, 19, 7, 33, 12, 2, 26, 9])
    with make_engine(tiny, gate, prefix_reuse=False) as engine:
        gate.open()
        alone = [engine.submit(greedy(p, 12)).result(60).output_token_ids for p in prompts]
        runtime.calls.clear()
        gate.close()  # hold the first forward until every request is queued
        handles = [engine.submit(greedy(p, 12)) for p in prompts]
        gate.open()
        batched = [h.result(60).output_token_ids for h in handles]
    assert batched == alone
    assert all(len(tokens) == 12 for tokens in alone)
    assert len(set(alone)) == 8
    assert max(len(rows) for rows in runtime.calls) == 8  # a decode round ran all eight rows in one traversal


def test_prefix_reuse_does_not_change_outputs(tiny):
    prompt = prompts_of([30], seed=1)[0]
    with make_engine(tiny, prefix_reuse=False) as engine:
        cold = engine.submit(greedy(prompt, 8)).result(60)
        follow_up = prompt + list(cold.output_token_ids) + prompts_of([5], seed=2)[0]
        cold_follow_up = engine.submit(greedy(follow_up, 8)).result(60)
    with make_engine(tiny, page_size=8) as engine:
        first = engine.submit(greedy(prompt, 8)).result(60)
        exact = engine.submit(greedy(prompt, 8)).result(60)
        extended = engine.submit(greedy(follow_up, 8)).result(60)
    assert first.output_token_ids == exact.output_token_ids == cold.output_token_ids
    assert exact.cached_tokens == len(prompt)
    assert extended.cached_tokens == len(prompt) + 7
    assert extended.output_token_ids == cold_follow_up.output_token_ids
    assert cold.cached_tokens == cold_follow_up.cached_tokens == first.cached_tokens == 0


def _overlap_scenario(tiny, overlap: bool | None, base_runtime=None, batched: bool = True) -> tuple[list, int]:
    """Requests whose every ending and insert the overlapped decode must get right: (outputs and cached tokens of
    each, forwards launched ahead). ``batched``: also three requests at once (their rounds' composition depends on
    when each is admitted, which a CUDA runtime's kernels see: leave them out there)."""
    runtime = RecordingRuntime(base_runtime or tiny[1])
    prompt = prompts_of([30], seed=11)[0]
    results = []
    with make_engine(tiny, runtime, page_size=8, kv_capacity=8 * MAX_CONTEXT, overlap_decode=overlap) as engine:
        first = engine.submit(greedy(prompt, 10)).result(60)
        stop_id = first.output_token_ids[4]
        stopped = engine.submit(greedy(prompt, 10, stop_token_ids=(stop_id,))).result(60)
        follow_up = prompt + list(stopped.output_token_ids) + prompts_of([4], seed=12)[0]
        resumed = engine.submit(greedy(follow_up, 6)).result(60)  # from the stopped request's endpoint
        policy = BudgetClose(limit=3, close_token_id=first.output_token_ids[-1], insert_token_ids=(11, 12))
        closed = engine.submit(GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=8),
                                                 budget_close=policy)).result(60)
        extra = prompts_of([3], seed=14)[0]
        after_first = engine.submit(greedy(prompt + list(first.output_token_ids) + extra, 4)).result(60)
        after_closed = engine.submit(greedy(prompt + list(closed.output_token_ids) + extra, 4)).result(60)
        sampled = engine.submit(GenerationRequest(prompt, SamplingParams(
            temperature=0.9, seed=5, presence_penalty=0.7, frequency_penalty=0.3, max_tokens=10))).result(60)
        with_stop_string = engine.submit(greedy(prompt, 6, stop=("zzzz",))).result(60)
        batch = [engine.submit(greedy(p, 9)) for p in prompts_of([5, 17, 8], seed=13)] if batched else []
        together = [handle.result(60) for handle in batch]
        for outcome in (first, stopped, resumed, closed, after_first, after_closed, sampled, with_stop_string,
                        *together):
            results.append((outcome.output_token_ids, outcome.cached_tokens, outcome.finish_reason))
    return results, runtime.ahead


def test_overlapped_decode_gives_the_same_tokens_endings_and_checkpoints(tiny):
    """Launching each round's forward before its tokens reach the host changes nothing a client or the prefix
    cache sees: a row ending on a stop id keeps the frontier before it (its state was not updated ahead)."""
    plain, plain_ahead = _overlap_scenario(tiny, overlap=False)
    overlapped, ahead = _overlap_scenario(tiny, overlap=True)
    assert overlapped == plain
    assert plain_ahead == 0 and ahead > 20
    stopped, resumed = plain[1], plain[2]
    assert stopped[2] == "stop" and resumed[1] == 30 + len(stopped[0]) - 1
    closed = plain[3]
    assert closed[0][3:5] == (11, 12)  # the close sequence, inserted after the third token
    assert plain[4][1] == 30 + 10 - 1 and plain[5][1] == 30 + 8 - 1  # the endpoints end before the last token


@pytest.mark.gpu
@needs_cuda
def test_overlapped_decode_on_cuda_gives_the_same_tokens_endings_and_checkpoints(tiny):
    """The same on the CUDA runtime (decode graphs, the masked conv / gated-delta kernels, pinned copies), where the
    overlap is the default; one request at a time."""
    registries = load_plugin_manager(entry_points=False).registries
    runtime = registries.family_for(tiny[0].manifest).require("load_runtime")(
        tiny[0], LoadOptions(device="cuda", dtype="float32")
    )
    plain, plain_ahead = _overlap_scenario(tiny, False, runtime, batched=False)
    overlapped, ahead = _overlap_scenario(tiny, None, runtime, batched=False)
    assert overlapped == plain
    assert plain_ahead == 0 and ahead > 20


def test_prefill_chunk_size_does_not_change_outputs(tiny):
    prompt = prompts_of([40], seed=3)[0]
    outputs = []
    for chunk in (1, 16, 1024):
        with make_engine(tiny, prefill_chunk=chunk, prefix_reuse=False) as engine:
            outputs.append(engine.submit(greedy(prompt, 6)).result(60).output_token_ids)
    assert outputs[0] == outputs[1] == outputs[2]


def test_seeds_reproduce_and_differ(tiny):
    prompt = prompts_of([10], seed=4)[0]
    sampling = dict(temperature=1.0, top_p=0.95, top_k=20, max_tokens=10)
    with make_engine(tiny, prefix_reuse=False) as engine:
        runs = [engine.submit(GenerationRequest(prompt, SamplingParams(seed=seed, **sampling))).result(60) for seed in (5, 5, 6)]
    assert runs[0].output_token_ids == runs[1].output_token_ids
    assert runs[0].output_token_ids != runs[2].output_token_ids
    assert runs[0].seed == 5


def test_stop_string_across_token_boundary_with_the_real_tokenizer(tiny):
    tokenizer = tiny[2]
    prompt = prompts_of([12], seed=5)[0]
    with make_engine(tiny) as engine:
        free = engine.submit(greedy(prompt, 16)).result(60)
        detokenizer = IncrementalDetokenizer(tokenizer)
        pieces = [detokenizer.push(token) for token in free.output_token_ids]
        boundary = next(k for k in range(3, 15) if pieces[k] and pieces[k + 1])
        stop = pieces[boundary][-1] + pieces[boundary + 1][0]
        full = "".join(pieces)
        at = full.index(stop)
        ends = [len("".join(pieces[: k + 1])) for k in range(len(pieces))]
        completing = next(k for k, end in enumerate(ends) if end >= at + len(stop))
        stopped = engine.submit(greedy(prompt, 16, stop=[stop])).result(60)
    assert free.text == tokenizer.decode(list(free.output_token_ids))
    assert stopped.finish_reason == "stop" and stopped.stop.string == stop
    assert stopped.text == full[:at]
    assert stopped.output_token_ids == free.output_token_ids[: completing + 1]


def test_offline_llm_api(tiny_path, tiny):
    tokenizer = tiny[2]
    text_prompt = "The quick brown fox"
    with LLM(tiny_path, device="cpu", max_concurrency=2, max_pending_requests=1, max_context=MAX_CONTEXT, default_max_tokens=8) as llm:
        outputs = llm.generate([text_prompt, [1000, 2000, 3000], "Hello"], SamplingParams(temperature=0.0, max_tokens=5))
        single = llm.generate(text_prompt, SamplingParams(temperature=0.0, max_tokens=5))
        many = llm.generate([[100 + i, 7] for i in range(6)], SamplingParams(temperature=0.0, max_tokens=2))
        default = llm.generate("Hi", None)
        engine = llm.engine
    assert not engine.healthy  # closed with the context manager
    assert [o.prompt_token_ids for o in outputs] == [
        tuple(tokenizer.encode(text_prompt)),
        (1000, 2000, 3000),
        tuple(tokenizer.encode("Hello")),
    ]
    with make_engine(tiny, prefix_reuse=False) as reference:
        for output in outputs:
            expected = reference.submit(greedy(list(output.prompt_token_ids), 5)).result(60)
            assert output.token_ids == expected.output_token_ids
    for output in outputs:
        assert output.finish_reason == "length" and len(output.token_ids) == 5
        assert output.text == tokenizer.decode(list(output.token_ids))
        assert output.usage.prompt_tokens == len(output.prompt_token_ids) and output.usage.completion_tokens == 5
    assert single[0].token_ids == outputs[0].token_ids
    assert len(many) == 6 and [o.prompt_token_ids for o in many] == [(100 + i, 7) for i in range(6)]
    assert len(default) == 1 and 1 <= default[0].usage.completion_tokens <= 8


def test_bench_command_reports_json(tiny_path):
    result = CliRunner().invoke(
        bench_command,
        [str(tiny_path), "--prompt-len", "8", "--output-len", "4", "--concurrency", "2", "--warmup", "0", "--repeats", "1", "--json"],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert (report["prompt_len"], report["output_len"], report["concurrency"]) == (8, 4, 2)
    assert report["prefill_tokens_per_second"] > 0 and report["decode_tokens_per_second_per_stream"] > 0
    assert set(report["ttft_ms"]) == {"p50", "p90", "p99"} and report["ttft_ms"]["p50"] > 0
    assert report["inter_token_ms"]["p99"] >= report["inter_token_ms"]["p50"] > 0


@pytest.mark.gpu
@needs_cuda
def test_engine_on_cuda_with_auto_kv_capacity(tiny_path):
    registries = load_plugin_manager(entry_points=False).registries
    with open_model_source(tiny_path) as artifact:
        runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, LoadOptions(device="cuda"))
        tokenizer = artifact_tokenizer(artifact)
        config = EngineConfig(
            max_concurrency=4, device_state_slots=8, max_context=MAX_CONTEXT, kv_capacity="auto", pending_timeout_ms=None
        )
        with Engine(runtime, config, tokenizer=tokenizer, eos_token_ids=artifact.manifest.eos_token_ids) as engine:
            assert engine.kv_capacity_tokens >= MAX_CONTEXT * 4  # auto fills the free device memory
            prompts = prompts_of([5, 17, 9, 30], seed=6)
            sampled = SamplingParams(temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.2, seed=11, max_tokens=12)
            handles = [engine.submit(GenerationRequest(p, sampled)) for p in prompts]
            first = [h.result(60) for h in handles]
            again = [engine.submit(GenerationRequest(p, sampled)).result(60) for p in prompts]  # exact hits
            assert all(o.completion_tokens == 12 or o.finish_reason == "stop" for o in first)
            assert [o.cached_tokens for o in again] == [len(p) for p in prompts]
            assert [o.output_token_ids[0] for o in again] == [o.output_token_ids[0] for o in first]
            greedy_out = engine.submit(greedy(prompts[0], 8)).result(60)
            assert greedy_out.completion_tokens == 8
            assert engine.stats().memory.free_slots >= 4


# -- warm-up -------------------------------------------------------------------------------------------------------


class WarmUpRecorder:
    """The tiny runtime plus a ``warm_up`` that records the shapes it is asked for and scribbles on its scratch."""

    def __init__(self, runtime) -> None:  # type: ignore[no-untyped-def]
        self.runtime, self.spec, self.shapes = runtime, runtime.spec, []

    def forward(self, batch, kv, state):  # type: ignore[no-untyped-def]
        return self.runtime.forward(batch, kv, state)

    def warm_up(self, kv, state, shapes) -> None:  # type: ignore[no-untyped-def]
        self.shapes.append(shapes)
        kv.key[0][0].fill_(7.0)  # scratch: page 0 and the first slots, which no request may read unwritten
        state.ssm[0][: shapes.max_rows].fill_(7.0)


def test_warm_up_asks_the_runtime_for_every_configured_shape_and_leaves_nothing(tiny):
    recorder = WarmUpRecorder(tiny[1])
    prompts = prompts_of([30, 17], seed=9)
    with make_engine(tiny, prefix_reuse=False) as cold:
        expected = [cold.submit(greedy(prompt, 6)).result(60).output_token_ids for prompt in prompts]
    with make_engine(tiny, recorder, max_concurrency=3, prefill_chunk=64, page_size=16) as engine:
        engine.warm_up()
        [shapes] = recorder.shapes
        assert (shapes.max_rows, shapes.max_pages, shapes.prefill_chunk) == (3, MAX_CONTEXT // 16, 64)
        memory = engine.stats().memory
        assert memory.checkpoints == 0 and memory.free_pages == memory.total_pages
        outputs = [engine.submit(greedy(prompt, 6)).result(60).output_token_ids for prompt in prompts]
    assert outputs == expected  # the scratch the warm-up wrote is never read as a request's state or KV


@pytest.mark.gpu
@needs_cuda
def test_after_warm_up_requests_capture_and_keep_nothing_new(tiny):
    """On CUDA the warm-up captures a decode graph for every batch size and page-table bucket the configuration
    allows, so later requests of any batch size capture none; outputs equal an engine that was not warmed up."""
    registries = load_plugin_manager(entry_points=False).registries
    runtime = registries.family_for(tiny[0].manifest).require("load_runtime")(
        tiny[0], LoadOptions(device="cuda", dtype="float32")
    )
    prompts = prompts_of([40, 9, 23, 70], seed=12)
    with make_engine(tiny, runtime, max_concurrency=4, prefix_reuse=False, kv_capacity=4096) as engine:
        expected = [h.result(60).output_token_ids for h in [engine.submit(greedy(p, 8)) for p in prompts]]
    runtime.decoder.reset()
    with make_engine(tiny, runtime, max_concurrency=4, kv_capacity=4096) as engine:
        engine.warm_up()
        captured = set(runtime.decoder._graphs)
        assert {key[0] for key in captured} == {1, 2, 3, 4}
        assert engine.stats().memory.checkpoints == 0 and engine.stats().memory.selections.root == 0
        outputs = [h.result(60).output_token_ids for h in [engine.submit(greedy(p, 8)) for p in prompts]]
        assert set(runtime.decoder._graphs) == captured
    assert outputs == expected
