"""The ``ninfer`` commands other than option parsing: plugins list, artifact inspect, make-tiny, convert, serve hand-off."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from click.testing import CliRunner

from ninfer.cli import cli
from ninfer.core.artifact.container import Identity, Manifest, tensor_entries, write_artifact
from ninfer.core.config import ServeConfig
from ninfer.core.errors import ArtifactError
from ninfer.core.plugins import load_plugin_manager


@pytest.fixture(scope="module")
def manager():
    return load_plugin_manager(entry_points=False)


def invoke(*args: str, obj: Any = None):
    return CliRunner().invoke(cli, list(args), obj=obj)


# -- plugins list ----------------------------------------------------------------------------------


def test_plugins_list_json_shows_builtin_registrations(manager):
    result = invoke("plugins", "list", "--json", obj=manager)
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    families = {item["name"]: item for item in rows["ninfer.plugins.qwen3_5"]["registers"]["model family"]}
    assert set(families) == {"qwen3_5", "qwen3_5_moe"}
    assert "Qwen3_5ForConditionalGeneration" in families["qwen3_5"]["architectures"]
    backends = {item["name"]: item["draft_tokens"] for item in rows["ninfer.plugins.speculative"]["registers"]["speculative backend"]}
    assert backends == {"mtp": [1, 5], "dflash": [1, 15], "dflash2": [1, 15]}
    kv = {item["name"] for item in rows["ninfer.plugins.kv_dtypes"]["registers"]["KV dtype"]}
    assert kv == {"bf16", "int8", "fp8", "nvfp4", "k8v4"}
    adapters = {item["name"] for item in rows["ninfer.protocols.builtin"]["registers"]["protocol adapter"]}
    assert {"health", "models", "openai_chat", "openai_responses", "anthropic_messages"} <= adapters
    for row in rows.values():
        assert row["distribution"] == "ninfer" and row["builtin"] is True


def test_plugins_list_table(manager):
    result = invoke("plugins", "list", obj=manager)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS"]
    text = result.stdout
    assert "speculative backend mtp (draft tokens 1..5;" in text
    assert "speculative backend dflash2 (draft tokens 1..15;" in text
    assert "KV dtype bf16 (4 bytes/token/head-dim; available)" in text
    assert "model family qwen3_5_moe" in text and "protocol adapter openai_chat (POST /v1/chat/completions;" in text


# -- artifact inspect ------------------------------------------------------------------------------

TINY_CONFIG = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": 100,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 2048,
}


@pytest.fixture()
def small_artifact(tmp_path) -> Path:
    manifest = Manifest(
        identity=Identity("inspect-me"),
        architecture="Qwen3_5MoeForCausalLM",
        config=TINY_CONFIG,
        companions=("mtp",),
        generation_defaults={"temperature": 0.6, "eos_token_ids": [7]},
    )
    tensors = {"w.a": torch.zeros(4, 8, dtype=torch.bfloat16), "w.b": torch.ones(5, dtype=torch.float32)}
    resources = {"frontend/chat_template.jinja": b"{{ messages }}", "tokenizer/tokenizer.json": b"{}" * 1024}
    return write_artifact(tmp_path / "small.ninfer", manifest, tensor_entries(tensors), resources)


def test_artifact_inspect_json(small_artifact, manager):
    result = invoke("artifact", "inspect", str(small_artifact), "--json", obj=manager)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["model_id"] == "inspect-me"
    assert info["family"] == "qwen3_5_moe"
    assert info["architecture"] == "Qwen3_5MoeForCausalLM"
    # 8 layers, every 4th full attention: layers 3 and 7.
    assert info["config"]["layer_kinds"] == {"linear_attention": 6, "full_attention": 2}
    assert (info["config"]["hidden_size"], info["config"]["num_experts"], info["config"]["vocab_size"]) == (32, 4, 100)
    assert info["companions"] == ["mtp"]
    assert info["generation_defaults"] == {"temperature": 0.6, "eos_token_ids": [7]}
    assert info["resources"] == {"frontend/chat_template.jinja": 14, "tokenizer/tokenizer.json": 2048}
    assert info["tensors"] == {"count": 2, "total_bytes": 4 * 8 * 2 + 5 * 4}
    assert info["weight_format"] == {"dtype": "bfloat16", "quantization": None}


def test_artifact_inspect_text(small_artifact, manager):
    result = invoke("artifact", "inspect", str(small_artifact), obj=manager)
    assert result.exit_code == 0, result.output
    fields = {line[:16].strip(): line[16:].strip() for line in result.stdout.splitlines()}
    assert fields["model id"] == "inspect-me"
    assert fields["family"] == "qwen3_5_moe"
    assert fields["layers"] == "8 (6 linear_attention, 2 full_attention)"
    assert fields["experts"] == "4 (2 per token)"
    assert fields["tensors"] == "2 tensors, 84 B"
    assert "tokenizer/tokenizer.json (2.0 KiB)" in fields["resources"]


def test_artifact_inspect_unrecognized_architecture(tmp_path, manager):
    manifest = Manifest(identity=Identity("other"), architecture="LlamaForCausalLM", config={"num_hidden_layers": 2})
    path = write_artifact(tmp_path / "llama.ninfer", manifest, [], {})
    result = invoke("artifact", "inspect", str(path), "--json", obj=manager)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["family"] is None


@pytest.mark.parametrize("content", [None, b"\x00" * 3, b"\xff" * 64])
def test_artifact_inspect_errors_are_one_line_exit_1(tmp_path, content, manager):
    path = tmp_path / "broken.ninfer"
    if content is not None:
        path.write_bytes(content)
    result = invoke("artifact", "inspect", str(path), obj=manager)
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(path) in lines[0]


# -- commands that hand off to modules landing separately -------------------------------------------


def fake_module(monkeypatch, name: str, **attributes: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_serve_hands_one_config_and_the_plugin_manager_to_the_app(monkeypatch, manager):
    calls = []
    fake_module(monkeypatch, "ninfer.server.serve", serve=lambda config, plugins: calls.append((config, plugins)))
    result = invoke("serve", "model.ninfer", "--max-concurrency", "2", "--api-key", "k", obj=manager)
    assert result.exit_code == 0, result.output
    [(config, plugins)] = calls
    assert isinstance(config, ServeConfig) and plugins is manager
    assert (config.artifact, config.max_concurrency, config.api_key) == ("model.ninfer", 2, "k")
    assert config.argv == ("ninfer", "serve", "model.ninfer", "--max-concurrency", "2", "--api-key", "<redacted>")


def test_invalid_serve_options_fail_before_the_app_loads(monkeypatch, manager):
    calls = []
    fake_module(monkeypatch, "ninfer.server.serve", serve=lambda config, plugins: calls.append(config))
    result = invoke("serve", "--spec", "mtp", obj=manager)
    assert result.exit_code == 2 and calls == []


def test_errors_raised_by_a_command_are_one_line(monkeypatch, manager):
    def fail(config, plugins):
        raise ArtifactError("model.ninfer: no such file")

    fake_module(monkeypatch, "ninfer.server.serve", serve=fail)
    result = invoke("serve", "model.ninfer", obj=manager)
    assert result.exit_code == 1
    assert result.stderr.splitlines() == ["Error: model.ninfer: no such file"]


@attrs.frozen
class RecordedTinyOptions:
    family: str
    mtp: bool
    dflash: bool
    dflash2: bool
    template: str
    seed: int


def test_make_tiny_passes_its_options(monkeypatch, tmp_path, manager):
    calls = []

    def write_tiny_artifact(out, options, registries):
        calls.append((out, options, registries))
        return Path(out)

    fake_module(monkeypatch, "ninfer.core.artifact.tiny", TinyOptions=RecordedTinyOptions, write_tiny_artifact=write_tiny_artifact)
    out = str(tmp_path / "t.ninfer")
    result = invoke("make-tiny", out, "--family", "qwen3_5_moe", "--mtp", "--template", "qwen3_8", "--seed", "7",
                    obj=manager)
    assert result.exit_code == 0, result.output
    assert calls == [(out, RecordedTinyOptions("qwen3_5_moe", True, False, False, "qwen3_8", 7), manager.registries)]
    assert result.stdout.strip() == f"wrote {out}"
    invoke("make-tiny", out, obj=manager)
    assert calls[-1][1] == RecordedTinyOptions("qwen3_5", False, False, False, "qwen3_6", 0)


def test_make_tiny_family_choices_come_from_the_registry(manager):
    result = invoke("make-tiny", "x.ninfer", "--family", "llama", obj=manager)
    assert result.exit_code == 2
    assert "--family" in result.stderr and "qwen3_5_moe" in result.stderr


def test_convert_passes_paths_model_id_and_no_progress_off_a_terminal(monkeypatch, tmp_path):
    calls = []

    def convert_checkpoint(hf_dir, out, *, model_id=None, progress=None, drafters=None, quantize=None):
        calls.append((hf_dir, out, model_id, progress, drafters, quantize))
        return Path(out)

    fake_module(monkeypatch, "ninfer.core.artifact.convert", convert_checkpoint=convert_checkpoint)
    out = str(tmp_path / "m.ninfer")
    result = invoke("convert", "hf/Qwen3.6-27B", "-o", out, "--model-id", "qwen3.6-27b")
    assert result.exit_code == 0, result.output
    assert calls == [("hf/Qwen3.6-27B", out, "qwen3.6-27b", None, {}, None)]
    invoke("convert", "hf/Qwen3.6-27B", "-o", out, "--dflash", "hf/Qwen3.6-27B-DFlash")
    assert calls[-1][4] == {"dflash": "hf/Qwen3.6-27B-DFlash"}
    invoke("convert", "hf/Qwen3.6-27B", "-o", out, "--quantize", "nvfp4")
    assert calls[-1][5] == "nvfp4"
    assert invoke("convert", "hf/Qwen3.6-27B", "-o", out, "--quantize", "int4").exit_code == 2
    assert result.stdout.strip() == f"wrote {out}"
    assert invoke("convert", "hf/Qwen3.6-27B").exit_code == 2  # -o is required


def test_make_tiny_then_inspect_end_to_end(tmp_path, manager):
    pytest.importorskip("ninfer.plugins.qwen3_5.model.tiny", reason="the Qwen tiny-model builder has not landed")
    out = tmp_path / "tiny.ninfer"
    made = invoke("make-tiny", str(out), "--mtp", obj=manager)
    assert made.exit_code == 0, made.output
    info = json.loads(invoke("artifact", "inspect", str(out), "--json", obj=manager).stdout)
    assert info["family"] == "qwen3_5" and info["companions"] == ["mtp"]
    assert info["tensors"]["count"] > 0 and "frontend/chat_template.jinja" in info["resources"]
