"""The Triton traversal (``Qwen35Model.run(fused=True)``, the CUDA default for every batch the decode and verify
runners do not take) against the reference traversal (``fused=False``, the CPU path) of the same layer loop.

Pure torch (every machine): the layout's row spans (slices instead of gathers), the stacked projections
(``stacked_rows``: one GEMM over a fused layer's row blocks, nothing copied) and a runtime without the decode runner
keeping the reference traversal.

Triton (``gpu``; on CUDA, or in Triton's CPU interpreter with ``TRITON_INTERPRET=1``): the row kernels over a whole
prefill's rows (add + RMSNorm, gated RMSNorm, SiLU·mul, sigmoid output gate, q/k norm + MRoPE + KV write) against
their torch twins, and whole traversals, dense and MoE, one and three rows, with and without a cached prefix, with
captured states and layer outputs, compared output by output and cache by cache with the reference traversal on the
same device; a runtime with the decode runner prefilling through the Triton traversal (CUDA graphs on and off). On
CUDA the model has the real head dims (256 attention, 128 linear) and runs in fp32 (the pieces must agree to
rounding) and bf16 (dense); the interpreter runs the tiny presets in fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_support import CUDA, DEVICE, DTYPE, needs_cuda_triton, needs_triton, rel_err, seed_each_test

from ninfer.core.runtime import ForwardBatch, KVCache, StateCache
from ninfer.kernels.reference.attention import write_paged_kv
from ninfer.kernels.reference.norms import gated_rms_norm, rms_norm
from ninfer.kernels.reference.rope import apply_rotary, mrope_axis_of_frequency, rope_inverse_frequencies, rotary_cos_sin
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.fused import fuse_layer, fuse_model
from ninfer.plugins.qwen3_5.model.layers import BatchLayout, stacked_linear, stacked_rows
from ninfer.plugins.qwen3_5.model.model import Qwen35Model, WeightLoader
from ninfer.plugins.qwen3_5.model.presets import preset_config
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime, runtime_spec
from ninfer.plugins.qwen3_5.model.synthetic import InMemorySource, build_runtime, random_text_weights

PAGE_SIZE = 16
# CUDA: the real head dims at toy widths, so the Triton kernels run the tile shapes of the released models
REAL_HEADS = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
REAL_SIZES = {
    "dense": dict(intermediate_size=512),
    "moe": dict(moe_intermediate_size=128, shared_expert_intermediate_size=128),
}


seeded = seed_each_test(1234, autouse=False)


# ---------------------------------------------------------------------------------------------- pure torch


def test_layout_spans_cover_consecutive_rows_only():
    lens = [5, 5, 3, 2, 5]
    layout = BatchLayout.build(lens, [0] * 5, torch.zeros(5, 1, dtype=torch.int32), 16, torch.arange(5), DEVICE)
    spans = {group.token_index.shape[1]: group.span for group in layout.groups}
    assert spans == {2: (13, 15), 3: (10, 13), 5: None}  # rows 0, 1, 4 of length 5 are not one run
    layout = BatchLayout.build([4, 4, 7], [3, 0, 1], torch.zeros(3, 1, dtype=torch.int32), 16, torch.arange(3), DEVICE)
    assert {g.token_index.shape[1]: g.span for g in layout.groups} == {4: (0, 8), 7: (8, 15)}
    x = torch.randn(15, 3, 2, device=DEVICE)
    for group in layout.groups:
        taken = group.take(x)
        assert torch.equal(taken, x[group.token_index])
        destination, expected = torch.zeros_like(x), torch.zeros_like(x)
        group.put(destination, taken + 1)
        expected[group.token_index] = x[group.token_index] + 1
        assert torch.equal(destination, expected)
    assert layout.groups[0].take(x).data_ptr() == x.data_ptr()  # a span is a view


def test_stacked_rows_see_through_fused_layers_only():
    model = _model("tiny", torch.float32, fuse=False, device=torch.device("cpu"))
    config = model.config
    layer = model.layers[0]
    mixer = layer.mixer
    parts = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a)
    assert stacked_rows(parts) is None  # separate tensors
    fused_layer, projections = fuse_layer(layer)
    fused_mixer = fused_layer.mixer
    fused_parts = (fused_mixer.in_proj_qkv, fused_mixer.in_proj_z, fused_mixer.in_proj_b, fused_mixer.in_proj_a)
    whole = stacked_rows(fused_parts)
    assert whole is not None and whole.data_ptr() == projections.mixer_in.data_ptr()
    assert torch.equal(whole, projections.mixer_in)
    tail = stacked_rows(fused_parts[1:])  # z | b | a: a view starting inside the fused tensor
    assert tail is not None and torch.equal(tail, projections.mixer_in[config.conv_dim :])
    assert stacked_rows((fused_mixer.in_proj_z, fused_mixer.in_proj_a)) is None  # not adjacent
    assert stacked_rows((fused_mixer.in_proj_b, fused_mixer.in_proj_z)) is None  # out of order
    x = torch.randn(7, config.hidden_size)
    expected = torch.cat([F.linear(x, w) for w in parts], dim=-1)
    assert torch.equal(stacked_linear(x, parts), expected)
    assert rel_err(stacked_linear(x, fused_parts), expected) < 1e-6


# ---------------------------------------------------------------------------------------------- Triton pieces


def _tol() -> float:
    return 1e-2 if CUDA else 1e-5


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.usefixtures("seeded")
def test_add_rms_norm_over_a_prefill(with_residual):
    from ninfer.kernels.triton.norms import add_rms_norm

    tokens, hidden = (8192, 5120) if CUDA else (300, 96)
    x, residual = (torch.randn(tokens, hidden, device=DEVICE).to(DTYPE) for _ in range(2))
    weight = (torch.randn(hidden, device=DEVICE) * 0.2).to(DTYPE)
    total, normed = add_rms_norm(x, residual if with_residual else None, weight, 1e-6)
    expected_total = x + residual if with_residual else x
    assert torch.equal(total, expected_total)  # the residual stream rounds exactly like the torch add
    assert rel_err(normed, rms_norm(expected_total, weight, 1e-6, zero_centered=True)) < _tol()


@pytest.mark.gpu
@needs_triton
@pytest.mark.usefixtures("seeded")
def test_gated_norm_silu_mul_and_sigmoid_gate_over_a_prefill():
    from ninfer.kernels.triton.norms import gated_rms_norm as triton_gated_rms_norm
    from ninfer.kernels.triton.norms import sigmoid_gate, silu_mul

    tokens, heads, dim, inner = (8192, 48, 128, 4352) if CUDA else (200, 4, 16, 40)
    dtype = DTYPE
    core = torch.randn(tokens, heads, dim, device=DEVICE).to(dtype)
    projection = torch.randn(tokens, heads * dim + 2 * heads, device=DEVICE).to(dtype)  # [z | b | a]
    z = projection[:, : heads * dim].view(tokens, heads, dim)
    weight = (1 + torch.randn(dim, device=DEVICE) * 0.1).to(dtype)
    out = triton_gated_rms_norm(core, z, weight, 1e-6)
    assert rel_err(out, gated_rms_norm(core.float(), z.float(), weight, 1e-6)) < _tol()
    gate_up = torch.randn(tokens, 2 * inner, device=DEVICE).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert rel_err(silu_mul(gate_up), F.silu(gate) * up) < _tol()
    attended = torch.randn(tokens, heads, 2 * dim, device=DEVICE).to(dtype)[:, :, :dim]  # strided heads
    interleaved = torch.randn(tokens, heads, 2 * dim, device=DEVICE).to(dtype)
    output_gate = interleaved[:, :, dim:]
    gated = sigmoid_gate(attended, output_gate)
    assert gated.is_contiguous() and gated.shape == (tokens, heads, dim)
    assert rel_err(gated, attended.float() * torch.sigmoid(output_gate.float())) < _tol()
    with pytest.raises(ValueError, match="same"):
        sigmoid_gate(attended, output_gate[:, :-1])
    with pytest.raises(ValueError, match="contiguous last dim"):
        sigmoid_gate(attended.transpose(1, 2), output_gate.transpose(1, 2))


@pytest.mark.gpu
@needs_triton
@pytest.mark.usefixtures("seeded")
def test_qk_norm_rope_write_kv_over_a_prefill_with_mrope_rows():
    from ninfer.kernels.triton.attention import qk_norm_rope_write_kv

    heads, kv_heads, dim, rotary, section = (24, 4, 256, 64, [11, 11, 10]) if CUDA else (4, 2, 32, 8, [2, 1, 1])
    tokens, context = (2048, 100) if CUDA else (70, 9)
    dtype = DTYPE
    pages = -(-(tokens + context) // PAGE_SIZE) + 2
    projected = torch.randn(tokens, heads * 2 * dim + 2 * kv_heads * dim, device=DEVICE).to(dtype)
    q_norm, k_norm = ((torch.randn(dim, device=DEVICE) * 0.2).to(dtype) for _ in range(2))
    text = torch.arange(context, context + tokens, device=DEVICE)
    positions = torch.stack([text, text // 3, text + 7])  # distinct MRoPE rows
    inverse = rope_inverse_frequencies(rotary, 10_000_000.0, DEVICE)
    axis = mrope_axis_of_frequency(rotary // 2, section, interleaved=True, device=DEVICE)
    table = torch.randperm(pages, device=DEVICE)
    slots = table[(context + torch.arange(tokens, device=DEVICE)) // PAGE_SIZE] * PAGE_SIZE + (text % PAGE_SIZE)
    key_cache, value_cache = (torch.randn(pages, PAGE_SIZE, kv_heads, dim, device=DEVICE).to(dtype) for _ in range(2))
    expected_keys, expected_values = key_cache.clone(), value_cache.clone()
    query = qk_norm_rope_write_kv(
        projected, q_norm, k_norm, positions, inverse, axis, key_cache, value_cache, slots, 1e-6, query_heads=heads
    )
    cos, sin = rotary_cos_sin(positions, inverse, axis)
    raw_query = projected[:, : heads * 2 * dim].view(tokens, heads, 2 * dim)[:, :, :dim].float()
    raw_key, raw_value = projected[:, heads * 2 * dim :].float().view(tokens, 2, kv_heads, dim).unbind(1)
    expected_query = apply_rotary(rms_norm(raw_query, q_norm, 1e-6, zero_centered=True), cos, sin)
    expected_key = apply_rotary(rms_norm(raw_key, k_norm, 1e-6, zero_centered=True), cos, sin)
    write_paged_kv(expected_keys, expected_values, expected_key.to(dtype), raw_value.to(dtype), slots)
    assert rel_err(query, expected_query) < _tol()
    assert rel_err(key_cache, expected_keys) < _tol()
    assert torch.equal(value_cache, expected_values)  # values are copied, other slots untouched


# ---------------------------------------------------------------------------------------------- traversals


def _config(preset: str) -> dict:
    """The tiny preset; on CUDA with the real head dims (and the real MRoPE sections for their rotary dim)."""
    config = preset_config(preset)
    if CUDA:
        config.update(REAL_HEADS, **REAL_SIZES["moe" if "moe" in preset else "dense"])
        config["rope_parameters"] = preset_config("qwen3.6-27b")["rope_parameters"]
    return config


def _model(preset: str, dtype: torch.dtype, *, fuse: bool = True, device: torch.device = DEVICE) -> Qwen35Model:
    config = _config(preset)
    tensors = random_text_weights(config, device=device, dtype=dtype, seed=3)
    with torch.no_grad():  # norms and gates away from their init values so that every weight matters
        for name, tensor in tensors.items():
            if "norm" in name or "dt_bias" in name:
                tensor.add_(torch.randn_like(tensor.float()).to(tensor.dtype) * 0.2)
    loader = WeightLoader(InMemorySource(preset, config, tensors), dtype, device)
    model = Qwen35Model.load(loader, Qwen35TextConfig.from_hf(config))
    return fuse_model(model)[0] if fuse else model


class Caches:
    """KV pages and state slots of a few rows: row r owns the (permuted) pages ``tables[r]`` and slot ``slots[r]``."""

    def __init__(self, model: Qwen35Model, rows: int, pages_per_row: int = 24) -> None:
        spec = runtime_spec(model.config, model.dtype, model.device)
        self.kv = KVCache.allocate(spec, rows * pages_per_row, PAGE_SIZE)
        self.state = StateCache.allocate(spec, rows + 2)
        self.tables = torch.randperm(rows * pages_per_row, dtype=torch.int32).view(rows, pages_per_row)
        self.slots = torch.randperm(rows + 2)[:rows]

    def clone(self) -> "Caches":
        copy = object.__new__(Caches)
        copy.kv = KVCache(self.kv.page_size, [t.clone() for t in self.kv.key], [t.clone() for t in self.kv.value])
        copy.state = StateCache([t.clone() for t in self.state.conv], [t.clone() for t in self.state.ssm])
        copy.tables, copy.slots = self.tables, self.slots
        return copy

    def tensors(self) -> list[torch.Tensor]:
        return [*self.kv.key, *self.kv.value, *self.state.conv, *self.state.ssm]


def _run(
    model: Qwen35Model,
    caches: Caches,
    chunks: list[torch.Tensor],
    context: list[int],
    *,
    fused: bool,
    capture: bool = False,
    layers: tuple[int, ...] = (),
):
    rows = len(chunks)
    positions = torch.cat([torch.arange(c, c + len(chunk)) for c, chunk in zip(context, chunks)])
    positions = torch.stack([positions, positions // 2, positions + 3])  # distinct MRoPE rows
    layout = BatchLayout.build(
        [len(chunk) for chunk in chunks], context, caches.tables[:rows], PAGE_SIZE, caches.slots[:rows], model.device
    )
    layer_outputs = dict.fromkeys(layers) if layers else None
    with torch.no_grad():
        hidden, captured = model.run(
            torch.cat(chunks).to(model.device), positions.to(model.device), layout, caches.kv, caches.state, capture,
            layer_outputs, fused=fused,  # type: ignore[arg-type]
        )
    return hidden, captured, layer_outputs


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.bfloat16:
        return 2e-2
    return 1e-3 if CUDA else 1e-4  # CUDA: Triton's fast sin/cos in the fused MRoPE


def _compare(model, lengths, prefix, *, dtype, capture=False, layers=()):
    """Prefill ``prefix`` tokens per row with the reference, then ``lengths`` more both ways; compare everything."""
    vocab = model.config.vocab_size
    caches = Caches(model, len(lengths))
    if any(prefix):
        prompts = [torch.randint(0, vocab, (n,)) for n in prefix]
        _run(model, caches, prompts, [0] * len(prefix), fused=False)
    chunks = [torch.randint(0, vocab, (n,)) for n in lengths]
    reference_caches = caches.clone()
    expected = _run(model, reference_caches, chunks, list(prefix), fused=False, capture=capture, layers=layers)
    got = _run(model, caches, chunks, list(prefix), fused=True, capture=capture, layers=layers)
    tolerance = _tolerance(dtype)
    assert rel_err(got[0], expected[0]) < tolerance
    for ours, theirs in zip(caches.tensors(), reference_caches.tensors()):
        assert rel_err(ours, theirs) < tolerance
    if capture:
        for ours, theirs in zip(got[1].conv + got[1].ssm, expected[1].conv + expected[1].ssm):
            assert rel_err(ours, theirs) < tolerance
    for index in layers:
        assert rel_err(got[2][index], expected[2][index]) < tolerance


LONG = 150 if CUDA else 17  # several 64-token chunks of the fused delta rule on CUDA; the interpreter is slow
SCENARIOS = {
    "one_row": ([2 * LONG + 3], [0]),  # one span over the whole batch: the delta rule's output is used as is
    "three_rows": ([LONG, 3, LONG], [0, 0, 0]),  # rows 0 and 2 gathered by index, row 1 token by token
    "cached_prefix": ([6, 6, 2], [20, 9, 33]),  # a two-row span after cached tokens, a two-token row
}


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.usefixtures("seeded")
def test_fused_prefill_matches_reference(preset, scenario):
    lengths, prefix = SCENARIOS[scenario]
    _compare(_model(preset, torch.float32), lengths, prefix, dtype=torch.float32)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
@pytest.mark.usefixtures("seeded")
def test_fused_prefill_captures_states_and_layer_outputs(preset):
    _compare(_model(preset, torch.float32), [3, 3, 2], [5, 12, 1], dtype=torch.float32, capture=True, layers=(0, 2, 3))


@pytest.mark.gpu
@needs_triton
@pytest.mark.usefixtures("seeded")
def test_fused_prefill_without_fused_weights_concatenates_outputs():
    _compare(_model("tiny", torch.float32, fuse=False), [LONG, 3, LONG], [2, 4, 1], dtype=torch.float32)


@pytest.mark.gpu
@needs_cuda_triton
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.usefixtures("seeded")
def test_fused_prefill_matches_reference_in_bf16(scenario):
    lengths, prefix = SCENARIOS[scenario]
    _compare(_model("tiny", torch.bfloat16), lengths, prefix, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------- the runtime's choice


def _record_traversals(monkeypatch) -> list[bool]:
    """``fused`` of every ``Qwen35Model.run`` call from now on."""
    taken: list[bool] = []
    real = Qwen35Model.run

    def recording(self, *args, fused: bool = False, **kwargs):
        taken.append(fused)
        return real(self, *args, fused=fused, **kwargs)

    monkeypatch.setattr(Qwen35Model, "run", recording)
    return taken


def _prefill(runtime: Qwen35Runtime, length: int = 7) -> torch.Tensor:
    """Last-token logits of one fresh prompt of ``length`` tokens (fixed ids)."""
    kv = KVCache.allocate(runtime.spec, 4, PAGE_SIZE)
    state = StateCache.allocate(runtime.spec, 1)
    batch = ForwardBatch(
        token_ids=torch.arange(length) * 3 % runtime.config.vocab_size, positions=torch.arange(length).expand(3, -1),
        query_lens=[length], context_lens=[0], page_tables=torch.arange(4, dtype=torch.int32)[None],
        state_slots=torch.tensor([0]),
    )
    return runtime.forward(batch, kv, state).logits


def test_a_runtime_without_the_decode_runner_keeps_the_reference_traversal(monkeypatch):
    config = preset_config("tiny")
    tensors = random_text_weights(config, device="cpu", dtype=torch.float32, seed=3)
    runtime = build_runtime(InMemorySource("tiny", config, tensors), dtype=torch.float32, device="cpu")
    assert runtime.decoder is None and runtime.verifier is None
    taken = _record_traversals(monkeypatch)
    _prefill(runtime)
    assert taken == [False]


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("cuda_graphs", [True, False])
@pytest.mark.usefixtures("seeded")
def test_a_runtime_with_the_decode_runner_prefills_through_the_triton_traversal(monkeypatch, cuda_graphs):
    """The load path's decode runner brings the Triton traversal and the verify runner, graphs or not."""
    from ninfer.plugins.qwen3_5.cuda.decode_graph import DecodeGraphRunner  # imported here: CPU installs lack triton

    config = _config("tiny")
    if CUDA:  # the load path (``accelerate``) builds the decode runner
        tensors = random_text_weights(config, device="cuda", dtype=torch.float32, seed=3)
        runtime = build_runtime(
            InMemorySource("tiny", config, tensors), dtype=torch.float32, device="cuda", cuda_graphs=cuda_graphs
        )
    else:  # Triton's interpreter: an eager decode runner over the fused CPU model
        model, fused = fuse_model(_model("tiny", torch.float32, fuse=False))
        runtime = Qwen35Runtime(model, None, DecodeGraphRunner(model, fused, use_graphs=False))
    assert runtime.decoder is not None and runtime.verifier is not None
    assert runtime.decoder.use_graphs == runtime.verifier.use_graphs == (CUDA and cuda_graphs)
    reference = Qwen35Runtime(runtime.model, None, None)
    taken = _record_traversals(monkeypatch)
    got = _prefill(runtime)
    assert taken == [True]
    expected = _prefill(reference)
    assert taken == [True, False]
    assert rel_err(got, expected) < _tolerance(torch.float32)
