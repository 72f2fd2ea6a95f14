"""Hugging Face checkpoint -> .ninfer conversion, and serving a checkpoint directory in place.

Oracles: the in-memory ``transformers`` models the checkpoints are saved from (tensor values and logits),
the checkpoint's own JSON files (config, generation defaults, resources), and ``safetensors.safe_open``
as an independent reader of the written artifact. MoE checkpoints come in both expert layouts: fused
(``save_original_format=False``) and one tensor per expert (transformers' default ``save_pretrained``).
"""

from __future__ import annotations

import functools
import gc
import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ninfer.core.artifact.container import (
    CHAT_TEMPLATE_RESOURCE,
    MANIFEST_KEY,
    RESOURCE_PREFIX,
    MappedSafetensors,
    TOKENIZER_RESOURCE,
    Artifact,
)
from ninfer.core.artifact.convert import convert_checkpoint
from ninfer.core.errors import ArtifactError, ConfigError, WeightMismatchError
from ninfer.core.artifact.hf_directory import (
    GENERATION_CONFIG_RESOURCE,
    TOKENIZER_CONFIG_RESOURCE,
    HFDirectoryArtifact,
    ShardFile,
    open_hf_directory,
)
from ninfer.core.artifact.source import open_model_source
from ninfer.core.plugins import load_plugin_manager
from ninfer.core.runtime import ForwardBatch, KVCache, LoadOptions, StateCache
from ninfer.plugins.qwen3_5.frontend.vocabulary import build_qwen_tokenizer_json

transformers = pytest.importorskip("transformers")

TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
GENERATION_CONFIG = {"eos_token_id": [7, 5], "temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
TEXT_DIMS = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    vocab_size=128,
    eos_token_id=5,
)
MOE_DIMS = dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
PAGE_SIZE = 16


@functools.cache
def _tokenizer_json() -> str:
    return build_qwen_tokenizer_json()


def _add_frontend_files(directory: Path) -> None:
    (directory / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}), encoding="utf-8")
    (directory / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG), encoding="utf-8")


def _save(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    # The fused MoE expert layout of the released checkpoints, not transformers' per-expert "original format".
    model.save_pretrained(directory, max_shard_size="20KB", save_original_format=False)
    _add_frontend_files(directory)
    assert len(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(directory.glob("model-*.safetensors"))) >= 3, "the fixture must produce several shards"
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(intermediate_size=64, **TEXT_DIMS)
    directory = tmp_path_factory.mktemp("src") / "Tiny-Qwen3.5-Dense"
    return directory, _save(transformers.Qwen3_5ForCausalLM(config), directory)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    config = transformers.Qwen3_5MoeTextConfig(**MOE_DIMS, **TEXT_DIMS)
    model = transformers.Qwen3_5MoeForCausalLM(config).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("src") / "Tiny-Qwen3.5-MoE"
    return directory, _save(model, directory)


@pytest.fixture
def dense_copy(dense, tmp_path) -> Path:
    """A private copy of the dense checkpoint that a test may damage."""
    return Path(shutil.copytree(dense[0], tmp_path / "Broken-Checkpoint"))


def _written_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def _written_manifest(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()[MANIFEST_KEY])


def _shard_holding(directory: Path, name: str) -> Path:
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    return directory / weight_map[name]


def _rewrite_shard(directory: Path, name: str, replacement: torch.Tensor | None, *, update_index: bool) -> Path:
    """Rewrite the shard holding ``name`` with that tensor replaced (or dropped when ``replacement`` is None)."""
    shard = _shard_holding(directory, name)
    tensors = load_file(shard)
    if replacement is None:
        del tensors[name]
    else:
        tensors[name] = replacement
    save_file(tensors, shard, metadata={"format": "pt"})
    if update_index and replacement is None:
        index_path = directory / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        del index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    return shard


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not out.with_name(out.name + ".partial").exists()


# -- conversion ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture_name, dtype", [("dense", "float32"), ("moe", "bfloat16")])
def test_conversion_copies_every_tensor_exactly(request, tmp_path, fixture_name, dtype):
    directory, source = request.getfixturevalue(fixture_name)
    out = convert_checkpoint(directory, tmp_path / "model.ninfer")

    written = _written_tensors(out)
    weights = {name: t for name, t in written.items() if not name.startswith(RESOURCE_PREFIX)}
    assert set(weights) == set(source)
    for name, tensor in source.items():
        assert weights[name].dtype == tensor.dtype, name
        assert torch.equal(weights[name], tensor), name

    manifest = _written_manifest(out)
    assert manifest["identity"] == {"model_id": directory.name.lower()}
    assert manifest["architecture"] == json.loads((directory / "config.json").read_text())["architectures"][0]
    assert manifest["config"] == json.loads((directory / "config.json").read_text())
    assert manifest["weight_format"] == {"dtype": dtype, "quantization": None}
    assert manifest["companions"] == []
    expected_defaults = {k: v for k, v in GENERATION_CONFIG.items() if k != "eos_token_id"}
    assert manifest["generation_defaults"] == {**expected_defaults, "eos_token_ids": [7, 5]}


def test_conversion_embeds_the_frontend_resources(dense, tmp_path):
    directory, _ = dense
    out = convert_checkpoint(directory, tmp_path / "model.ninfer", model_id="my-model")
    written = _written_tensors(out)
    resources = {
        name[len(RESOURCE_PREFIX):]: t.numpy().tobytes() for name, t in written.items() if name.startswith(RESOURCE_PREFIX)
    }
    assert resources == {
        CHAT_TEMPLATE_RESOURCE: (directory / "chat_template.jinja").read_bytes(),
        TOKENIZER_RESOURCE: (directory / "tokenizer.json").read_bytes(),
        TOKENIZER_CONFIG_RESOURCE: (directory / "tokenizer_config.json").read_bytes(),
        GENERATION_CONFIG_RESOURCE: (directory / "generation_config.json").read_bytes(),
    }
    with Artifact.open(out) as artifact:
        assert artifact.manifest.identity.model_id == "my-model"
        assert artifact.resource_text(CHAT_TEMPLATE_RESOURCE) == TEMPLATE


def test_progress_reports_every_weight_byte(dense, tmp_path):
    directory, source = dense
    calls: list[tuple[int, int]] = []
    convert_checkpoint(directory, tmp_path / "model.ninfer", progress=lambda done, total: calls.append((done, total)))
    total = sum(t.numel() * t.element_size() for t in source.values())
    assert calls[-1] == (total, total)
    assert all(t == total for _, t in calls)
    dones = [done for done, _ in calls]
    assert dones == sorted(dones) and len(calls) == len(source) + 1


def test_conversion_maps_one_shard_at_a_time(dense, tmp_path, monkeypatch):
    live: list[object] = []
    peak = 0
    original_map = ShardFile.map

    def tracking_map(shard: ShardFile):
        nonlocal peak
        mapped = original_map(shard)
        original_close = mapped.close

        def close() -> None:
            if mapped in live:
                live.remove(mapped)
            original_close()

        mapped.close = close
        live.append(mapped)
        peak = max(peak, len(live))
        return mapped

    monkeypatch.setattr(ShardFile, "map", tracking_map)
    convert_checkpoint(dense[0], tmp_path / "model.ninfer")
    assert peak == 1 and live == []


def test_unreadable_shard_mid_stream_leaves_no_file(dense, tmp_path, monkeypatch):
    original_init = MappedSafetensors.__init__
    mapped_files: list[str] = []

    def failing_init(self, path: Path, data_start: int) -> None:
        mapped_files.append(path.name)
        if len(mapped_files) == 3:
            raise PermissionError(13, "Permission denied")
        original_init(self, path, data_start)

    monkeypatch.setattr(MappedSafetensors, "__init__", failing_init)
    out = tmp_path / "model.ninfer"
    with pytest.raises(ArtifactError, match="cannot read the shard") as excinfo:
        convert_checkpoint(dense[0], out)
    assert len(mapped_files) == 3 and mapped_files[-1] in str(excinfo.value)
    _assert_nothing_written(out)


def test_mixed_dtypes_are_kept_and_the_dominant_one_reported(dense_copy, dense, tmp_path):
    name = "model.layers.0.linear_attn.A_log"
    _rewrite_shard(dense_copy, name, dense[1][name].to(torch.bfloat16), update_index=False)
    out = convert_checkpoint(dense_copy, tmp_path / "model.ninfer")
    written = _written_tensors(out)
    assert written[name].dtype == torch.bfloat16
    assert torch.equal(written[name], dense[1][name].to(torch.bfloat16))
    assert _written_manifest(out)["weight_format"]["dtype"] == "float32"


def test_generation_eos_falls_back_to_the_model_config(dense_copy, tmp_path):
    (dense_copy / "generation_config.json").unlink()
    out = convert_checkpoint(dense_copy, tmp_path / "model.ninfer")
    manifest = _written_manifest(out)
    assert manifest["generation_defaults"] == {"eos_token_ids": [5]}
    with Artifact.open(out) as artifact:
        assert GENERATION_CONFIG_RESOURCE not in artifact.resource_names


def test_causal_lm_carries_mtp_and_vision_tensors(dense_copy, dense, tmp_path):
    extras = {"mtp.fc.weight": torch.randn(32, 64), "model.visual.patch_embed.proj.bias": torch.randn(16)}
    shard = dense_copy / "model-extra.safetensors"
    save_file(extras, shard, metadata={"format": "pt"})
    index_path = dense_copy / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({name: shard.name for name in extras})
    index_path.write_text(json.dumps(index))

    out = convert_checkpoint(dense_copy, tmp_path / "model.ninfer")
    written = _written_tensors(out)
    for name, tensor in {**dense[1], **extras}.items():
        assert torch.equal(written[name], tensor), name
    assert _written_manifest(out)["companions"] == ["mtp"]


def _conditional_generation_config() -> dict:
    config = transformers.Qwen3_5Config(
        text_config=dict(intermediate_size=64, mtp_num_hidden_layers=1, **TEXT_DIMS),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=16
        ),
    ).to_dict()
    config["architectures"] = ["Qwen3_5ForConditionalGeneration"]
    return config


def _write_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint directory whose tensors are dealt round-robin into three shards."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    weight_map = {}
    for part in range(3):
        file_name = f"model-{part + 1:05d}-of-00003.safetensors"
        chunk = {name: tensors[name] for name in names[part::3]}
        save_file(chunk, directory / file_name, metadata={"format": "pt"})
        weight_map.update({name: file_name for name in chunk})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _add_frontend_files(directory)
    return directory


def test_conditional_generation_checkpoint_converts_with_vision_and_mtp(tmp_path):
    config = _conditional_generation_config()
    family = load_plugin_manager().registries.model_families["qwen3_5"]
    expected = family.require("expected_weights")(config)
    assert any(n.startswith("mtp.") for n in expected) and any(n.startswith("model.visual.") for n in expected)
    assert any(n.startswith("model.language_model.layers.") for n in expected)

    generator = torch.Generator().manual_seed(2)
    tensors = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in expected.items()}
    directory = _write_checkpoint(tmp_path / "Qwen3.6-Tiny-VL", config, tensors)

    out = convert_checkpoint(directory, tmp_path / "vl.ninfer")
    written = _written_tensors(out)
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor), name
    manifest = _written_manifest(out)
    assert manifest["identity"]["model_id"] == "qwen3.6-tiny-vl"
    assert manifest["architecture"] == "Qwen3_5ForConditionalGeneration"
    assert manifest["companions"] == ["mtp"]
    assert manifest["weight_format"]["dtype"] == "bfloat16"


# -- the directory view ---------------------------------------------------------------------------------


def test_directory_view_matches_the_converted_artifact(moe, tmp_path):
    directory, source = moe
    out = convert_checkpoint(directory, tmp_path / "model.ninfer")
    with open_model_source(directory) as view, Artifact.open(out) as artifact:
        assert isinstance(view, HFDirectoryArtifact)
        assert view.manifest == artifact.manifest
        assert view.tensor_names == artifact.tensor_names
        for name in view.tensor_names:
            assert view.tensor_info(name).shape == artifact.tensor_info(name).shape
            assert torch.equal(view.tensor(name), artifact.tensor(name)), name
            assert torch.equal(view.tensor(name), source[name]), name
        assert sorted(view.resource_names) == sorted(artifact.resource_names)
        for name in view.resource_names:
            assert view.resource(name) == artifact.resource(name)
        assert dict(view.tensors("model.layers.3.")).keys() == dict(artifact.tensors("model.layers.3.")).keys()


def test_views_outlive_their_source(dense, tmp_path):
    directory, source = dense
    out = convert_checkpoint(directory, tmp_path / "model.ninfer")
    for opened in (open_hf_directory(directory), Artifact.open(out)):
        kept = opened.tensor("lm_head.weight")
        opened.close()
        gc.collect()
        assert torch.equal(kept, source["lm_head.weight"])  # the mapping outlives close() while a view is alive
        with pytest.raises(ArtifactError, match="closed"):
            opened.tensor("lm_head.weight")


@pytest.mark.parametrize(
    "chat_template",
    [TEMPLATE, [{"name": "tool_use", "template": "other"}, {"name": "default", "template": TEMPLATE}]],
    ids=["string", "named-list"],
)
def test_chat_template_from_tokenizer_config(dense_copy, chat_template):
    (dense_copy / "chat_template.jinja").unlink()
    (dense_copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    with open_hf_directory(dense_copy) as view:
        assert view.resource_text(CHAT_TEMPLATE_RESOURCE) == TEMPLATE


def test_chat_template_list_without_default_is_an_error(dense_copy):
    (dense_copy / "chat_template.jinja").unlink()
    (dense_copy / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "y"}]}))
    with pytest.raises(ArtifactError, match="tokenizer_config.json.*'default'"):
        open_hf_directory(dense_copy)


def test_single_file_checkpoint(dense, tmp_path):
    directory = tmp_path / "single"
    directory.mkdir()
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        shutil.copy(dense[0] / name, directory / name)
    save_file(dense[1], directory / "model.safetensors", metadata={"format": "pt"})
    with open_hf_directory(directory) as view:
        assert sorted(view.tensor_names) == sorted(dense[1])
        assert view.manifest.generation_defaults == {"eos_token_ids": [5]}
        assert view.resource_names == [CHAT_TEMPLATE_RESOURCE, TOKENIZER_RESOURCE]


# -- errors: validated before anything is written ---------------------------------------------------------


def test_missing_tensor(dense_copy, tmp_path):
    _rewrite_shard(dense_copy, "model.layers.1.linear_attn.A_log", None, update_index=True)
    out = tmp_path / "out.ninfer"
    with pytest.raises(WeightMismatchError, match=r"missing tensor: model\.layers\.1\.linear_attn\.A_log"):
        convert_checkpoint(dense_copy, out)
    _assert_nothing_written(out)


def test_tensor_listed_in_index_but_absent_from_its_shard(dense_copy, tmp_path):
    shard = _rewrite_shard(dense_copy, "model.norm.weight", None, update_index=False)
    out = tmp_path / "out.ninfer"
    with pytest.raises(WeightMismatchError) as excinfo:
        convert_checkpoint(dense_copy, out)
    assert "'model.norm.weight'" in str(excinfo.value) and shard.name in str(excinfo.value)
    _assert_nothing_written(out)


def test_misshaped_tensor(dense_copy, tmp_path):
    _rewrite_shard(dense_copy, "lm_head.weight", torch.zeros(127, 32), update_index=False)
    out = tmp_path / "out.ninfer"
    with pytest.raises(WeightMismatchError, match=r"lm_head\.weight has shape \[127, 32\], expected \[128, 32\]"):
        convert_checkpoint(dense_copy, out)
    _assert_nothing_written(out)


def test_unexpected_tensor(dense_copy, tmp_path):
    name = "model.layers.0.mlp.bogus.weight"
    shard = _shard_holding(dense_copy, "model.norm.weight")
    tensors = load_file(shard)
    tensors[name] = torch.zeros(2)
    save_file(tensors, shard, metadata={"format": "pt"})
    out = tmp_path / "out.ninfer"
    with pytest.raises(WeightMismatchError, match=r"unexpected tensor: model\.layers\.0\.mlp\.bogus\.weight"):
        convert_checkpoint(dense_copy, out)
    _assert_nothing_written(out)


def test_unknown_architecture(dense_copy, tmp_path):
    config = json.loads((dense_copy / "config.json").read_text())
    config["architectures"] = ["FooBarForCausalLM"]
    (dense_copy / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out.ninfer"
    with pytest.raises(ArtifactError, match=r"'FooBarForCausalLM'.*registered families: .*qwen3_5"):
        convert_checkpoint(dense_copy, out)
    _assert_nothing_written(out)


def test_invalid_config_field_names_config_json(dense_copy, tmp_path):
    config = json.loads((dense_copy / "config.json").read_text())
    del config["hidden_size"]
    (dense_copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match=r"config\.json: .*'hidden_size'"):
        convert_checkpoint(dense_copy, tmp_path / "out.ninfer")


def _truncate(shard: Path) -> None:
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10])


def _garble_header_json(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff\x00garbage!" * 3 + b"\x01" * 2
    shard.write_bytes(bytes(data))


def _garble_header_length(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    data[0:8] = struct.pack("<Q", 2**62)
    shard.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _garble_header_json, _garble_header_length])
def test_corrupt_shard_names_the_file(dense_copy, tmp_path, damage):
    shard = _shard_holding(dense_copy, "model.layers.2.mlp.up_proj.weight")
    damage(shard)
    out = tmp_path / "out.ninfer"
    with pytest.raises(ArtifactError, match=shard.name):
        convert_checkpoint(dense_copy, out)
    _assert_nothing_written(out)
    with pytest.raises(ArtifactError, match=shard.name):
        open_model_source(dense_copy)


@pytest.mark.parametrize(
    "removed, message",
    [
        ("tokenizer.json", r"tokenizer\.json: missing"),
        ("config.json", r"config\.json: missing"),
        ("chat_template.jinja", r"no chat template"),
    ],
)
def test_missing_checkpoint_file(dense_copy, tmp_path, removed, message):
    (dense_copy / removed).unlink()
    out = tmp_path / "out.ninfer"
    with pytest.raises(ArtifactError, match=message):
        convert_checkpoint(dense_copy, out)
    _assert_nothing_written(out)


def test_missing_shard_file(dense_copy, tmp_path):
    shard = _shard_holding(dense_copy, "model.embed_tokens.weight")
    shard.unlink()
    with pytest.raises(ArtifactError, match=rf"{shard.name}: weight shard listed in model\.safetensors\.index\.json"):
        convert_checkpoint(dense_copy, tmp_path / "out.ninfer")


def test_output_directory_must_exist(dense, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        convert_checkpoint(dense[0], tmp_path / "no-such-dir" / "out.ninfer")


# -- MoE checkpoints that store experts one by one ------------------------------------------------------------


@pytest.fixture(scope="module")
def per_expert(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """An fp32 MoE checkpoint written by transformers' default save_pretrained: one tensor per expert matrix."""
    torch.manual_seed(4)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**MOE_DIMS, **TEXT_DIMS)).eval()
    directory = tmp_path_factory.mktemp("src") / "Tiny-Qwen3.5-MoE-PerExpert"
    model.save_pretrained(directory, max_shard_size="20KB")
    _add_frontend_files(directory)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in weight_map
    shards = {weight_map[f"model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"]
              for i in range(4) for e in range(4) for p in ("gate", "up", "down")}
    assert len(shards) >= 3, "the fixture must spread expert tensors over several shards"
    return directory, model


def _fused_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _prefill_logits(source, ids: torch.Tensor) -> torch.Tensor:
    """All-token logits of one prefill through the family's runtime loaded from ``source``."""
    family = load_plugin_manager().registries.family_for(source.manifest)
    runtime = family.require("load_runtime")(source, LoadOptions())
    pages = -(-len(ids) // PAGE_SIZE)
    batch = ForwardBatch(
        token_ids=ids,
        positions=torch.arange(len(ids)).expand(3, -1),
        query_lens=[len(ids)],
        context_lens=[0],
        page_tables=torch.arange(pages, dtype=torch.int32)[None],
        state_slots=torch.tensor([0]),
        logits="all",
    )
    kv = KVCache.allocate(runtime.spec, pages, PAGE_SIZE)
    return runtime.forward(batch, kv, StateCache.allocate(runtime.spec, 1)).logits


def test_per_expert_checkpoint_converts_to_the_fused_layout(per_expert, tmp_path):
    directory, model = per_expert
    calls: list[tuple[int, int]] = []
    out = convert_checkpoint(directory, tmp_path / "model.ninfer", progress=lambda *call: calls.append(call))

    source = _fused_state_dict(model)
    weights = {name: t for name, t in _written_tensors(out).items() if not name.startswith(RESOURCE_PREFIX)}
    assert set(weights) == set(source)  # fused expert tensors in, per-expert tensors gone
    for name, tensor in source.items():
        assert torch.equal(weights[name], tensor), name
    total = sum(t.numel() * t.element_size() for t in source.values())
    assert calls[-1] == (total, total) and len(calls) == len(source) + 1


@pytest.mark.parametrize("served_from", ["converted", "directory"])
def test_per_expert_checkpoint_logits_match_transformers(per_expert, tmp_path, served_from):
    directory, model = per_expert
    path = convert_checkpoint(directory, tmp_path / "model.ninfer") if served_from == "converted" else directory
    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids[None]).logits[0]
    with open_model_source(path) as source:
        got = _prefill_logits(source, ids)
    assert got.shape == expected.shape
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-4


def test_directory_view_presents_fused_experts_and_hides_their_sources(per_expert):
    directory, model = per_expert
    source = _fused_state_dict(model)
    with open_hf_directory(directory) as view:
        assert sorted(view.tensor_names) == sorted(source)
        fused = "model.layers.1.mlp.experts.gate_up_proj"
        info = view.tensor_info(fused)
        assert (info.dtype, tuple(info.shape), info.nbytes) == (torch.float32, (4, 32, 32), 4 * 32 * 32 * 4)
        assert torch.equal(view.tensor(fused), source[fused])
        with pytest.raises(ArtifactError, match=r"no tensor named 'model\.layers\.1\.mlp\.experts\.2\.up_proj"):
            view.tensor("model.layers.1.mlp.experts.2.up_proj.weight")


def test_missing_expert_tensor_is_named(per_expert, tmp_path):
    directory = Path(shutil.copytree(per_expert[0], tmp_path / "Missing-Expert"))
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    _rewrite_shard(directory, name, None, update_index=True)
    out = tmp_path / "out.ninfer"
    with pytest.raises(WeightMismatchError, match=r"gate_up_proj is built from .*1 missing tensor: " + re.escape(name)):
        convert_checkpoint(directory, out)
    _assert_nothing_written(out)
    with pytest.raises(WeightMismatchError, match=re.escape(name)):
        open_model_source(directory)


def test_misshaped_expert_tensor_is_named(per_expert, tmp_path):
    directory = Path(shutil.copytree(per_expert[0], tmp_path / "Misshaped-Expert"))
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    _rewrite_shard(directory, name, torch.zeros(32, 15), update_index=False)
    out = tmp_path / "out.ninfer"
    with pytest.raises(WeightMismatchError, match=re.escape(name) + r" has shape \[32, 15\], expected \[32, 16\]"):
        convert_checkpoint(directory, out)
    _assert_nothing_written(out)


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every fused expert pair split into per-expert gate/up/down matrices."""
    split: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            block, inner = name.removesuffix(".gate_up_proj"), tensor.shape[1] // 2
            for e, matrix in enumerate(tensor):
                split[f"{block}.{e}.gate_proj.weight"] = matrix[:inner].clone()
                split[f"{block}.{e}.up_proj.weight"] = matrix[inner:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            block = name.removesuffix(".down_proj")
            split.update({f"{block}.{e}.down_proj.weight": matrix.clone() for e, matrix in enumerate(tensor)})
        else:
            split[name] = tensor
    return split


def test_per_expert_conditional_generation_with_moe_mtp(tmp_path):
    config = transformers.Qwen3_5MoeConfig(
        text_config=dict(mtp_num_hidden_layers=1, **MOE_DIMS, **TEXT_DIMS),
        vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, num_position_embeddings=16
        ),
    ).to_dict()
    config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
    expected = load_plugin_manager().registries.model_families["qwen3_5_moe"].require("expected_weights")(config)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in expected
    generator = torch.Generator().manual_seed(6)
    tensors = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in expected.items()}
    stored = _per_expert(tensors)
    assert "mtp.layers.0.mlp.experts.3.down_proj.weight" in stored
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" in stored
    directory = _write_checkpoint(tmp_path / "Qwen3.6-Tiny-MoE-VL", config, stored)

    out = convert_checkpoint(directory, tmp_path / "moe-vl.ninfer")
    written = {name: t for name, t in _written_tensors(out).items() if not name.startswith(RESOURCE_PREFIX)}
    assert set(written) == set(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor), name
    assert _written_manifest(out)["companions"] == ["mtp"]
