"""FP8 / NVFP4 weights on the CPU reference path: published quantized checkpoints served in place and converted,
``ninfer convert --quantize``, and the refusals.

Oracles: transformers' ``Qwen3_5ForConditionalGeneration`` (and the MoE class) loaded from the bf16 directory in
fp32, once as it is (the quantization error is bounded) and once with each quantized weight replaced by the
tests' own dequantization formula applied to the stored tensors (ninfer must then match to fp32 noise); and
``safetensors.safe_open`` reading the stored tensors independently of ninfer.

Bounds against the bf16 model: relative Frobenius error of all prompt logits (``||got - ref|| / ||ref||``). The
tiny random model amplifies weight noise (weight errors of 2.7 % for FP8 and 9.6 % for NVFP4 become logits errors of
10.5 % and 38 %; a real checkpoint's are far smaller), so each bound is the value measured here with 40-50 % margin
(see ``BOUNDS``); the exactness of the arithmetic is what the dequantized-weights oracle checks, to 1e-4.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from quantized_checkpoints import (
    KINDS,
    PROMPT,
    fp8_official,
    projections,
    quantized_checkpoint,
    stored_formula,
    tiny_dense,
    write_checkpoint,
)
from safetensors import safe_open

from ninfer.core.artifact.container import Artifact
from ninfer.core.artifact.convert import convert_checkpoint
from ninfer.core.artifact.source import open_model_source
from ninfer.core.errors import ArtifactError, ConfigError, NotYetAvailableError
from ninfer.core.runtime import ForwardBatch, KVCache, LoadOptions, StateCache
from ninfer.plugins.qwen3_5.model.model import WeightLoader
from ninfer.plugins.qwen3_5.model.quantized import dense, refuse_on_cuda
from ninfer.plugins.qwen3_5.model.runtime import load_runtime
from ninfer.plugins.qwen3_5.model.tiny import make_tiny
from ninfer.plugins.qwen3_5.model.weights import quantizable_weights

transformers = pytest.importorskip("transformers")

#: bound on the relative Frobenius logits error vs the bf16 model; measured: fp8 0.105, nvfp4 0.385, mixed (NVFP4 MLP,
#: block FP8 attention and GDN) 0.165, modelopt 0.385 (the same codes as nvfp4); convert --quantize: fp8 0.105,
#: nvfp4 0.385; tiny MoE: fp8 0.117, nvfp4 0.313
BOUNDS = {"fp8": 0.15, "nvfp4": 0.55, "mixed": 0.25, "modelopt": 0.55}
MOE_BOUNDS = {"fp8": 0.17, "nvfp4": 0.45}
EXACT = 1e-4  # ninfer vs transformers on the same dequantized weights: fp32 paths differing in summation order


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _stored(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _logits(source) -> torch.Tensor:
    """Prompt logits (fp32, one row per token) of ``source`` through the family's ``load_runtime`` on the CPU."""
    from ninfer.core.plugins import load_plugin_manager

    family = load_plugin_manager(entry_points=False).registries.family_for(source.manifest)
    runtime = family.require("load_runtime")(source, LoadOptions())
    kv, state = KVCache.allocate(runtime.spec, 2, 16), StateCache.allocate(runtime.spec, 1)
    ids = torch.tensor(PROMPT)
    batch = ForwardBatch(token_ids=ids, positions=torch.arange(len(ids)).expand(3, -1), query_lens=[len(ids)],
                         context_lens=[0], page_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                         state_slots=torch.tensor([0]), logits="all")
    return runtime.forward(batch, kv, state).logits


def _transformers_logits(directory, replaced: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' fp32 logits of the bf16 checkpoint, with ``replaced`` weights swapped in."""
    config = json.loads((directory / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model = cls.from_pretrained(directory, dtype=torch.float32).eval()
    state = model.state_dict()
    with torch.no_grad():
        for name, value in (replaced or {}).items():
            state[name].copy_(value)
        return model(torch.tensor(PROMPT)[None]).logits[0]


def _bf16_model(family: str, tmp_path_factory):
    """(tiny bf16 model, its checkpoint directory, transformers' logits of it)."""
    tiny = tiny_dense(family)
    directory = write_checkpoint(tmp_path_factory.mktemp("bf16") / f"tiny-{family}", tiny, tiny.tensors)
    return tiny, directory, _transformers_logits(directory)


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory):
    return _bf16_model("qwen3_5", tmp_path_factory)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    return _bf16_model("qwen3_5_moe", tmp_path_factory)


@pytest.fixture(scope="module")
def checkpoints(dense_model, tmp_path_factory):
    """kind -> (quantized checkpoint directory, transformers' logits with its weights dequantized by formula)."""
    tiny, directory, _ = dense_model
    root = tmp_path_factory.mktemp("quantized")
    built = {}
    for kind in KINDS:
        path = quantized_checkpoint(root / f"tiny-{kind}", tiny, kind)
        stored = _stored(path / "model.safetensors")
        fake = {name: stored_formula(stored, name) for name in projections(tiny.tensors)}
        built[kind] = (path, _transformers_logits(directory, fake))
    return built


@pytest.mark.parametrize("route", ["serve", "convert"])
@pytest.mark.parametrize("kind", KINDS)
def test_quantized_checkpoints_run_near_the_bf16_model(kind, route, dense_model, checkpoints, tmp_path):
    tiny, _, reference = dense_model
    path, dequantized_reference = checkpoints[kind]
    source = open_model_source(path) if route == "serve" else Artifact.open(convert_checkpoint(path, tmp_path / "m.ninfer"))
    with source:
        assert set(source.manifest.quantized) == set(projections(tiny.tensors))
        assert source.manifest.weight_format["dtype"] == "bfloat16"
        logits = _logits(source)
    assert _relative(logits, dequantized_reference) < EXACT
    assert _relative(logits, reference) < BOUNDS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_weights_equal_the_formula_on_the_stored_tensors(kind, checkpoints, tmp_path):
    path, _ = checkpoints[kind]
    artifact_path = convert_checkpoint(path, tmp_path / "m.ninfer")
    for source, stored_path in ((open_model_source(path), path / "model.safetensors"),
                                (Artifact.open(artifact_path), artifact_path)):
        with source:
            stored = _stored(stored_path)
            loader = WeightLoader(source, torch.float32, torch.device("cpu"))
            for name in source.manifest.quantized:
                got = dense(loader.take_linear(name), torch.float32)
                if kind == "modelopt" and stored_path.name == "model.safetensors":  # ninfer divides by 1 / scale_2
                    torch.testing.assert_close(got, stored_formula(stored, name), rtol=1e-6, atol=0)
                else:
                    assert torch.equal(got, stored_formula(stored, name)), name


def test_the_artifact_stores_the_checkpoints_tensors_unchanged(checkpoints, tmp_path):
    path, _ = checkpoints["nvfp4"]
    stored, written = _stored(path / "model.safetensors"), _stored(convert_checkpoint(path, tmp_path / "m.ninfer"))
    for name, tensor in stored.items():
        kept = written[name.replace("weight_packed", "weight")]
        assert torch.equal(kept.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_convert_quantize_encodes_the_projections_and_keeps_the_rest(family, fmt, request, tmp_path):
    tiny, directory, reference = request.getfixturevalue("dense_model" if family == "qwen3_5" else "moe_model")
    out = convert_checkpoint(directory, tmp_path / "q.ninfer", quantize=fmt)
    written = _stored(out)
    with Artifact.open(out) as artifact:
        quantized = set(artifact.manifest.quantized)
        assert quantized == set(quantizable_weights(tiny.config))
        assert artifact.manifest.weight_format["quantization"] == {
            {"fp8": "fp8_block 128x128", "nvfp4": "nvfp4 g16"}[fmt]: len(quantized)}
        logits = _logits(artifact)
    assert any(".experts." in name for name in quantized) == (family == "qwen3_5_moe")
    for name, tensor in tiny.tensors.items():
        if name not in quantized:
            assert torch.equal(written[name], tensor), name
    assert "model.language_model.embed_tokens.weight" not in quantized and "lm_head.weight" not in quantized
    assert not any(name.endswith(("in_proj_a.weight", "in_proj_b.weight", "mlp.gate.weight")) for name in quantized)
    dequantized = {name: stored_formula(written, name) for name in quantized}
    assert _relative(logits, _transformers_logits(directory, dequantized)) < EXACT
    assert _relative(logits, reference) < (BOUNDS if family == "qwen3_5" else MOE_BOUNDS)[fmt]


def test_convert_quantize_refuses_an_already_quantized_checkpoint(checkpoints, tmp_path):
    with pytest.raises(ConfigError, match="already quantized"):
        convert_checkpoint(checkpoints["fp8"][0], tmp_path / "q.ninfer", quantize="nvfp4")
    assert not (tmp_path / "q.ninfer").exists()


@pytest.mark.parametrize(
    "quantization, named",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "'awq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}, "'pack-quantized'"),
        ({"quant_method": "fp8", "weight_block_size": None}, "per-tensor fp8"),
    ],
)
def test_unsupported_quantization_is_refused_naming_it(quantization, named, dense_model, tmp_path):
    tiny = dense_model[0]
    directory = write_checkpoint(tmp_path / "odd", tiny, tiny.tensors, quantization)
    with pytest.raises(NotYetAvailableError, match=named):
        open_model_source(directory)
    with pytest.raises(NotYetAvailableError, match=named):
        convert_checkpoint(directory, tmp_path / "odd.ninfer")


def test_codes_without_their_scales_are_an_error(dense_model, tmp_path):
    tiny = dense_model[0]
    name = projections(tiny.tensors)[0]
    tensors = {**tiny.tensors, name: tiny.tensors[name].to(torch.float8_e4m3fn)}
    directory = write_checkpoint(tmp_path / "scaleless", tiny, tensors, {"quant_method": "fp8"})
    with pytest.raises(ArtifactError, match=f"{name}.*no scales"):
        open_model_source(directory)


def test_quantized_weights_are_refused_on_cuda_before_loading(checkpoints, dense_model):
    with open_model_source(checkpoints["fp8"][0]) as source:
        with pytest.raises(ConfigError, match="FP8/NVFP4 weights on CUDA need the fused kernels"):
            refuse_on_cuda(source, torch.device("cuda"))
        refuse_on_cuda(source, torch.device("cpu"))
    with open_model_source(dense_model[1]) as source:
        refuse_on_cuda(source, torch.device("cuda"))


def test_mtp_and_a_quantized_lm_head_run_as_their_dequantized_weights(tmp_path):
    """A checkpoint that also quantizes lm_head and the MTP module: lm_head is dequantized once at load (a plain
    tensor, as the drafters read it), and the trunk and MTP step equal a dense artifact of the dequantized weights."""
    tiny = make_tiny(types.SimpleNamespace(family="qwen3_5", mtp=True, seed=0))
    targets = [n for n in tiny.tensors if n.startswith("mtp.") and n.endswith("proj.weight")]
    targets += ["mtp.fc.weight", "lm_head.weight", *projections(tiny.tensors)]
    tensors = dict(tiny.tensors)
    for name in targets:
        tensors.update(fp8_official(name, tensors.pop(name)))
    directory = write_checkpoint(tmp_path / "fp8-mtp", tiny, tensors, {"quant_method": "fp8"})
    dense_tensors = {**tiny.tensors, **{name: stored_formula(tensors, name) for name in targets}}  # fp32
    reference = write_checkpoint(tmp_path / "dense-mtp", tiny, dense_tensors)
    runs = []
    for path in (directory, reference):
        with open_model_source(path) as source:
            runtime = load_runtime(source, LoadOptions())
            kv, state = KVCache.allocate(runtime.spec, 2, 16), StateCache.allocate(runtime.spec, 1)
            ids = torch.tensor(PROMPT)
            trunk = runtime.forward(ForwardBatch(
                token_ids=ids, positions=torch.arange(len(ids)).expand(3, -1), query_lens=[len(ids)], context_lens=[0],
                page_tables=torch.tensor([[0, 1]], dtype=torch.int32), state_slots=torch.tensor([0]), logits="all",
                return_hidden=True), kv, state)
            draft, _ = runtime.mtp.forward(ids[1:], trunk.hidden[:-1], torch.arange(len(ids) - 1).expand(3, -1),
                                           [len(ids) - 1], [0], torch.tensor([[0, 1]], dtype=torch.int32),
                                           KVCache.allocate(runtime.mtp.spec, 2, 16))
            assert isinstance(runtime.model.lm_head, torch.Tensor)
            runs.append((trunk.logits, draft, isinstance(runtime.mtp.weights.fc, torch.Tensor)))
    (logits, draft, fc_dense), (dense_logits, dense_draft, _) = runs
    assert not fc_dense  # the MTP fc stays a quantized record
    assert _relative(logits, dense_logits) < EXACT and _relative(draft, dense_draft) < EXACT


def test_per_expert_quantized_moe_checkpoints_are_refused(tmp_path):
    tiny = tiny_dense("qwen3_5_moe")
    tensors = {}
    for name, tensor in tiny.tensors.items():
        block = name.removesuffix(".gate_up_proj").removesuffix(".down_proj")
        if name.endswith(".experts.gate_up_proj"):
            for expert, matrix in enumerate(tensor):
                gate, up = matrix.chunk(2)
                tensors.update(fp8_official(f"{block}.{expert}.gate_proj.weight", gate))
                tensors.update(fp8_official(f"{block}.{expert}.up_proj.weight", up))
        elif name.endswith(".experts.down_proj"):
            for expert, matrix in enumerate(tensor):
                tensors.update(fp8_official(f"{block}.{expert}.down_proj.weight", matrix))
        else:
            tensors[name] = tensor
    directory = write_checkpoint(tmp_path / "moe-fp8", tiny, tensors, {"quant_method": "fp8"})
    with pytest.raises(NotYetAvailableError, match=r"routed experts of .*mlp\.experts are stored quantized"):
        open_model_source(directory)
