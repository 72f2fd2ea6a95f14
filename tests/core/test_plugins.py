"""The plugin framework: built-ins, entry points, allow-list, validation, duplicate names, contrib plugin."""

from __future__ import annotations

import json
import subprocess
import sys

import falcon
import falcon.asgi
import falcon.testing
import pytest

from ninfer.core.descriptors import SpeculativeBackend
from ninfer.core.errors import PluginError
from ninfer.core.hookspecs import hookimpl
from ninfer.core.plugins import PluginInfo, PluginManager, allow_list_from_env, load_plugin_manager
from ninfer.core.records import RequestRecord


def _manager_with(*plugins: tuple[str, object]) -> PluginManager:
    manager = PluginManager()
    manager.load_builtins()
    for name, plugin in plugins:
        manager.register(plugin, PluginInfo(name, "test-dist", "9.9", builtin=False))
    manager.check()
    return manager


def test_builtins_register_every_extension_kind():
    registries = load_plugin_manager(entry_points=False).registries
    assert {"qwen3_5", "qwen3_5_moe"} <= set(registries.model_families)
    ranges = {n: (b.min_draft_tokens, b.max_draft_tokens) for n, b in registries.speculative_backends.items()}
    assert ranges == {"mtp": (1, 5), "dflash": (1, 15), "dflash2": (1, 15)}
    assert list(registries.kv_dtypes) == ["bf16", "int8", "fp8", "nvfp4", "k8v4"]
    assert registries.kv_dtypes["bf16"].bytes_per_token_per_head_dim == 4.0
    assert {name: dtype.bytes_per_token_per_head_dim * 256 for name, dtype in registries.kv_dtypes.items()} == {
        "bf16": 1024, "int8": 528, "fp8": 516, "nvfp4": 288, "k8v4": 402}
    assert {"health", "models", "openai_chat", "openai_responses", "anthropic_messages"} <= set(
        registries.protocol_adapters
    )


def test_unimplemented_selections_fail_with_not_yet_available():
    registries = load_plugin_manager(entry_points=False).registries
    assert registries.kv_dtype("fp8").require_storage()() is not None  # the quantized KV dtypes have storage now


def test_misspelled_hook_implementation_fails_at_startup():
    class Misspelled:
        @hookimpl
        def ninfer_model_familys(self):  # typo: no such hook
            return []

    with pytest.raises(PluginError, match="ninfer_model_familys"):
        _manager_with(("typo", Misspelled()))


def test_duplicate_registration_names_both_plugins():
    class ExtraMtp:
        @hookimpl
        def ninfer_speculative_backends(self):
            return [SpeculativeBackend("mtp", 1, 3, "mtp.")]

    with pytest.raises(PluginError, match=r"'mtp'.*ninfer\.plugins\.speculative.*'shadow'"):
        _manager_with(("shadow", ExtraMtp())).registries


def test_two_plugins_with_the_same_name_fail():
    class A:
        @hookimpl
        def ninfer_kv_dtypes(self):
            return []

    manager = PluginManager()
    manager.register(A(), PluginInfo("same", "dist-a", "1", builtin=False))
    with pytest.raises(PluginError, match="dist-a.*dist-b"):
        manager.register(A(), PluginInfo("same", "dist-b", "2", builtin=False))


def test_third_party_descriptor_is_a_first_class_choice():
    class Backend:
        @hookimpl
        def ninfer_speculative_backends(self):
            return [SpeculativeBackend("ngram", 1, 8, "ngram.")]

    registries = _manager_with(("ngram-plugin", Backend())).registries
    assert registries.speculative_backend("ngram").max_draft_tokens == 8
    assert registries.owners[("speculative backend", "ngram")] == "ngram-plugin"


def test_family_lookup_names_the_unknown_architecture():
    from ninfer.core.artifact.container import Identity, Manifest
    from ninfer.core.errors import ArtifactError

    registries = load_plugin_manager(entry_points=False).registries
    manifest = Manifest(Identity("x"), "LlamaForCausalLM", {"model_type": "llama"})
    with pytest.raises(ArtifactError, match="LlamaForCausalLM"):
        registries.family_for(manifest)
    qwen = Manifest(Identity("q"), "Qwen3_5MoeForConditionalGeneration", {"text_config": {"model_type": "qwen3_5_moe_text"}})
    assert registries.family_for(qwen).name == "qwen3_5_moe"


def test_allow_list_parsing():
    assert allow_list_from_env({}) is None
    assert allow_list_from_env({"NINFER_PLUGINS": ""}) == []
    assert allow_list_from_env({"NINFER_PLUGINS": " prometheus , other "}) == ["prometheus", "other"]


def test_contrib_prometheus_plugin_is_discovered_and_restricted():
    names = {info.name for info in load_plugin_manager().info.values()}
    assert "prometheus" in names, "install plugins-contrib/ninfer-prometheus (the README test command does)"
    manager = load_plugin_manager(environ={"NINFER_PLUGINS": ""})
    assert "prometheus" not in manager.info
    assert "prometheus_metrics" not in manager.registries.protocol_adapters
    manager = load_plugin_manager(environ={"NINFER_PLUGINS": "prometheus"})
    assert manager.info["prometheus"].distribution == "ninfer-prometheus"
    with pytest.raises(PluginError, match="not-installed"):
        load_plugin_manager(environ={"NINFER_PLUGINS": "prometheus,not-installed"})


def _sample(text: str, name: str) -> float:
    """The value of the exposition line starting with ``name`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_contrib_prometheus_serves_metrics_through_the_adapter_hook():
    manager = load_plugin_manager(environ={"NINFER_PLUGINS": "prometheus"})
    adapter = manager.registries.protocol_adapters["prometheus_metrics"]
    app = falcon.asgi.App()
    adapter.require_mount()(app, None)
    client = falcon.testing.TestClient(app)
    requests = 'ninfer_requests_total{finish_reason="stop",protocol="openai_chat"}'
    completion = 'ninfer_completion_tokens_total{protocol="openai_chat"}'
    before = client.simulate_get("/metrics").text
    manager.hook.ninfer_request_finished(
        record=RequestRecord("openai_chat", "stop", prompt_tokens=12, cached_tokens=4, completion_tokens=7, total_seconds=0.5)
    )
    result = client.simulate_get("/metrics")
    assert result.status == falcon.HTTP_200
    assert result.headers["content-type"].startswith("text/plain")
    assert _sample(result.text, requests) == _sample(before, requests) + 1
    assert _sample(result.text, completion) == _sample(before, completion) + 7


def test_plugins_list_json_cli_shows_contrib_plugin():
    out = subprocess.run(
        [sys.executable, "-c", "from ninfer.cli import main; main()", "plugins", "list", "--json"], capture_output=True, text=True, check=True
    ).stdout
    rows = {row["name"]: row for row in json.loads(out)}
    assert rows["prometheus"]["distribution"] == "ninfer-prometheus"
    assert rows["prometheus"]["registers"]["protocol adapter"][0]["routes"] == ["GET /metrics"]
