"""The DFlash speculative backend: target-layer capture, the drafter against a from-scratch oracle, lossless
decoding, the converter's companion carrying, make-tiny --dflash and startup errors.

Oracles: transformers' Qwen3.5 hidden states for the captured target layers; a dense DFlash forward built from
transformers' Qwen3 norm, RoPE and MLP modules over the whole committed sequence for the drafts; plain greedy decoding
for outputs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence as Seq

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from ninfer.core.artifact.container import Artifact
from ninfer.core.artifact.convert import convert_checkpoint
from ninfer.plugins.qwen3_5.speculative.companion import COMPANION_CONFIGS, DFlashConfig
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.engine import EngineConfig
from ninfer.server.compose import load_engine
from ninfer.core.drafting import Draft, SpeculativeConfig
from ninfer.core.errors import ArtifactError, ConfigError, NotYetAvailableError, WeightMismatchError
from ninfer.core.runtime import ForwardBatch, KVCache, LoadOptions, StateCache
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from ninfer.plugins.qwen3_5.frontend.vocabulary import build_qwen_tokenizer_json
from ninfer.plugins.qwen3_5.model.model import ForwardBatchError
from ninfer.plugins.qwen3_5.model.runtime import load_runtime
from speculation_support import assert_idle, drafter_for, make_engine, open_tiny, run
from ninfer.plugins.qwen3_5.frontend.templates import template_source
from ninfer.plugins.qwen3_5.model.tiny import make_tiny, tiny_dflash_config, tiny_dflash_tensors
from test_qwen35_model import _config_dict, _hf_model, _state_dict, _write

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def dflash_path(tmp_path_factory, registries):
    options = TinyOptions(family="qwen3_5", seed=0, dflash=True)
    return write_tiny_artifact(tmp_path_factory.mktemp("dflash") / "tiny-dflash.ninfer", options, registries)


@pytest.fixture(scope="module")
def tiny(dflash_path, registries):
    yield from open_tiny(dflash_path, registries)


def dflash(tiny, registries, k: int, lm_head_draft: bool = False):
    return drafter_for(tiny, registries, "dflash", k, lm_head_draft)


rng = random.Random(0)
PROMPTS = [[rng.randrange(200, 150_000) for _ in range(n)] for n in (5, 17, 9, 30)]
MAX_TOKENS = [14, 9, 16, 11]


@pytest.fixture(scope="module")
def baselines(tiny):
    with make_engine(tiny) as engine:
        return run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)


def references(results) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): [*p, *o.output_token_ids] for p, o in zip(PROMPTS, results)}


class SteeredDFlash:
    """The real DFlash drafter (its drafts recorded) proposing a known continuation instead, corrupted at chosen
    output positions, so rounds accept several tokens and the drafter's context grows by whole accepted runs."""

    def __init__(self, inner, references: dict[tuple[int, ...], list[int]], corrupt=()) -> None:
        self.inner = inner
        self.references = references
        self.corrupt = set(corrupt)
        self.recorded: list[tuple[tuple[int, ...], int, tuple[int, ...]]] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, rows, counts) -> list[Draft]:
        real = self.inner.draft(rows, counts)
        drafts = []
        for seq, count, made in zip(rows, counts, real):
            assert seq.fed == len(seq.tokens) - 1
            self.recorded.append((tuple(seq.tokens), count, made.tokens))
            reference = self.references[tuple(seq.tokens[: seq.prompt_len])]
            tokens = []
            for position in range(len(seq.tokens), len(seq.tokens) + count):
                token = reference[position] if position < len(reference) else 0
                tokens.append((token + 1) % 1000 if position - seq.prompt_len in self.corrupt else token)
            drafts.append(Draft(tuple(tokens)))
        return drafts


# -- target-layer capture ------------------------------------------------------------------------------------------


def test_captured_layers_match_transformers_hidden_states(tmp_path):
    model = _hf_model("dense", seed=3)
    path = _write(tmp_path / "m.ninfer", type(model).__name__, _config_dict(model), _state_dict(model))
    tokens = torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(1))
    with Artifact.open(path) as artifact:
        runtime = load_runtime(artifact, LoadOptions())
        layers = (4, 1)
        output = runtime.forward(prefill_batch(tokens, layers, "last"), *fresh_caches(runtime, 1))
        with torch.no_grad():
            expected = model(tokens[None], output_hidden_states=True).hidden_states
        assert output.layer_hidden.shape == (11, 2 * 64)
        oracle = torch.cat([expected[5][0], expected[2][0]], -1)  # layer L's output is hidden_states[L + 1]
        torch.testing.assert_close(output.layer_hidden, oracle, atol=1e-4, rtol=1e-4)
        with pytest.raises(ForwardBatchError, match="capture_layers"):
            runtime.forward(prefill_batch(tokens, (6,), "last"), *fresh_caches(runtime, 1))


def fresh_caches(runtime, pages: int) -> tuple[KVCache, StateCache]:
    return KVCache.allocate(runtime.spec, pages, PAGE_SIZE), StateCache.allocate(runtime.spec, 1)


def prefill_batch(tokens: torch.Tensor, layers: tuple[int, ...], logits: str) -> ForwardBatch:
    count = tokens.shape[0]
    return ForwardBatch(
        token_ids=tokens,
        positions=torch.arange(count)[None].expand(3, -1),
        query_lens=[count],
        context_lens=[0],
        page_tables=torch.arange((count + PAGE_SIZE - 1) // PAGE_SIZE, dtype=torch.int32)[None],
        state_slots=torch.tensor([0]),
        logits=logits,
        capture_layers=layers,
    )


# -- the drafter against a from-scratch dense oracle --------------------------------------------------------------


def oracle_block_logits(tiny, tokens: Seq[int], count: int) -> torch.Tensor:
    """``[count, V]`` logits of the mask slots: target features of every committed token from a fresh prefill,
    then a dense non-causal DFlash forward built from transformers' Qwen3 pieces."""
    artifact, runtime, _ = tiny
    raw = artifact.manifest.config[COMPANION_CONFIGS]["dflash"]
    weights = {n[len("dflash."):]: artifact.tensor(n).float() for n in artifact.tensor_names if n.startswith("dflash.")}
    context_len = len(tokens) - 1
    pages = (context_len + PAGE_SIZE - 1) // PAGE_SIZE
    layer_ids = tuple(raw["dflash_config"]["target_layer_ids"])
    output = runtime.forward(
        prefill_batch(torch.tensor(tokens[:-1]), layer_ids, "none"), *fresh_caches(runtime, pages)
    )
    config = Qwen3Config(
        hidden_size=raw["hidden_size"], num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"], head_dim=raw["head_dim"],
        intermediate_size=raw["intermediate_size"], rms_norm_eps=raw["rms_norm_eps"], rope_theta=raw["rope_theta"],
    )
    eps, dim = raw["rms_norm_eps"], raw["head_dim"]
    heads, kv_heads = raw["num_attention_heads"], raw["num_key_value_heads"]

    def norm(x, name):
        module = Qwen3RMSNorm(x.shape[-1], eps)
        module.weight.data = weights[name]
        return module(x)

    context = norm(output.layer_hidden @ weights["fc.weight"].T, "hidden_norm.weight")
    block_tokens = [tokens[-1]] + [raw["dflash_config"]["mask_token_id"]] * count
    x = runtime.model.embed_tokens.float()[torch.tensor(block_tokens)]
    positions = torch.arange(context_len + count + 1)
    cos, sin = Qwen3RotaryEmbedding(config=config)(x[None], positions[None])
    for index, kind in enumerate(raw["layer_types"]):
        p = f"layers.{index}."
        h = norm(x, p + "input_layernorm.weight")
        q = norm((h @ weights[p + "self_attn.q_proj.weight"].T).view(-1, heads, dim), p + "self_attn.q_norm.weight")
        both = torch.cat([context, h])  # context K/V come first, then the block's own
        k = (both @ weights[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim)
        k = norm(k, p + "self_attn.k_norm.weight")
        v = (both @ weights[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
        q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # [1, heads, tokens, dim]
        q_rot, _ = apply_rotary_pos_emb(q, q, cos[:, context_len:], sin[:, context_len:])
        k_rot, _ = apply_rotary_pos_emb(k, k, cos, sin)
        k_rot = k_rot.repeat_interleave(heads // kv_heads, dim=1)
        v_all = v.transpose(0, 1)[None].repeat_interleave(heads // kv_heads, dim=1)
        scores = q_rot @ k_rot.transpose(-1, -2) * dim**-0.5
        if kind == "sliding_attention":
            distance = positions[context_len:, None] - positions[None, :]
            scores = scores.masked_fill(distance >= raw["sliding_window"], float("-inf"))
        attended = (scores.softmax(-1) @ v_all)[0].transpose(0, 1).reshape(len(block_tokens), heads * dim)
        x = x + attended @ weights[p + "self_attn.o_proj.weight"].T
        mlp = Qwen3MLP(config)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, name).weight.data = weights[p + f"mlp.{name}.weight"]
        x = x + mlp(norm(x, p + "post_attention_layernorm.weight"))
    return (norm(x, "norm.weight")[1:] @ runtime.model.lm_head.float().T).detach()


@pytest.mark.parametrize("corrupt", [(), (2, 5)], ids=["accepted", "rejected"])
def test_drafts_match_a_from_scratch_dflash_pass_and_outputs_stay_exact(tiny, registries, baselines, corrupt):
    steered = SteeredDFlash(dflash(tiny, registries, 7), references(baselines), corrupt)
    with make_engine(tiny, steered) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
        assert_idle(engine)
    assert [r.output_token_ids for r in results] == [b.output_token_ids for b in baselines]
    assert sum(r.speculative.accepted_tokens for r in results) > 0
    assert any(len(tokens) - 1 > 8 + count for tokens, count, _ in steered.recorded)  # the window drops context
    for tokens, count, drafted in steered.recorded[::3]:
        logits = oracle_block_logits(tiny, tokens, count)
        chosen = logits.gather(1, torch.tensor(drafted)[:, None])[:, 0]
        torch.testing.assert_close(chosen, logits.max(dim=-1).values, atol=1e-3, rtol=0)


def test_a_checkpoint_hit_carries_the_drafter_context_in_its_pages(tiny, registries):
    prompt, extra = PROMPTS[3], PROMPTS[0]

    def greedy(tokens):
        return GenerationRequest(tuple(tokens), SamplingParams(temperature=0.0, max_tokens=9))

    with make_engine(tiny, prefix_reuse=False) as engine:
        first = engine.submit(greedy(prompt)).result(60)
        follow_up = prompt + list(first.output_token_ids) + extra
        plain = engine.submit(greedy(follow_up)).result(60)
    continuations = {tuple(prompt): [*prompt, *first.output_token_ids],
                     tuple(follow_up): [*follow_up, *plain.output_token_ids]}
    steered = SteeredDFlash(dflash(tiny, registries, 4), continuations)
    with make_engine(tiny, steered) as engine:
        assert engine.submit(greedy(prompt)).result(60).output_token_ids == first.output_token_ids
        recorded_before = len(steered.recorded)
        spec_follow = engine.submit(greedy(follow_up)).result(60)
        assert_idle(engine)
    assert spec_follow.output_token_ids == plain.output_token_ids and spec_follow.cached_tokens > len(prompt)
    after_hit = steered.recorded[recorded_before:]
    assert after_hit
    for tokens, count, drafted in after_hit[:2]:  # drafts right after the hit read the restored context KV
        logits = oracle_block_logits(tiny, tokens, count)
        chosen = logits.gather(1, torch.tensor(drafted)[:, None])[:, 0]
        torch.testing.assert_close(chosen, logits.max(dim=-1).values, atol=1e-3, rtol=0)


# -- lossless greedy decoding ------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 7, 15])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_dflash_greedy_equals_plain_decoding(tiny, registries, baselines, k, concurrency):
    with make_engine(tiny, dflash(tiny, registries, k), max_concurrency=concurrency) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
        assert_idle(engine)
    for result, base in zip(results, baselines):
        assert result.output_token_ids == base.output_token_ids
        assert result.finish_reason == base.finish_reason == "length"
        counters = result.speculative
        assert counters.backend == "dflash" and counters.draft_window == k
        assert counters.rounds > 0 and counters.drafted_tokens >= counters.rounds
        assert result.completion_tokens == 1 + counters.accepted_tokens + counters.rounds + counters.fallback_steps


def test_lm_head_draft_is_lossless_and_drafts_within_the_reduced_vocabulary(tiny, registries, baselines):
    drafter = dflash(tiny, registries, 5, lm_head_draft=True)
    steered = SteeredDFlash(drafter, references(baselines))
    with make_engine(tiny, steered) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
    assert [r.output_token_ids for r in results] == [b.output_token_ids for b in baselines]
    assert steered.recorded and all(t < 32768 for _, _, drafted in steered.recorded for t in drafted)


def test_stops_inside_a_round_commit_the_exact_prefix(tiny, registries, baselines):
    base = baselines[3].output_token_ids
    for extra in (dict(stop_token_ids=[base[6]]), dict(max_tokens=7)):
        sampling = dict(temperature=0.0, max_tokens=extra.pop("max_tokens", 14), **extra)
        with make_engine(tiny) as engine:
            plain = engine.submit(GenerationRequest(tuple(PROMPTS[3]), SamplingParams(**sampling))).result(60)
        steered = SteeredDFlash(dflash(tiny, registries, 15), references(baselines))
        with make_engine(tiny, steered) as engine:
            spec = engine.submit(GenerationRequest(tuple(PROMPTS[3]), SamplingParams(**sampling))).result(60)
            assert_idle(engine)
        assert spec.output_token_ids == plain.output_token_ids
        assert (spec.finish_reason, spec.text) == (plain.finish_reason, plain.text)
        assert spec.speculative.rounds <= 2  # the whole answer fits in the first round's drafts


def test_seeded_sampling_matches_plain_decoding(tiny, registries):
    sampling = dict(temperature=0.8, top_k=20, seed=11)
    with make_engine(tiny) as engine:
        plain = run(engine, PROMPTS[:2], [10, 10], **sampling)
    with make_engine(tiny, dflash(tiny, registries, 7)) as engine:
        spec = run(engine, PROMPTS[:2], [10, 10], **sampling)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]


# -- startup -------------------------------------------------------------------------------------------------------


def test_spec_dflash_without_dflash_weights_fails_at_startup(tmp_path, registries):
    path = write_tiny_artifact(tmp_path / "plain.ninfer", TinyOptions(family="qwen3_5", seed=0, mtp=True), registries)
    with pytest.raises(ConfigError, match="dflash"):
        load_engine(path, EngineConfig(pending_timeout_ms=None), speculative=SpeculativeConfig("dflash", 7))


def test_draft_tokens_beyond_the_drafter_block_fail_at_startup(tiny, registries):
    with pytest.raises(ConfigError, match="out of range"):
        dflash(tiny, registries, 16)


# -- companions: make-tiny and convert ----------------------------------------------------------------------------


def test_make_tiny_dflash_round_trip(tiny, registries):
    artifact = tiny[0]
    manifest = artifact.manifest
    assert manifest.companions == ("dflash",)
    raw = manifest.config[COMPANION_CONFIGS]["dflash"]
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 16
    assert raw["layer_types"] == ["sliding_attention", "full_attention"] and raw["sliding_window"] == 8
    assert all(0 <= i < manifest.text_config["num_hidden_layers"] for i in raw["dflash_config"]["target_layer_ids"])
    names = [n for n in artifact.tensor_names if n.startswith("dflash.")]
    assert artifact.tensor_info("dflash.fc.weight").shape == (64, 64 * 3)
    assert len(names) == 3 + 11 * 2


def _hf_directory(directory: Path) -> Path:
    tiny = make_tiny(TinyOptions(family="qwen3_5", seed=4))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(tiny.config))
    save_file({n: t.contiguous() for n, t in tiny.tensors.items()}, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text(build_qwen_tokenizer_json(), encoding="utf-8")
    (directory / "chat_template.jinja").write_text(template_source("qwen3_6"), encoding="utf-8")
    return directory


def _drafter_directory(directory: Path, *, rename_fusion: bool = False, **overrides) -> tuple[Path, dict, dict]:
    config = {**tiny_dflash_config(make_tiny(TinyOptions()).config["text_config"]), **overrides}
    tensors = tiny_dflash_tensors(config, torch.Generator().manual_seed(9))
    stored = dict(tensors)
    if rename_fusion:
        stored["encoder.fc.weight"] = stored.pop("fc.weight")
        stored["encoder.output_norm_enc.weight"] = stored.pop("hidden_norm.weight")
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(stored, directory / "model.safetensors")
    return directory, config, tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _hf_directory(tmp_path_factory.mktemp("hf") / "target")


@pytest.mark.parametrize("rename_fusion", [False, True], ids=["z-lab", "encoder-names"])
def test_convert_carries_the_drafter_tensors_and_config(tmp_path, hf_dir, registries, rename_fusion):
    drafter_dir, config, tensors = _drafter_directory(tmp_path / "drafter", rename_fusion=rename_fusion)
    out = convert_checkpoint(hf_dir, tmp_path / "out.ninfer", drafters={"dflash": drafter_dir})
    with Artifact.open(out) as artifact:
        assert artifact.manifest.companions == ("dflash",)
        assert artifact.manifest.config[COMPANION_CONFIGS]["dflash"] == config
        carried = {n[len("dflash."):]: artifact.tensor(n) for n in artifact.tensor_names if n.startswith("dflash.")}
        assert carried.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert torch.equal(carried[name], tensor), name
    loaded = load_engine(out, EngineConfig(pending_timeout_ms=None), speculative=SpeculativeConfig("dflash", 3))
    loaded.close()


def test_convert_rejects_a_drafter_that_does_not_fit(tmp_path, hf_dir):
    wide, _, _ = _drafter_directory(tmp_path / "wide", hidden_size=96)
    with pytest.raises(WeightMismatchError, match="hidden_size"):
        convert_checkpoint(hf_dir, tmp_path / "a.ninfer", drafters={"dflash": wide})
    beyond = {"mask_token_id": 248070, "target_layer_ids": [1, 9]}
    deep, _, _ = _drafter_directory(tmp_path / "deep", dflash_config=beyond)
    with pytest.raises(WeightMismatchError, match="target_layer_ids"):
        convert_checkpoint(hf_dir, tmp_path / "b.ninfer", drafters={"dflash": deep})
    broken, _, _ = _drafter_directory(tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    config.update(num_hidden_layers=3, layer_types=["full_attention"] * 3)
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightMismatchError, match="missing layers.2"):
        convert_checkpoint(hf_dir, tmp_path / "c.ninfer", drafters={"dflash": broken})
    with pytest.raises(ArtifactError, match="carry it with --dflash$"):
        convert_checkpoint(hf_dir, tmp_path / "d.ninfer", drafters={"dflash2": broken})
    assert not any((tmp_path / f"{name}.ninfer").exists() for name in "abcd")


def test_drafter_config_defaults_and_refusals():
    base = tiny_dflash_config(make_tiny(TinyOptions()).config["text_config"])
    untapped = {**base, "num_hidden_layers": 5, "layer_types": ["full_attention"] * 5, "num_target_layers": 64,
                "dflash_config": {"mask_token_id": 248070}}
    assert DFlashConfig.from_dict(untapped, "cfg").target_layer_ids == (1, 16, 31, 46, 61)  # the z-lab default
    with pytest.raises(ArtifactError, match="it is a DFlash2DraftModel drafter: carry it with --dflash2"):
        DFlashConfig.from_dict({**base, "architectures": ["DFlash2DraftModel"]}, "cfg")
    with pytest.raises(ArtifactError, match="sliding_window"):
        DFlashConfig.from_dict({**base, "sliding_window": None}, "cfg")
    with pytest.raises(NotYetAvailableError, match="causal"):
        DFlashConfig.from_dict({**base, "is_causal": True}, "cfg")
