"""The DFlash2 speculative backend: the drafter against a dense from-scratch oracle (block forward, grouped dynamic
convolutions, candidate walk, T>0 proposals), lossless decoding, companion conversion, make-tiny --dflash2 and
startup errors.

Oracles: a dense DFlash2 pass written here from the published formulas, one row at a time (plain loops for the
convolutions and the walk, transformers' Qwen3 RoPE), over the target's layer features from a fresh prefill; plain
(non-speculative) decoding for greedy outputs; the target's own top-k distribution, computed here, for T>0 outputs.

Most tests run on a "steep" tiny artifact: the tiny DFlash2 model whose lm_head rows of four tokens are scaled up,
so target and drafter both favour those tokens and rounds really accept (and reject) drafts.
"""

from __future__ import annotations

import json
import random
import types
from pathlib import Path
from typing import Any, Sequence as Seq

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import save_file
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from ninfer.cli import cli
from ninfer.core.artifact.container import Artifact, Identity, Manifest, tensor_entries, write_artifact
from ninfer.core.artifact.convert import convert_checkpoint
from ninfer.plugins.qwen3_5.speculative.companion import COMPANION_CONFIGS, DFlash2Config, DFlashConfig
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.engine import EngineConfig
from ninfer.server.compose import load_engine
from ninfer.core.drafting import Draft, SpeculativeConfig
from ninfer.core.errors import ArtifactError, ConfigError, NotYetAvailableError, WeightMismatchError
from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.core.artifact.tiny import TinyOptions
from ninfer.plugins.qwen3_5.frontend.templates import artifact_resources as tiny_resources
from ninfer.plugins.qwen3_5.frontend.vocabulary import build_qwen_tokenizer_json
from ninfer.plugins.qwen3_5.speculative.dflash import BlockRow
from ninfer.plugins.qwen3_5.speculative.dflash2_drafter import gumbel_noise
from ninfer.plugins.qwen3_5.frontend.templates import template_source
from ninfer.plugins.qwen3_5.model.tiny import make_tiny, tiny_dflash2_config, tiny_dflash2_tensors, tiny_dflash_config
from speculation_support import assert_idle, drafter_for, make_engine, open_tiny, run

PAGE_SIZE = 16
FAVOURED = [1000, 1001, 1002, 1003]  # lm_head rows scaled up in the steep artifact
OUTPUT_MULTIPLIER = 1.5


def write_variant(directory: Path, head_scale: float, softcap: float) -> Path:
    """The tiny DFlash2 model with lm_head rows FAVOURED scaled by ``head_scale``, the drafter's output multiplier
    set to OUTPUT_MULTIPLIER and its logit softcap to ``softcap``."""
    tiny = make_tiny(TinyOptions(family="qwen3_5", seed=0, dflash2=True))
    tensors = dict(tiny.tensors)
    head = tensors["lm_head.weight"].float()
    head[FAVOURED] *= head_scale
    tensors["lm_head.weight"] = head.to(torch.bfloat16)
    config = json.loads(json.dumps(tiny.config))
    extra = config[COMPANION_CONFIGS]["dflash2"]["dflash_config"]
    extra.update(output_multiplier=OUTPUT_MULTIPLIER, final_logit_softcapping=softcap)
    manifest = Manifest(
        identity=Identity("tiny-dflash2-variant"), architecture=tiny.architecture, config=config,
        weight_format={"dtype": "bfloat16", "quantization": None, "random_weights": True}, companions=("dflash2",),
        generation_defaults=tiny.generation_defaults, family="qwen3_5",
    )
    return write_artifact(directory / "variant.ninfer", manifest, tensor_entries(tensors), tiny_resources("qwen3_6"))


@pytest.fixture(scope="module")
def flat(tmp_path_factory, registries):
    """Unary logits small next to the pairwise term and bent by a tight softcap: the walk often overrules them."""
    yield from open_tiny(write_variant(tmp_path_factory.mktemp("flat"), 1.0, 0.5), registries)


@pytest.fixture(scope="module")
def steep_path(tmp_path_factory):
    return write_variant(tmp_path_factory.mktemp("steep"), 40.0, 20.0)


@pytest.fixture(scope="module")
def tiny(steep_path, registries):
    """Target and drafter both favour the FAVOURED tokens, so rounds really accept (and reject) drafts."""
    yield from open_tiny(steep_path, registries)


def dflash2(tiny, registries, k: int, lm_head_draft: bool = False):
    return drafter_for(tiny, registries, "dflash2", k, lm_head_draft)


rng = random.Random(2)
PROMPTS = [[rng.randrange(200, 150_000) for _ in range(n)] for n in (5, 17, 9, 30)]
MAX_TOKENS = [14, 9, 16, 11]


@pytest.fixture(scope="module")
def baselines(tiny):
    with make_engine(tiny) as engine:
        return run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)


# -- the dense oracle ---------------------------------------------------------------------------------------------


def target_features(runtime, tokens: Seq[int], layer_ids: Seq[int]) -> torch.Tensor:
    """The target's outputs at ``layer_ids`` for every token of ``tokens`` (one fresh prefill), ``[n, K*H]``."""
    count = len(tokens)
    pages = (count + PAGE_SIZE - 1) // PAGE_SIZE
    batch = ForwardBatch(
        token_ids=torch.tensor(tokens),
        positions=torch.arange(count)[None].expand(3, -1),
        query_lens=[count],
        context_lens=[0],
        page_tables=torch.arange(pages, dtype=torch.int32)[None],
        state_slots=torch.tensor([0]),
        logits="none",
        capture_layers=tuple(layer_ids),
    )
    caches = KVCache.allocate(runtime.spec, pages, PAGE_SIZE), StateCache.allocate(runtime.spec, 1)
    return runtime.forward(batch, *caches).layer_hidden


class DenseDFlash2:
    """DFlash2 written straight from its formulas over one row, from the artifact's stored weights and config."""

    def __init__(self, artifact, runtime) -> None:
        self.runtime = runtime
        self.raw = artifact.manifest.config[COMPANION_CONFIGS]["dflash2"]
        self.extra = self.raw["dflash_config"]
        self.w = {n[len("dflash2."):]: artifact.tensor(n).float() for n in artifact.tensor_names
                  if n.startswith("dflash2.")}
        self.head = runtime.model.lm_head.float()

    def rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.raw["rms_norm_eps"]) * weight

    def conv(self, x: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """out[i, c] = sum_t (base[t, c] + dynamic[i, t, c // group]) * x[i - t, c], x before the block is 0."""
        group = self.extra["conv_group_size"]
        out = torch.zeros_like(x)
        for i in range(x.shape[0]):
            for t in range(base.shape[0]):
                if i - t >= 0:
                    out[i] += (base[t] + dynamic[i, t].repeat_interleave(group)) * x[i - t]
        return out

    def prepare(self, prefix: str, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        taps = self.extra["conv_kernel_size"]
        dynamic = (normed @ self.w[prefix + "kernel_projection.weight"].T).view(normed.shape[0], 2, taps, -1)
        return self.conv(normed, self.w[prefix + "base_kernel"][0], dynamic[:, 0]), dynamic[:, 1]

    def block_hidden(self, tokens: Seq[int], count: int) -> torch.Tensor:
        """Final-normed hidden states ``[count + 1, H]`` of the block ``[tokens[-1], MASK x count]``."""
        raw, w = self.raw, self.w
        context_len = len(tokens) - 1
        features = target_features(self.runtime, tokens[:-1], self.extra["target_layer_ids"])
        context = self.rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
        block = [tokens[-1]] + [self.extra["mask_token_id"]] * count
        x = self.runtime.model.embed_tokens.float()[torch.tensor(block)]
        heads, kv_heads, dim = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
        rope = Qwen3RotaryEmbedding(config=Qwen3Config(
            hidden_size=raw["hidden_size"], num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=dim,
            rope_theta=raw["rope_theta"],
        ))
        positions = torch.arange(context_len + count + 1)
        cos, sin = rope(x[None], positions[None])
        for index, kind in enumerate(raw["layer_types"]):
            p = f"layers.{index}."
            attention_in, after = self.prepare(p + "attention_conv.", self.rms(x, w[p + "input_layernorm.weight"]))
            q = self.rms((attention_in @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, dim),
                         w[p + "self_attn.q_norm.weight"])
            both = torch.cat([context, attention_in])  # context K/V (no convolution), then the block's own
            k = self.rms((both @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dim),
                         w[p + "self_attn.k_norm.weight"])
            v = (both @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
            q, k = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
            q, _ = apply_rotary_pos_emb(q, q, cos[:, context_len:], sin[:, context_len:])
            k, _ = apply_rotary_pos_emb(k, k, cos, sin)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.transpose(0, 1)[None].repeat_interleave(heads // kv_heads, dim=1)
            scores = q @ k.transpose(-1, -2) * dim**-0.5  # no causal mask inside the block
            if kind == "sliding_attention":
                distance = positions[context_len:, None] - positions[None, :]
                scores = scores.masked_fill(distance >= raw["sliding_window"], float("-inf"))
            attended = (scores.softmax(-1) @ v)[0].transpose(0, 1).reshape(len(block), heads * dim)
            attended = attended @ w[p + "self_attn.o_proj.weight"].T
            x = x + self.conv(attended, w[p + "attention_conv.base_kernel"][1], after)
            mlp_in, after = self.prepare(p + "mlp_conv.", self.rms(x, w[p + "post_attention_layernorm.weight"]))
            mlp = (F.silu(mlp_in @ w[p + "mlp.gate_proj.weight"].T) * (mlp_in @ w[p + "mlp.up_proj.weight"].T))
            x = x + self.conv(mlp @ w[p + "mlp.down_proj.weight"].T, w[p + "mlp_conv.base_kernel"][1], after)
        return self.rms(x, w["norm.weight"])

    def walk(self, slots: torch.Tensor, anchor: int, chosen: Seq[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per mask slot, its candidates and their scores, walking from ``anchor`` through the ``chosen`` tokens."""
        logits = (slots @ self.head.T) * self.extra.get("output_multiplier", 1.0)
        cap = self.extra.get("final_logit_softcapping")
        if cap:
            logits = cap * torch.tanh(logits / cap)
        unary, candidates = logits.topk(self.extra["selector_top_k"], dim=-1)
        predecessor, successor = self.w["candidate_selector.predecessor_codebook"], self.w[
            "candidate_selector.successor_codebook"]
        steps, previous = [], anchor
        for j in range(slots.shape[0]):
            projected = self.w["candidate_selector.hidden_projection.weight"] @ slots[j]
            score = torch.stack([
                unary[j, k] + (predecessor[previous] * projected * successor[candidates[j, k]]).sum()
                for k in range(candidates.shape[1])
            ])
            steps.append((candidates[j], score))
            previous = chosen[j]
        return steps


def stand_in(tokens: Seq[int], pages: Seq[int], temperature: float = 0.0, seed: int = 0):
    """What the drafter reads of an engine Sequence: tokens (the last unfed), fed, pages and the sampler."""
    sampler = types.SimpleNamespace(greedy=temperature == 0.0, params=types.SimpleNamespace(temperature=temperature),
                                    seed=seed)
    return types.SimpleNamespace(tokens=list(tokens), fed=len(tokens) - 1, pages=list(pages), sampler=sampler)


def bound_drafter(tiny, registries, rows_of_tokens: Seq[Seq[int]], temperature: float = 0.0, k: int = 7):
    """A DFlash2 drafter bound to a small pool whose context KV holds each row's committed tokens."""
    artifact, runtime, _ = tiny
    drafter = dflash2(tiny, registries, k)
    drafter.bind(num_pages=8, page_size=PAGE_SIZE)
    rows, next_page = [], 0
    for index, tokens in enumerate(rows_of_tokens):
        count = (len(tokens) + k + PAGE_SIZE) // PAGE_SIZE
        row = stand_in(tokens, range(next_page, next_page + count), temperature, seed=index)
        next_page += count
        drafter.observe(row, 0, target_features(runtime, tokens[:-1], drafter.capture_layers))
        assert drafter.ready(row)
        rows.append(row)
    return drafter, rows


ROW_TOKENS = [PROMPTS[1][:14], PROMPTS[3]]  # contexts of 13 and 29 tokens: both beyond the sliding window of 8


def test_block_forward_and_greedy_walk_match_the_dense_oracle(flat, registries):
    drafter, rows = bound_drafter(flat, registries, ROW_TOKENS)
    counts = [7, 3]
    oracle = DenseDFlash2(flat[0], flat[1])
    mask = drafter.model.config.mask_token_id
    blocks = [BlockRow((row.tokens[-1], *[mask] * count), row.fed, row.pages) for row, count in zip(rows, counts)]
    hidden = drafter.model.draft_hidden(blocks, drafter._kv)  # both rows in one batch
    drafts = drafter.draft(rows, counts)
    overruled, offset = 0, 0
    for row, count, draft in zip(rows, counts, drafts):
        expected = oracle.block_hidden(row.tokens, count)
        torch.testing.assert_close(hidden[offset : offset + count + 1], expected, atol=2e-4, rtol=1e-4)
        offset += count + 1
        assert draft.proposals is None and len(draft.tokens) == count
        for (candidates, score), token in zip(oracle.walk(expected[1:], row.tokens[-1], draft.tokens), draft.tokens):
            assert token in candidates.tolist()
            assert float(score[candidates.tolist().index(token)]) >= float(score.max()) - 1e-4
            overruled += token != int(candidates[0])
    assert overruled > 0  # the pairwise term does overrule the unary logits' favourite


def test_sampled_proposals_are_the_oracle_walk_distributions(flat, registries):
    temperature = 0.7
    drafter, rows = bound_drafter(flat, registries, ROW_TOKENS, temperature)
    oracle = DenseDFlash2(flat[0], flat[1])
    counts = [5, 4]
    drafts = drafter.draft(rows, counts)
    vocab = flat[1].spec.vocab_size
    for row, count, draft in zip(rows, counts, drafts):
        assert draft.proposals is not None and len(draft.proposals) == len(draft.tokens) == count
        steps = oracle.walk(oracle.block_hidden(row.tokens, count)[1:], row.tokens[-1], draft.tokens)
        for token, proposal, (candidates, score) in zip(draft.tokens, draft.proposals, steps):
            assert proposal.probs.dtype == torch.float64 and len(set(proposal.ids.tolist())) == len(proposal.ids)
            assert abs(float(proposal.probs.sum()) - 1.0) < 1e-9 and float(proposal.probs.min()) >= 0.0
            assert set(proposal.ids.tolist()) <= set(candidates.tolist()) and 0 <= min(proposal.ids.tolist())
            assert max(proposal.ids.tolist()) < vocab
            assert float(proposal.at(torch.tensor([token]))[0]) > 0
            torch.testing.assert_close(proposal.at(candidates), torch.softmax(score.double() / temperature, 0),
                                       atol=1e-5, rtol=1e-4)
    again, rows = bound_drafter(flat, registries, ROW_TOKENS, temperature)
    assert [d.tokens for d in again.draft(rows, counts)] == [d.tokens for d in drafts]  # seeded: reproducible


def test_sampled_walks_follow_their_proposals(flat, registries):
    """Thousands of independently seeded walks over one row's slots: the drafts' joint frequencies match
    q0(d0) * q1(d1 | d0) as the proposals state them."""
    drafter, rows = bound_drafter(flat, registries, ROW_TOKENS[:1], 1.0)
    slots = drafter.mask_hidden(rows, [2])
    selector, head = drafter.model.selector, drafter._head
    head = head[:2048]  # a sub-vocabulary head keeps the [slots, V] logits of thousands of walks small
    samples, width = 4000, selector.width(head)
    noise = torch.cat([gumbel_noise(torch.Generator().manual_seed(seed), 2, width) for seed in range(samples)])
    walk = selector.walk(slots.repeat(samples, 1), head, [rows[0].tokens[-1]] * samples, [2] * samples,
                         [1.0] * samples, noise)
    tokens = walk.tokens.view(samples, 2)
    probabilities = walk.probabilities.view(samples, 2, -1)
    candidates = walk.candidates.view(samples, 2, -1)
    q0 = dict(zip(candidates[0, 0].tolist(), probabilities[0, 0].tolist()))
    first = torch.bincount(tokens[:, 0], minlength=max(q0) + 1).double() / samples
    assert 0.5 * sum(abs(float(first[t]) - q) for t, q in q0.items()) < 0.05
    common = int(tokens[:, 0].mode().values)
    given = tokens[:, 0] == common
    q1 = dict(zip(candidates[0, 1].tolist(), probabilities[given.nonzero()[0, 0], 1].tolist()))
    second = torch.bincount(tokens[given, 1], minlength=max(q1) + 1).double() / int(given.sum())
    assert 0.5 * sum(abs(float(second[t]) - q) for t, q in q1.items()) < 0.08
    assert len({round(q, 6) for q in q1.values()}) > 1


# -- lossless decoding ---------------------------------------------------------------------------------------------


class SteeredDrafter:
    """The real drafter (run and recorded) proposing a known continuation instead, so whole rounds accept."""

    def __init__(self, inner, references: dict[tuple[int, ...], list[int]]) -> None:
        self.inner = inner
        self.references = references
        self.recorded: list[Draft] = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, rows, counts) -> list[Draft]:
        self.recorded.extend(self.inner.draft(rows, counts))
        drafts = []
        for seq, count in zip(rows, counts):
            reference = self.references[tuple(seq.tokens[: seq.prompt_len])]
            drafts.append(Draft(tuple(reference[p] if p < len(reference) else 0
                                      for p in range(len(seq.tokens), len(seq.tokens) + count))))
        return drafts


@pytest.mark.parametrize(("k", "concurrency"), [(7, 1), (7, 4), (1, 4)])
def test_dflash2_greedy_equals_plain_decoding(tiny, registries, baselines, k, concurrency):
    with make_engine(tiny, dflash2(tiny, registries, k), max_concurrency=concurrency) as engine:
        results = run(engine, PROMPTS, MAX_TOKENS, temperature=0.0)
        assert_idle(engine)
    for result, base in zip(results, baselines):
        assert result.output_token_ids == base.output_token_ids
        assert result.finish_reason == base.finish_reason == "length"
        counters = result.speculative
        assert counters.backend == "dflash2" and counters.draft_window == k and counters.rounds > 0
        assert result.completion_tokens == 1 + counters.accepted_tokens + counters.rounds + counters.fallback_steps
    assert 0 < sum(r.speculative.accepted_tokens for r in results) < sum(r.speculative.drafted_tokens for r in results)


def test_a_stop_string_inside_a_round_commits_the_exact_prefix(tiny, registries, baselines):
    _, _, tokenizer = tiny
    prompt, base = PROMPTS[2], baselines[2].output_token_ids
    stop = tokenizer.decode(list(base[5:7])).strip()
    assert stop
    sampling = SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,))
    with make_engine(tiny) as engine:
        plain = engine.submit(GenerationRequest(tuple(prompt), sampling)).result(60)
    steered = SteeredDrafter(dflash2(tiny, registries, 7), {tuple(prompt): [*prompt, *base]})
    with make_engine(tiny, steered) as engine:
        spec = engine.submit(GenerationRequest(tuple(prompt), sampling)).result(60)
        assert_idle(engine)
    assert plain.finish_reason == "stop" and len(plain.output_token_ids) < len(base)
    assert spec.output_token_ids == plain.output_token_ids
    assert (spec.finish_reason, spec.stop, spec.text) == (plain.finish_reason, plain.stop, plain.text)
    assert spec.speculative.rounds <= 2 and steered.recorded


def test_sampled_decoding_is_seeded_batch_independent_and_within_the_target_support(tiny, registries):
    """At T>0 every committed token lies in the target's top-k at its position, and a seeded request's output
    does not depend on what it is batched with (the proposal noise is per sequence)."""
    _, runtime, _ = tiny
    top_k = 3
    sampling = dict(temperature=0.9, top_k=top_k, seed=17)
    outputs = []
    for concurrency in (1, 4):
        with make_engine(tiny, dflash2(tiny, registries, 3), max_concurrency=concurrency) as engine:
            results = run(engine, PROMPTS, MAX_TOKENS, **sampling)
            assert_idle(engine)
        outputs.append([r.output_token_ids for r in results])
        assert sum(r.speculative.drafted_tokens for r in results) > 0
    assert outputs[0] == outputs[1]
    for prompt, output in zip(PROMPTS, outputs[0]):
        tokens = [*prompt, *output]
        pages = (len(tokens) + PAGE_SIZE - 1) // PAGE_SIZE
        batch = ForwardBatch(
            token_ids=torch.tensor(tokens), positions=torch.arange(len(tokens))[None].expand(3, -1),
            query_lens=[len(tokens)], context_lens=[0], page_tables=torch.arange(pages, dtype=torch.int32)[None],
            state_slots=torch.tensor([0]), logits="all",
        )
        logits = runtime.forward(batch, KVCache.allocate(runtime.spec, pages, PAGE_SIZE),
                                 StateCache.allocate(runtime.spec, 1)).logits
        for position, token in enumerate(output):
            assert token in logits[len(prompt) - 1 + position].topk(top_k).indices.tolist()


# -- startup -------------------------------------------------------------------------------------------------------


def test_startup_failures_name_the_fix(hf_dir, tiny, registries):
    engine_config = EngineConfig(pending_timeout_ms=None)
    with pytest.raises(ConfigError, match=r"carries none; convert with `ninfer convert HF_DIR --dflash2 DRAFTER_DIR`"):
        load_engine(hf_dir, engine_config, speculative=SpeculativeConfig("dflash2", 7))
    with pytest.raises(ConfigError, match="--draft-tokens 8 exceeds .* block of 8 .* at most 7"):
        dflash2(tiny, registries, 8)
    with pytest.raises(ConfigError, match="--lm-head-draft cannot be combined with --spec dflash2.*full LM head"):
        load_engine(tiny[0], engine_config, speculative=SpeculativeConfig("dflash2", 7, lm_head_draft=True))


# -- companions: make-tiny and convert ------------------------------------------------------------------------------


def test_make_tiny_dflash2_writes_a_loadable_companion(tmp_path, registries):
    out = tmp_path / "t.ninfer"
    result = CliRunner().invoke(cli, ["make-tiny", str(out), "--dflash2"])
    assert result.exit_code == 0, result.output
    with Artifact.open(out) as artifact:
        manifest = artifact.manifest
        assert manifest.companions == ("dflash2",) and manifest.identity.model_id.endswith("-dflash2")
        raw = manifest.config[COMPANION_CONFIGS]["dflash2"]
        assert raw["architectures"] == ["DFlash2DraftModel"] and raw["dflash_config"]["block_size"] == 8
        config = DFlash2Config.from_dict(raw, "stored")
        stored = {n[len("dflash2."):]: tuple(artifact.tensor_info(n).shape) for n in artifact.tensor_names
                  if n.startswith("dflash2.")}
        assert stored == config.tensor_shapes()
        assert stored["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * 64 // 16, 64)
        assert stored["candidate_selector.successor_codebook"] == (manifest.text_config["vocab_size"], 16)
    loaded = load_engine(out, EngineConfig(pending_timeout_ms=None), speculative=SpeculativeConfig("dflash2", 7))
    loaded.close()


def _hf_directory(directory: Path) -> Path:
    tiny = make_tiny(TinyOptions(family="qwen3_5", seed=4))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(tiny.config))
    save_file({n: t.contiguous() for n, t in tiny.tensors.items()}, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text(build_qwen_tokenizer_json(), encoding="utf-8")
    (directory / "chat_template.jinja").write_text(template_source("qwen3_6"), encoding="utf-8")
    return directory


def _drafter_directory(directory: Path, config: dict[str, Any], *, drop: str | None = None) -> dict:
    """A z-lab-format drafter directory (config.json + model.safetensors) in the checkpoint's own names."""
    if config["architectures"] == ["DFlash2DraftModel"]:
        tensors = tiny_dflash2_tensors(config, torch.Generator().manual_seed(9))
    else:
        from ninfer.plugins.qwen3_5.model.tiny import tiny_dflash_tensors

        tensors = tiny_dflash_tensors(config, torch.Generator().manual_seed(9))
    stored = {n: t for n, t in tensors.items() if n != drop}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    save_file(stored, directory / "model.safetensors")
    return tensors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return _hf_directory(tmp_path_factory.mktemp("hf") / "target")


def text_config() -> dict:
    return make_tiny(TinyOptions()).config["text_config"]


def test_convert_carries_a_dflash2_drafter_directory(tmp_path, hf_dir):
    config = tiny_dflash2_config(text_config())
    tensors = _drafter_directory(tmp_path / "drafter", config)
    out = tmp_path / "out.ninfer"
    result = CliRunner().invoke(cli, ["convert", str(hf_dir), "-o", str(out), "--dflash2", str(tmp_path / "drafter")])
    assert result.exit_code == 0, result.output
    with Artifact.open(out) as artifact:
        assert artifact.manifest.companions == ("dflash2",)
        assert artifact.manifest.config[COMPANION_CONFIGS]["dflash2"] == config
        carried = {n[len("dflash2."):]: artifact.tensor(n) for n in artifact.tensor_names if n.startswith("dflash2.")}
        assert carried.keys() == tensors.keys()
        assert all(torch.equal(carried[name], tensor) for name, tensor in tensors.items())
    loaded = load_engine(out, EngineConfig(pending_timeout_ms=None), speculative=SpeculativeConfig("dflash2", 3))
    loaded.close()


def test_convert_rejects_mismatched_drafter_directories(tmp_path, hf_dir):
    dflash2_config = tiny_dflash2_config(text_config())
    _drafter_directory(tmp_path / "v2", dflash2_config)
    with pytest.raises(ArtifactError, match="DFlash2DraftModel drafter: carry it with --dflash2"):
        convert_checkpoint(hf_dir, tmp_path / "a.ninfer", drafters={"dflash": tmp_path / "v2"})
    _drafter_directory(tmp_path / "v1", tiny_dflash_config(text_config()))
    with pytest.raises(ArtifactError, match="DFlashDraftModel drafter: carry it with --dflash$"):
        convert_checkpoint(hf_dir, tmp_path / "b.ninfer", drafters={"dflash2": tmp_path / "v1"})
    _drafter_directory(tmp_path / "conv", dflash2_config, drop="layers.1.mlp_conv.base_kernel")
    with pytest.raises(WeightMismatchError, match="missing layers.1.mlp_conv.base_kernel"):
        convert_checkpoint(hf_dir, tmp_path / "c.ninfer", drafters={"dflash2": tmp_path / "conv"})
    _drafter_directory(tmp_path / "vocab", {**dflash2_config, "vocab_size": 151936})
    with pytest.raises(WeightMismatchError, match="vocab_size 151936 differs"):
        convert_checkpoint(hf_dir, tmp_path / "d.ninfer", drafters={"dflash2": tmp_path / "vocab"})
    assert not any((tmp_path / f"{name}.ninfer").exists() for name in "abcd")


def test_dflash2_config_reading_and_refusals():
    base = tiny_dflash2_config(text_config())
    extra = base["dflash_config"]
    config = DFlash2Config.from_dict(base, "cfg")
    assert (config.dflash.block_size, config.conv_groups, config.selector_top_k) == (8, 4, 16)
    assert (config.output_multiplier, config.final_logit_softcapping) == (1.0, 20.0)
    bare = {key: value for key, value in extra.items() if key not in ("output_multiplier", "final_logit_softcapping")}
    defaults = DFlash2Config.from_dict({**base, "dflash_config": bare}, "cfg")
    assert (defaults.output_multiplier, defaults.final_logit_softcapping) == (1.0, None)
    top_level = {**base, "block_size": 16, "dflash_config": {k: v for k, v in extra.items() if k != "block_size"}}
    assert DFlash2Config.from_dict(top_level, "cfg").dflash.block_size == 16
    both = {**base, "block_size": 16}
    assert DFlash2Config.from_dict(both, "cfg").dflash.block_size == 8  # dflash_config wins
    with pytest.raises(ArtifactError, match="carry it with --dflash2"):
        DFlashConfig.from_dict(base, "cfg")
    refusals = [
        ({"conv_group_size": 24}, ArtifactError, "not a multiple of conv_group_size 24"),
        ({"conv_kernel_size": 9}, ArtifactError, "conv_kernel_size 9 exceeds block_size 8"),
        ({"selector_top_k": None}, ArtifactError, "'selector_top_k' must be an integer"),
        ({"final_logit_softcapping": 0}, ArtifactError, "must be positive"),
        ({"sample_from_anchor": True}, NotYetAvailableError, "sample_from_anchor=True are not yet available"),
        ({"attention_mode": "mla"}, NotYetAvailableError, "attention_mode='mla'"),
    ]
    for change, error, message in refusals:
        with pytest.raises(error, match=message):
            DFlash2Config.from_dict({**base, "dflash_config": {**extra, **change}}, "cfg")
    with pytest.raises(NotYetAvailableError, match="causal"):
        DFlash2Config.from_dict({**base, "is_causal": True}, "cfg")
