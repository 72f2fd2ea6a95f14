"""The CUDA verify path (Triton kernels, CUDA graphs per (rows, q)) against the generic eager path on the same weights.

The kernels are checked against their pure-torch twins, the whole verify forward (logits, hidden states, the state
after every token, the caches it leaves) against the reference runtime, and a runtime with the decode runner sends
its verify batches to the verify runner. Runs on CUDA (graphs on and off); without a GPU it runs the eager kernels
in Triton's CPU interpreter when ``TRITON_INTERPRET=1``, otherwise it is skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_support import CUDA, DEVICE, DTYPE, needs_cuda_graphs, rel_err, seed_each_test, skip_module_without_triton

from ninfer.kernels.reference.attention import paged_attention
from ninfer.kernels.reference.conv import causal_conv1d
from ninfer.kernels.reference.gated_delta import recurrent_gated_delta_rule
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_text_weights

pytestmark = pytest.mark.gpu

skip_module_without_triton()

from ninfer.kernels.triton.attention import paged_attention_verify  # noqa: E402
from ninfer.kernels.triton.conv import causal_conv1d_verify  # noqa: E402
from ninfer.kernels.triton.gated_delta import fused_recurrent_gated_delta  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # noqa: E402
from ninfer.plugins.qwen3_5.cuda.verify_graph import VerifyGraphRunner  # noqa: E402
from test_decode_graph import Caches, _runtimes  # noqa: E402

KERNEL_TOL = 1e-2 if CUDA else 1e-5
# whole verify forward against the generic path: fp32 matches to rounding; bf16 to its own noise (as the decode path)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PAGE_SIZE = 16


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE).to(DTYPE)


_seed = seed_each_test(1234)


# -- kernels --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens_per_row", "channels"),
    [(2, 300), (4, 300), (5, 300), (4, 10240)],  # 300: more than one block, fewer than two; 10240: qwen3.6-27b's
)
def test_conv_verify_keeps_every_window(tokens_per_row, channels):
    rows, kernel = 3, 4
    tokens = rows * tokens_per_row
    x = randn(tokens, channels + 20)[:, :channels]  # a slice of a wider projection, like the fused one
    weight = randn(channels, kernel)
    cache = randn(5, channels, kernel - 1)
    before = cache.clone()
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    states = torch.full((tokens + 2, channels, kernel - 1), 7.0, dtype=DTYPE, device=DEVICE)
    out = causal_conv1d_verify(x, weight, cache, slots, tokens_per_row=tokens_per_row, states_out=states)
    ref, ref_final, ref_states = causal_conv1d(
        x.reshape(rows, tokens_per_row, channels), weight, before[slots], output_states=True
    )
    assert rel_err(out, ref.reshape(tokens, channels)) < KERNEL_TOL
    assert torch.equal(cache[slots], ref_final.to(cache.dtype))
    assert torch.equal(states[:tokens], ref_states.reshape(tokens, channels, kernel - 1).to(DTYPE))
    assert (states[tokens:] == 7.0).all()  # nothing written past the batch
    assert torch.equal(cache[[1, 3]], before[[1, 3]])


@pytest.mark.parametrize(
    ("tokens_per_row", "contexts", "split", "heads", "pages_per_row"),
    [
        (4, [0, 5, 37], 32, (6, 2), 6),
        (3, [16, 1, 70], None, (6, 2), 6),
        # qwen3.6-27b: 24 query / 4 KV heads of 256 (the 16-keys-per-step, 8-warp variant), several pages per row,
        # a page table as wide as the runners' smallest bucket (64 pages: 16 splits of 64 tokens)
        (4, [256, 77, 1000], None, (24, 4), 64),
        (16, [200, 0, 31], 128, (24, 4), 20),
    ],
)
def test_paged_attention_verify_is_causal_over_the_cached_prefix(tokens_per_row, contexts, split, heads, pages_per_row):
    rows, (query_heads, kv_heads), dim = 3, heads, 256
    tokens = rows * tokens_per_row
    key_cache = randn(rows * pages_per_row + 2, PAGE_SIZE, kv_heads, dim)
    value_cache = randn(*key_cache.shape)
    order = torch.randperm(rows * pages_per_row + 2, device=DEVICE)[: rows * pages_per_row]
    page_tables = order.view(rows, pages_per_row).to(torch.int32)
    q = randn(tokens, query_heads, dim)
    gate = randn(tokens, query_heads, 2 * dim)[:, :, dim:]
    out = paged_attention_verify(
        q, key_cache, value_cache, page_tables, torch.tensor(contexts, device=DEVICE), tokens_per_row=tokens_per_row,
        scale=dim**-0.5, gate=gate, split_tokens=split,
    )
    ref = paged_attention(
        q.float(), key_cache.float(), value_cache.float(), page_tables, [tokens_per_row] * rows, contexts,
        scale=dim**-0.5,
    )
    ref = ref * torch.sigmoid(gate.float())
    assert rel_err(out.view(tokens, query_heads, dim), ref) < KERNEL_TOL


@pytest.mark.parametrize("heads", [(2, 4, 16), (16, 48, 128)])  # (key heads, value heads, head dim); qwen3.6-27b
def test_gated_delta_writes_states_into_a_given_buffer(heads):
    key_heads, value_heads, dk = heads
    dv = dk
    rows, tokens_per_row = 2, 3
    tokens = rows * tokens_per_row
    qkv = randn(tokens, 2 * key_heads * dk + value_heads * dv)
    gates = randn(tokens, 2 * value_heads)
    a, b = gates[:, :value_heads], gates[:, value_heads:]
    decay_rate = -torch.empty(value_heads, device=DEVICE).uniform_(1, 16)
    dt_bias = torch.randn(value_heads, device=DEVICE)
    cache = torch.randn(3, value_heads, dk, dv, device=DEVICE) * 0.1
    before = cache.clone()
    slots = torch.tensor([2, 0], device=DEVICE)
    buffer = torch.full((tokens + 1, value_heads, dk, dv), 5.0, device=DEVICE)
    out, states = fused_recurrent_gated_delta(
        qkv, a, b, decay_rate, dt_bias, cache, slots, key_heads=key_heads, tokens_per_row=tokens_per_row,
        states_out=buffer,
    )
    assert states is not None and states.data_ptr() == buffer.data_ptr() and states.shape[0] == tokens
    q, k, v = torch.split(qkv.reshape(rows, tokens_per_row, -1), [key_heads * dk, key_heads * dk, value_heads * dv], -1)
    g = (decay_rate * F.softplus(a.float() + dt_bias)).reshape(rows, tokens_per_row, value_heads)
    ref_out, ref_final, ref_states = recurrent_gated_delta_rule(
        q.reshape(rows, tokens_per_row, key_heads, dk), k.reshape(rows, tokens_per_row, key_heads, dk),
        v.reshape(rows, tokens_per_row, value_heads, dv), g,
        torch.sigmoid(b.float()).reshape(rows, tokens_per_row, value_heads), before[slots], output_states=True,
    )
    assert rel_err(out, ref_out.reshape(tokens, value_heads, dv)) < KERNEL_TOL
    assert rel_err(buffer[:tokens], ref_states.reshape(tokens, value_heads, dk, dv)) < 1e-4
    assert rel_err(cache[slots], ref_final) < 1e-4
    assert (buffer[tokens:] == 5.0).all()


# -- the whole verify forward ---------------------------------------------------------------------------------------


def _assert_same_output(got, expected, tol):
    assert rel_err(got.logits, expected.logits) < tol
    assert rel_err(got.hidden, expected.hidden) < tol
    for got_conv, expected_conv in zip(got.states.conv, expected.states.conv):
        assert got_conv.shape == expected_conv.shape and rel_err(got_conv, expected_conv) < tol
    for got_ssm, expected_ssm in zip(got.states.ssm, expected.states.ssm):
        assert got_ssm.shape == expected_ssm.shape and rel_err(got_ssm, expected_ssm) < tol


def _assert_same_caches(got: Caches, expected: Caches, tol):
    for got_ssm, expected_ssm in zip(got.state.ssm, expected.state.ssm):
        assert rel_err(got_ssm, expected_ssm) < tol
    for got_conv, expected_conv in zip(got.state.conv, expected.state.conv):
        assert rel_err(got_conv, expected_conv) < tol
    for got_key, expected_key in zip(got.kv.key, expected.kv.key):
        assert rel_err(got_key, expected_key) < tol


@pytest.mark.parametrize(
    ("preset", "dtype"),
    [
        pytest.param("tiny", torch.float32, id="tiny-fp32"),
        pytest.param("tiny-moe", torch.float32, id="tiny-moe-fp32"),
        # bf16 for the dense model only: in bf16 a near tie of two router logits may pick another expert on one
        # path than on the other (a discontinuous, legitimate difference); fp32 checks the MoE verify exactly
        pytest.param(
            "tiny", torch.bfloat16, id="tiny-bf16",
            marks=pytest.mark.skipif(not CUDA, reason="the interpreter's bf16 tl.dot is not faithful"),
        ),
    ],
)
def test_verify_runner_matches_the_generic_path(preset, dtype):
    tol = TOL[dtype]
    reference, model, fused = _runtimes(preset, dtype)
    vocab = model.config.vocab_size
    rows = [0, 1, 2]
    caches = Caches(reference, len(rows))
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 17, 30)]
    with torch.no_grad():
        reference.forward(caches.batch(rows, prompts, verify=False), caches.kv, caches.state)
    ours = caches.clone()
    eager = VerifyGraphRunner(model, fused, use_graphs=False)
    graphs = VerifyGraphRunner(model, fused, use_graphs=True) if CUDA else None
    graph_caches = caches.clone() if CUDA else None
    # (rows, q) per round: the batch shrinks, q changes, and a shape repeats (a graph replay on CUDA)
    for step, (active, q) in enumerate([(rows, 4), (rows, 4), (rows[:2], 2), (rows, 4), (rows[:1], 3)]):
        tokens = [torch.randint(0, vocab, (q,)).tolist() for _ in active]
        batch = caches.batch(active, tokens, verify=True)
        assert eager.supports(batch), step
        with torch.no_grad():
            expected = reference.forward(batch, caches.kv, caches.state)
        got = eager.forward(ours.batch(active, tokens, verify=True), ours.kv, ours.state)
        _assert_same_output(got, expected, tol)
        if graphs is not None:
            replayed = graphs.forward(graph_caches.batch(active, tokens, verify=True), graph_caches.kv,
                                      graph_caches.state)
            assert rel_err(replayed.logits, got.logits) < 1e-6, step
            for got_ssm, replayed_ssm in zip(got.states.ssm, replayed.states.ssm):
                assert rel_err(replayed_ssm, got_ssm) < 1e-6, step
    _assert_same_caches(ours, caches, tol)
    if graphs is not None:
        _assert_same_caches(graph_caches, ours, 1e-6)
        assert graphs.captured_verify(3, 4)  # the repeated shape was captured and replayed


@needs_cuda_graphs
def test_verify_graphs_are_captured_again_after_the_state_buffers_grow():
    """A bigger batch than any before reallocates the per-token state buffers and drops the verify graphs bound to
    the old ones (and their memory pool); the next captures must work, replay right, and leave the decode runner's
    graphs (its own pool) alone."""
    reference, model, fused = _runtimes("tiny")
    vocab = model.config.vocab_size
    rows = [0, 1, 2]
    caches = Caches(reference, len(rows))
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 17, 30)]
    with torch.no_grad():
        reference.forward(caches.batch(rows, prompts, verify=False), caches.kv, caches.state)
    graph_caches = caches.clone()
    eager = VerifyGraphRunner(model, fused, use_graphs=False)
    graphs = VerifyGraphRunner(model, fused, use_graphs=True)
    decoder = DecodeGraphRunner(model, fused, use_graphs=True)
    # 3 tokens, grown to 12 (graphs dropped), smaller shapes again (captured into the new pool), decode in between
    plan = [(rows[:1], 3), (rows[:1], 3), ("decode", 1), (rows, 4), (rows, 4), (rows[:1], 3), ("decode", 1),
            (rows[:2], 2), (rows, 4)]
    for step, (active, q) in enumerate(plan):
        if active == "decode":
            tokens = [[int(t)] for t in torch.randint(0, vocab, (len(rows),))]
            for target in (caches, graph_caches):
                decoder.forward(target.batch(rows, tokens, verify=False), target.kv, target.state)
            continue
        tokens = [torch.randint(0, vocab, (q,)).tolist() for _ in active]
        expected = eager.forward(caches.batch(active, tokens, verify=True), caches.kv, caches.state)
        got = graphs.forward(graph_caches.batch(active, tokens, verify=True), graph_caches.kv, graph_caches.state)
        assert rel_err(got.logits, expected.logits) < 1e-6, step
        for got_ssm, expected_ssm in zip(got.states.ssm, expected.states.ssm):
            assert rel_err(got_ssm, expected_ssm) < 1e-6, step
    _assert_same_caches(graph_caches, caches, 1e-6)
    assert graphs.captured_verify(3, 4) and graphs.captured_verify(1, 3) and graphs.captured_verify(2, 2)
    assert decoder.captured(3)


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_runtime_sends_verify_batches_to_the_verify_runner(cuda_graphs, monkeypatch):
    """Wherever the runtime has the decode runner; eager under ``--no-cuda-graph``."""
    config = preset_config("tiny")
    if CUDA:  # the load path (``accelerate``) builds the decode runner
        tensors = random_text_weights(config, device=DEVICE, dtype=DTYPE, seed=5)
        runtime = build_runtime(
            InMemorySource("tiny", config, tensors), dtype=DTYPE, device=DEVICE, cuda_graphs=cuda_graphs
        )
    else:  # Triton's interpreter: an eager decode runner over the fused CPU model
        _, model, fused = _runtimes("tiny")
        runtime = Qwen35Runtime(model, None, DecodeGraphRunner(model, fused, use_graphs=False))
    verifier = runtime.verifier
    assert verifier is not None and verifier.use_graphs == (CUDA and cuda_graphs)
    taken = []
    real_forward = verifier.forward
    monkeypatch.setattr(verifier, "forward", lambda *args: taken.append(args[0].query_lens) or real_forward(*args))
    caches = Caches(runtime, 2)
    prompts = [torch.randint(0, config["vocab_size"], (n,)).tolist() for n in (9, 4)]
    runtime.forward(caches.batch([0, 1], prompts, verify=False), caches.kv, caches.state)
    for _ in range(2):  # eager warm-up and capture, then a replay
        output = runtime.forward(caches.batch([0, 1], [[3, 4, 5], [6, 7, 8]], verify=True), caches.kv, caches.state)
        assert output.logits.shape == (6, config["vocab_size"]) and len(output.states.ssm) == 3
    runtime.forward(caches.batch([0, 1], [[3, 4], [6, 7, 8]], verify=True), caches.kv, caches.state)  # ragged: padded
    assert taken == [[3, 3], [3, 3], [2, 3]]
    assert bool(verifier.captured_verify(2, 3)) == (CUDA and cuda_graphs)
