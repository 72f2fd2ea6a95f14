"""Quantized ``--kv-dtype`` pools on the CPU reference path: a tiny Qwen3.5 (head dim 64, so every codec's group
divides it) generates with each format close to model-dtype KV, stores exactly the codec's bytes, and reuses
prefixes (device and host tier) without changing outputs."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from live_server import start_servers, tiny_artifact

import ninfer.plugins.qwen3_5.model.tiny as tiny_module
from ninfer import SamplingParams
from ninfer.core.artifact.source import open_model_source
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from ninfer.core.errors import ConfigError
from ninfer.core.plugins import load_plugin_manager
from ninfer.core.request import GenerationRequest
from ninfer.core.runtime import ForwardBatch, KVCache, LoadOptions, StateCache
from ninfer.engine import Engine, EngineConfig
from ninfer.quant.kv_codecs import KV_CODECS, hadamard_rotate, pool_codec
from ninfer.server.compose import artifact_tokenizer, check_kv_dtype

HEAD_DIM = 64
TOKENS = 16
PAGE = 8
#: measured on this model (4 prompts x 16 greedy tokens; last-logit relative error of a 60-token prompt):
#: int8 64/64, 0.0040; fp8 64/64, 0.017; nvfp4 27/64, 0.065; k8v4 38/64, 0.042. Asserted with margin.
AGREEMENT = {"int8": 0.9, "fp8": 0.9, "nvfp4": 0.25, "k8v4": 0.35}
LOGIT_ERROR = {"int8": 0.01, "fp8": 0.04, "nvfp4": 0.15, "k8v4": 0.1}
#: relative norm error of one stored layer's K / V against the K / V the model computed (measured: int8 0.006,
#: fp8 0.025, nvfp4 0.094, k8v4 0.025 / 0.094)
PLANE_ERROR = {"int8": (0.015, 0.015), "fp8": (0.05, 0.05), "nvfp4": (0.2, 0.2), "k8v4": (0.05, 0.2)}
QUANTIZED = ("int8", "fp8", "nvfp4", "k8v4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model with head dim 64 (its rotary dim kept at 8)."""
    original = tiny_module.tiny_config

    def wider(family, *, mtp):
        config = original(family, mtp=mtp)
        text = config["text_config"]
        text["head_dim"] = HEAD_DIM
        text["partial_rotary_factor"] = text["rope_parameters"]["partial_rotary_factor"] = 8 / HEAD_DIM
        return config

    registries = load_plugin_manager(entry_points=False).registries
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_module, "tiny_config", wider)
        path = write_tiny_artifact(tmp_path_factory.mktemp("kvq") / "tiny.ninfer", TinyOptions(seed=0), registries)
    artifact = open_model_source(path)
    runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, LoadOptions())
    assert runtime.spec.attention_layers[0].head_dim == HEAD_DIM
    yield artifact, runtime, artifact_tokenizer(artifact)
    artifact.close()


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(200, 150_000) for _ in range(n)] for n in lengths]


def engine(tiny, kv_dtype, **options) -> Engine:
    artifact, runtime, tokenizer = tiny
    config = EngineConfig(**{"max_concurrency": 4, "max_context": 256, "pending_timeout_ms": None,
                             "kv_dtype": kv_dtype, **options})
    return Engine(runtime, config, tokenizer=tokenizer, eos_token_ids=artifact.manifest.eos_token_ids)


def greedy(prompt, tokens=TOKENS) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(temperature=0.0, max_tokens=tokens))


def generate(tiny, kv_dtype, batch, **options):
    with engine(tiny, kv_dtype, **options) as running:
        return [running.submit(greedy(p)).result(120).output_token_ids for p in batch]


def prefill(runtime, kv_dtype, prompt):
    """One prefill of ``prompt`` into a fresh pool: the last logits and the pool."""
    pages = -(-len(prompt) // PAGE)
    kv = KVCache.allocate(runtime.spec, pages, PAGE, codec=pool_codec(kv_dtype))
    state = StateCache.allocate(runtime.spec, 1)
    batch = ForwardBatch(token_ids=torch.tensor(prompt), positions=torch.arange(len(prompt)).expand(3, -1),
                         query_lens=[len(prompt)], context_lens=[0], page_tables=torch.arange(pages)[None],
                         state_slots=torch.tensor([0]))
    return runtime.forward(batch, kv, state).logits, kv


def relative(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_generation_stays_close_to_model_dtype_kv(tiny, kv_dtype):
    batch = prompts([40, 25, 60, 33])
    reference, quantized = generate(tiny, "bf16", batch), generate(tiny, kv_dtype, batch)
    agree = sum(a == b for ref, out in zip(reference, quantized) for a, b in zip(ref, out))
    assert agree >= AGREEMENT[kv_dtype] * len(batch) * TOKENS
    runtime = tiny[1]
    ref_logits, ref_kv = prefill(runtime, "bf16", batch[2])
    logits, kv = prefill(runtime, kv_dtype, batch[2])
    assert 0 < relative(logits, ref_logits) < LOGIT_ERROR[kv_dtype]
    # the first attention layer's inputs do not depend on the KV format: its stored bytes decode (here, by hand:
    # codes then scales, the codec's decode, the Hadamard where rotated) to the K/V the model computed
    codec, tokens = KV_CODECS[kv_dtype], len(batch[2])
    for stored, plane, rotated, reference_plane, bound in (
        (kv.key[0], codec.key, codec.rotate_keys, ref_kv.key[0], PLANE_ERROR[kv_dtype][0]),
        (kv.value[0], codec.value, codec.rotate_values, ref_kv.value[0], PLANE_ERROR[kv_dtype][1]),
    ):
        assert stored.dtype == torch.uint8 and stored.shape[-1] == plane.bytes_per_vector(HEAD_DIM)
        rows = stored.flatten(0, 1)[:tokens]
        split = HEAD_DIM * plane.code_bits // 8
        decoded = plane.decode(rows[..., :split].contiguous().view(plane.code_dtype),
                               rows[..., split:].contiguous().view(plane.scale_dtype))
        decoded = hadamard_rotate(decoded) if rotated else decoded
        computed = reference_plane.flatten(0, 1)[:tokens]
        assert 0 < relative(decoded, computed) < bound


@pytest.mark.parametrize("kv_dtype", ["fp8", "nvfp4"])
def test_prefix_reuse_and_host_tier_match_a_cold_run(tiny, kv_dtype):
    first, other = prompts([30, 28], seed=1)
    follow_up = first + prompts([5], seed=2)[0]
    cold = generate(tiny, kv_dtype, [first, follow_up], prefix_reuse=False)
    with engine(tiny, kv_dtype, page_size=PAGE) as running:
        a, exact = (running.submit(greedy(first)).result(120) for _ in range(2))
        extended = running.submit(greedy(follow_up)).result(120)
    assert [a.output_token_ids, exact.output_token_ids] == [cold[0], cold[0]]
    assert exact.cached_tokens == len(first) and extended.cached_tokens > 0
    assert extended.output_token_ids == cold[1]
    # one device checkpoint slot: the second prompt evicts the first's checkpoint to the host tier, and the repeat
    # of the first prompt restores its quantized pages from there
    with engine(tiny, kv_dtype, page_size=PAGE, max_concurrency=1, device_state_slots=1, host_state_slots=4,
                host_kv_mib=64) as running:
        running.submit(greedy(first)).result(120)
        running.submit(greedy(other)).result(120)
        restored = running.submit(greedy(first)).result(120)
        host = running.stats().memory.host_tier
    assert host.spills >= 1 and host.hits == 1
    assert restored.cached_tokens == len(first)
    assert restored.output_token_ids == cold[0]


def test_serve_with_fp8_kv_answers_a_chat(tmp_path_factory):
    artifact = tiny_artifact(tmp_path_factory)
    folder = tmp_path_factory.mktemp("kv-fp8")
    log = folder / "requests.jsonl"
    model_id = "ninfer-tiny-qwen3-5"
    server = start_servers(folder, [(artifact, ["--kv-dtype", "fp8", "--log-stats-interval-ms", "0",
                                                "--request-log-jsonl", str(log)], {})], [model_id])[0]
    try:
        reply = httpx.post(server.url("/v1/chat/completions"), timeout=120, json={
            "model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"] is not None
    finally:
        server.stop()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    start = next(r for r in records if r.get("event") == "server_start")
    assert start["capacities"]["kv_dtype"] == "fp8"


def test_a_codec_that_cannot_store_the_head_dim_is_refused_when_the_pool_is_built(tmp_path):
    """The standard tiny model's heads are 32 wide: int8's 64-element scale groups do not divide them (fp8's one
    scale per vector does), and the refusal names the dtype before any forward runs."""
    registries = load_plugin_manager(entry_points=False).registries
    artifact = open_model_source(write_tiny_artifact(tmp_path / "tiny.ninfer", TinyOptions(seed=0), registries))
    try:
        runtime = registries.family_for(artifact.manifest).require("load_runtime")(artifact, LoadOptions())
        assert runtime.spec.attention_layers[0].head_dim == 32
        with pytest.raises(ConfigError, match="--kv-dtype int8 .*groups of 64.*head dim 32"):
            KVCache.allocate(runtime.spec, 4, PAGE, codec=pool_codec("int8"))
        assert KVCache.allocate(runtime.spec, 4, PAGE, codec=pool_codec("fp8")).key[0].dtype == torch.uint8
    finally:
        artifact.close()


def test_a_quantized_kv_dtype_on_cuda_is_refused_before_the_model_loads():
    for name in QUANTIZED:
        with pytest.raises(ConfigError, match=f"--kv-dtype {name} on CUDA needs the quantized attention kernels"):
            check_kv_dtype(EngineConfig(kv_dtype=name), LoadOptions(device="cuda"))
    check_kv_dtype(EngineConfig(kv_dtype="bf16"), LoadOptions(device="cuda"))
    check_kv_dtype(EngineConfig(kv_dtype="fp8"), LoadOptions(device="cpu"))
