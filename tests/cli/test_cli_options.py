"""Every ``ninfer serve`` option: documented default, accepted values, rejected values, cross-option rules.

The oracle is the "Server options" table of spec/serving.md (and the brief's ranges): expected values are written
out here, never read back from ServeConfig.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib.metadata import version
from typing import Any

import pytest
from click.testing import CliRunner

from ninfer.cli import cli
from ninfer.core.config import REDACTED, ServeConfig, option_flag, serve_options
from ninfer.core.descriptors import SpeculativeBackend
from ninfer.core.errors import ConfigError
from ninfer.core.hookspecs import hookimpl
from ninfer.core.plugins import PluginInfo, PluginManager, load_plugin_manager

SECRET = "sk-test-very-secret"

#: Every serve option with its documented default (derived ones for --max-concurrency 1).
DOCUMENTED_DEFAULTS: dict[str, Any] = {
    "artifact": None,
    "synthetic": None,
    "synthetic_seed": 0,
    "host": "127.0.0.1",
    "port": 8080,
    "header_timeout_ms": 10000,
    "api_key": None,
    "api_key_file": None,
    "model_id": None,
    "max_context": 8192,
    "kv_capacity": 8192,
    "max_concurrency": 1,
    "max_pending_requests": 16,
    "pending_timeout_ms": 30000,
    "prefill_chunk": 1024,
    "log_stats_interval_ms": 5000,
    "log_level": "info",
    "device": 0,
    "context_cost_presets": None,
    "max_request_mib": 384,
    "media_cache_mib": 1024,
    "media_live_mib": 2048,
    "media_preprocess_threads": 0,
    "request_log_jsonl": None,
    "response_store_max_records": 1024,
    "response_store_max_mib": 256,
    "kv_dtype": "bf16",
    "spec": None,
    "draft_tokens": None,
    "lm_head_draft": False,
    "default_max_tokens": 8192,
    "default_thinking_budget": None,
    "vision": False,
    "no_cuda_graph": False,
    "no_prefix_reuse": False,
    "device_state_slots": 1,
    "host_state_slots": 8,
    "host_kv_mib": 8192,
    "max_private_continuations": 2,
    "max_shared_prefixes": 4,
    "max_long_anchors_per_continuation": 2,
    "no_thinking": False,
    "preserve_thinking": False,
    "tolerant_tool_calls": False,
    "hosted_tools": "ignore",
    "strict_effort": False,
    "cors": False,
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "min_p": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "seed": None,
    "greedy": False,
    "dtype": "auto",
    "api_key_source": None,
}

#: One non-default value per option: (arguments, field, expected resolved value).
ACCEPTED = [
    (["--synthetic", "qwen3.6-27b"], "synthetic", "qwen3.6-27b"),
    (["--synthetic", "tiny", "--synthetic-seed", str(2**63 - 1)], "synthetic_seed", 2**63 - 1),
    (["--host", "0.0.0.0"], "host", "0.0.0.0"),
    (["--port", "1"], "port", 1),
    (["--port", "65535"], "port", 65535),
    (["--header-timeout-ms", "1"], "header_timeout_ms", 1),
    (["--header-timeout-ms", "3600000"], "header_timeout_ms", 3600000),
    (["--api-key", SECRET], "api_key", REDACTED),
    (["--model-id", "qwen3.8-27b"], "model_id", "qwen3.8-27b"),
    (["--max-context", "240000"], "max_context", 240000),
    (["--max-context", "1", "--kv-capacity", "1"], "kv_capacity", 1),
    (["--kv-capacity", "auto"], "kv_capacity", "auto"),
    (["--kv-capacity", "8192"], "kv_capacity", 8192),
    (["--max-concurrency", "8"], "max_concurrency", 8),
    (["--max-pending-requests", "0"], "max_pending_requests", 0),
    (["--pending-timeout-ms", "1"], "pending_timeout_ms", 1),
    (["--prefill-chunk", "1"], "prefill_chunk", 1),
    (["--log-stats-interval-ms", "0"], "log_stats_interval_ms", 0),
    (["--log-level", "trace"], "log_level", "trace"),
    (["--log-level", "off"], "log_level", "off"),
    (["--device", "3"], "device", 3),
    (["--max-request-mib", "1"], "max_request_mib", 1),
    (["--media-cache-mib", "0"], "media_cache_mib", 0),
    (["--media-live-mib", "1"], "media_live_mib", 1),
    (["--media-preprocess-threads", "1024"], "media_preprocess_threads", 1024),
    (["--response-store-max-records", "1"], "response_store_max_records", 1),
    (["--response-store-max-mib", "1"], "response_store_max_mib", 1),
    (["--kv-dtype", "fp8"], "kv_dtype", "fp8"),
    (["--kv-dtype", "k8v4"], "kv_dtype", "k8v4"),
    (["--spec", "mtp", "--draft-tokens", "3"], "spec", "mtp"),
    (["--spec", "mtp", "--draft-tokens", "3"], "draft_tokens", 3),
    (["--spec", "mtp", "--draft-tokens", "1", "--lm-head-draft"], "lm_head_draft", True),
    (["--default-max-tokens", "1"], "default_max_tokens", 1),
    (["--default-thinking-budget", "512"], "default_thinking_budget", 512),
    (["--vision"], "vision", True),
    (["--no-cuda-graph"], "no_cuda_graph", True),
    (["--no-prefix-reuse"], "no_prefix_reuse", True),
    (["--device-state-slots", "0"], "device_state_slots", 0),
    (["--host-state-slots", "0"], "host_state_slots", 0),
    (["--host-kv-mib", "0"], "host_kv_mib", 0),
    (["--max-private-continuations", "0"], "max_private_continuations", 0),
    (["--max-shared-prefixes", "0"], "max_shared_prefixes", 0),
    (["--max-long-anchors-per-continuation", "0"], "max_long_anchors_per_continuation", 0),
    (["--no-thinking"], "no_thinking", True),
    (["--preserve-thinking"], "preserve_thinking", True),
    (["--tolerant-tool-calls"], "tolerant_tool_calls", True),
    (["--hosted-tools", "reject"], "hosted_tools", "reject"),
    (["--strict-effort"], "strict_effort", True),
    (["--cors"], "cors", True),
    (["--temperature", "0"], "temperature", 0.0),
    (["--temperature", "2"], "temperature", 2.0),
    (["--top-p", "1"], "top_p", 1.0),
    (["--top-p", "0.001"], "top_p", 0.001),
    (["--top-k", "0"], "top_k", 0),
    (["--top-k", "20"], "top_k", 20),
    (["--min-p", "0"], "min_p", 0.0),
    (["--min-p", "1"], "min_p", 1.0),
    (["--presence-penalty", "-2"], "presence_penalty", -2.0),
    (["--presence-penalty", "2"], "presence_penalty", 2.0),
    (["--frequency-penalty", "-2"], "frequency_penalty", -2.0),
    (["--frequency-penalty", "1.5"], "frequency_penalty", 1.5),
    (["--seed", str(-(2**63))], "seed", -(2**63)),
    (["--seed", str(2**63 - 1)], "seed", 2**63 - 1),
    (["--greedy"], "greedy", True),
    (["--dtype", "float32"], "dtype", "float32"),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
]

#: Documented bad values: (arguments, the flag the one-line error must name).
REJECTED = [
    (["--synthetic", "qwen9"], "--synthetic"),
    (["--synthetic", "tiny", "--synthetic-seed", "-1"], "--synthetic-seed"),
    (["--synthetic", "tiny", "--synthetic-seed", str(2**63)], "--synthetic-seed"),
    (["--host", ""], "--host"),
    (["--port", "0"], "--port"),
    (["--port", "65536"], "--port"),
    (["--port", "http"], "--port"),
    (["--header-timeout-ms", "0"], "--header-timeout-ms"),
    (["--header-timeout-ms", "3600001"], "--header-timeout-ms"),
    (["--api-key", ""], "--api-key"),
    (["--api-key-file", ""], "--api-key-file"),
    (["--model-id", " "], "--model-id"),
    (["--max-context", "0"], "--max-context"),
    (["--kv-capacity", "0"], "--kv-capacity"),
    (["--kv-capacity", "-5"], "--kv-capacity"),
    (["--kv-capacity", "lots"], "--kv-capacity"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--max-concurrency", "9"], "--max-concurrency"),
    (["--max-pending-requests", "-1"], "--max-pending-requests"),
    (["--pending-timeout-ms", "0"], "--pending-timeout-ms"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
    (["--log-stats-interval-ms", "-1"], "--log-stats-interval-ms"),
    (["--log-level", "verbose"], "--log-level"),
    (["--hosted-tools", "drop"], "--hosted-tools"),
    (["--device", "-1"], "--device"),
    (["--max-request-mib", "0"], "--max-request-mib"),
    (["--media-cache-mib", "-1"], "--media-cache-mib"),
    (["--media-live-mib", "0"], "--media-live-mib"),
    (["--media-preprocess-threads", "-1"], "--media-preprocess-threads"),
    (["--media-preprocess-threads", "1025"], "--media-preprocess-threads"),
    (["--response-store-max-records", "0"], "--response-store-max-records"),
    (["--response-store-max-mib", "0"], "--response-store-max-mib"),
    (["--kv-dtype", "fp16"], "--kv-dtype"),
    (["--spec", "eagle", "--draft-tokens", "3"], "--spec"),
    (["--spec", "mtp", "--draft-tokens", "three"], "--draft-tokens"),
    (["--default-max-tokens", "0"], "--default-max-tokens"),
    (["--default-thinking-budget", "0"], "--default-thinking-budget"),
    (["--device-state-slots", "-1"], "--device-state-slots"),
    (["--host-state-slots", "-1"], "--host-state-slots"),
    (["--host-kv-mib", "-1"], "--host-kv-mib"),
    (["--max-private-continuations", "-1"], "--max-private-continuations"),
    (["--max-shared-prefixes", "-1"], "--max-shared-prefixes"),
    (["--max-long-anchors-per-continuation", "-1"], "--max-long-anchors-per-continuation"),
    (["--temperature", "-0.1"], "--temperature"),
    (["--temperature", "2.01"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.01"], "--top-p"),
    (["--top-k", "21"], "--top-k"),
    (["--top-k", "-1"], "--top-k"),
    (["--min-p", "-0.01"], "--min-p"),
    (["--min-p", "1.5"], "--min-p"),
    (["--presence-penalty", "-2.5"], "--presence-penalty"),
    (["--presence-penalty", "2.5"], "--presence-penalty"),
    (["--frequency-penalty", "-2.5"], "--frequency-penalty"),
    (["--frequency-penalty", "2.5"], "--frequency-penalty"),
    (["--seed", str(2**63)], "--seed"),
    (["--seed", str(-(2**63) - 1)], "--seed"),
    (["--dtype", "float8"], "--dtype"),
    (["--vision=yes"], "--vision"),
]


#: The invocations run without a developer's NINFER_API_KEY (None removes it).
NO_KEY_ENV: dict[str, str | None] = {"NINFER_API_KEY": None}


def print_config(*args: str, obj: PluginManager | None = None) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["serve", "--print-config", *args], obj=obj, env=NO_KEY_ENV)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def assert_rejected(args: list[str], flag: str, obj: PluginManager | None = None) -> str:
    """The serve invocation exits 2 with exactly one ``Error:`` line on stderr that names ``flag``."""
    result = CliRunner().invoke(cli, ["serve", "--print-config", *args], obj=obj, env=NO_KEY_ENV)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ") and flag in lines[0], lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def registries():
    return load_plugin_manager(entry_points=False).registries


# -- defaults and accepted values ------------------------------------------------------------------


def test_every_documented_default():
    config = print_config()
    argv = config.pop("argv")
    assert config == DOCUMENTED_DEFAULTS
    assert argv == ["ninfer", "serve", "--print-config"]


def test_tables_cover_every_serve_option():
    options = set(serve_options())
    assert options == set(DOCUMENTED_DEFAULTS) - {"artifact", "api_key_source"}
    files = {"context_cost_presets", "request_log_jsonl", "api_key_file"}  # need real paths: their own tests
    assert {field for _, field, _ in ACCEPTED} == options - files
    switches = {"lm_head_draft", "no_cuda_graph", "no_prefix_reuse", "no_thinking", "preserve_thinking",
                "tolerant_tool_calls", "strict_effort", "cors", "greedy"}
    assert {option_flag(name) for name in options - switches - files} <= {flag for _, flag in REJECTED}


def test_help_lists_every_option_with_its_default():
    result = CliRunner().invoke(cli, ["serve", "--help"], terminal_width=400)
    assert result.exit_code == 0
    help_text = " ".join(result.stdout.split())
    for name in serve_options():
        assert option_flag(name) in help_text
    assert "--print-config" in help_text
    assert "listen port [default: 8080]" in help_text
    assert "[mtp|dflash|dflash2]" in help_text and "[bf16|int8|fp8|nvfp4|k8v4]" in help_text
    assert "[qwen3.6-27b|qwen3.5-9b-shape|tiny|qwen3.6-35b-a3b|tiny-moe]" in help_text


@pytest.mark.parametrize(("args", "field", "expected"), ACCEPTED, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_accepted_value(args, field, expected):
    config = print_config(*args)
    assert config[field] == expected
    assert type(config[field]) is type(expected)


def test_artifact_argument_is_recorded():
    assert print_config("models/x.ninfer")["artifact"] == "models/x.ninfer"


def test_synthetic_excludes_the_artifact_and_owns_its_seed():
    config = print_config("--synthetic", "tiny-moe", "--synthetic-seed", "3")
    assert (config["artifact"], config["synthetic"], config["synthetic_seed"]) == (None, "tiny-moe", 3)
    assert "mutually exclusive" in assert_rejected(["models/x.ninfer", "--synthetic", "tiny"], "--synthetic")
    assert "requires --synthetic" in assert_rejected(["--synthetic-seed", "3"], "--synthetic-seed")
    listed = assert_rejected(["--synthetic", "qwen9"], "--synthetic")
    assert all(name in listed for name in ("qwen3.6-27b", "qwen3.6-35b-a3b", "tiny", "tiny-moe"))


# -- rejected values -------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "flag"), REJECTED, ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_rejected_value(args, flag):
    assert_rejected(args, flag)


def test_context_cost_presets_file(tmp_path):
    presets = tmp_path / "presets.json"
    presets.write_text('{"transfer": {"ns_per_byte": 0.02}}')
    assert print_config("--context-cost-presets", str(presets))["context_cost_presets"] == str(presets)
    assert "no such file" in assert_rejected(["--context-cost-presets", str(tmp_path / "missing.json")],
                                             "--context-cost-presets")
    malformed = tmp_path / "malformed.json"
    malformed.write_text('{"transfer": ')
    assert "malformed JSON" in assert_rejected(["--context-cost-presets", str(malformed)], "--context-cost-presets")
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    assert "JSON object" in assert_rejected(["--context-cost-presets", str(array)], "--context-cost-presets")
    assert "directory" in assert_rejected(["--context-cost-presets", str(tmp_path)], "--context-cost-presets")


def test_request_log_path(tmp_path):
    log = tmp_path / "requests.jsonl"
    assert print_config("--request-log-jsonl", str(log))["request_log_jsonl"] == str(log)
    missing_parent = tmp_path / "nowhere" / "requests.jsonl"
    assert "parent directory" in assert_rejected(["--request-log-jsonl", str(missing_parent)], "--request-log-jsonl")
    assert "directory" in assert_rejected(["--request-log-jsonl", str(tmp_path)], "--request-log-jsonl")
    artifact = tmp_path / "model.ninfer"
    artifact.write_bytes(b"")
    message = assert_rejected([str(artifact), "--request-log-jsonl", str(tmp_path / "." / "model.ninfer")],
                              "--request-log-jsonl")
    assert "artifact" in message


# -- cross-option rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "draft_tokens", "ok"),
    [
        ("mtp", 0, False), ("mtp", 1, True), ("mtp", 5, True), ("mtp", 6, False),
        ("dflash", 0, False), ("dflash", 1, True), ("dflash", 15, True), ("dflash", 16, False),
        ("dflash2", 0, False), ("dflash2", 7, True), ("dflash2", 15, True), ("dflash2", 16, False),
    ],
)
def test_draft_token_range_per_backend(backend, draft_tokens, ok):
    args = ["--spec", backend, "--draft-tokens", str(draft_tokens)]
    if ok:
        config = print_config(*args)
        assert (config["spec"], config["draft_tokens"]) == (backend, draft_tokens)
    else:
        message = assert_rejected(args, "--draft-tokens")
        assert f"--spec {backend}" in message


def test_draft_tokens_requires_spec():
    assert "requires --spec" in assert_rejected(["--draft-tokens", "3"], "--draft-tokens")


def test_spec_requires_draft_tokens():
    assert "requires --draft-tokens" in assert_rejected(["--spec", "mtp"], "--spec")


def test_lm_head_draft_rules():
    assert "requires --spec" in assert_rejected(["--lm-head-draft"], "--lm-head-draft")
    assert "dflash2" in assert_rejected(["--spec", "dflash2", "--draft-tokens", "7", "--lm-head-draft"],
                                        "--lm-head-draft")
    assert print_config("--spec", "dflash", "--draft-tokens", "7", "--lm-head-draft")["lm_head_draft"] is True


@pytest.mark.parametrize(
    "args",
    [
        ["--device-state-slots", "0"],
        ["--host-state-slots", "0"],
        ["--host-state-slots", "8"],  # explicit, even at its default value
        ["--host-kv-mib", "0"],
        ["--max-private-continuations", "0"],
        ["--max-shared-prefixes", "0"],
        ["--max-long-anchors-per-continuation", "0"],
        ["--context-cost-presets", "PRESETS"],
    ],
)
def test_no_prefix_reuse_conflicts_with_each_context_cache_flag(args, tmp_path):
    presets = tmp_path / "presets.json"
    presets.write_text("{}")
    args = [str(presets) if arg == "PRESETS" else arg for arg in args]
    assert print_config(*args)[args[0][2:].replace("-", "_")] is not None  # valid alone
    message = assert_rejected(["--no-prefix-reuse", *args], "--no-prefix-reuse")
    assert args[0] in message


def test_kv_capacity_below_max_context_is_rejected():
    message = assert_rejected(["--max-context", "8192", "--kv-capacity", "4096"], "--kv-capacity")
    assert "--max-context" in message
    assert print_config("--max-context", "4096", "--kv-capacity", "4096")["kv_capacity"] == 4096
    assert print_config("--max-context", "16384")["kv_capacity"] == 16384
    assert print_config("--max-context", "240000", "--kv-capacity", "auto")["kv_capacity"] == "auto"


@pytest.mark.parametrize(("concurrency", "device_slots", "private", "shared"), [(1, 1, 2, 4), (3, 3, 6, 4), (8, 8, 16, 8)])
def test_derived_defaults_follow_max_concurrency(concurrency, device_slots, private, shared):
    config = print_config("--max-concurrency", str(concurrency))
    assert config["device_state_slots"] == device_slots
    assert config["max_private_continuations"] == private
    assert config["max_shared_prefixes"] == shared


def test_explicit_values_override_derived_defaults():
    config = print_config("--max-concurrency", "8", "--device-state-slots", "2", "--max-private-continuations", "5",
                          "--max-shared-prefixes", "1")
    assert (config["device_state_slots"], config["max_private_continuations"], config["max_shared_prefixes"]) == (2, 5, 1)


# -- API key redaction -----------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [["--api-key", SECRET], [f"--api-key={SECRET}"]])
def test_api_key_is_redacted_in_argv_and_print_config(spelling):
    result = CliRunner().invoke(cli, ["serve", *spelling, "--print-config"])
    assert result.exit_code == 0, result.output
    assert SECRET not in result.output
    config = json.loads(result.stdout)
    assert config["api_key"] == REDACTED
    assert REDACTED in " ".join(config["argv"])


def test_build_keeps_the_key_but_redacts_argv_and_repr(registries):
    config = ServeConfig.build(registries, api_key=SECRET, argv=["ninfer", "serve", "--api-key", SECRET, "--cors"])
    assert config.api_key == SECRET
    assert config.argv == ("ninfer", "serve", "--api-key", REDACTED, "--cors")
    assert SECRET not in repr(config)
    assert config.to_dict()["api_key"] == REDACTED and config.to_dict(redact=False)["api_key"] == SECRET


# -- ServeConfig.build directly --------------------------------------------------------------------


def test_build_errors_are_config_errors_naming_the_option(registries):
    with pytest.raises(ConfigError, match=r"^--max-concurrency 9 is out of range") as info:
        ServeConfig.build(registries, max_concurrency=9)
    assert info.value.param == "max_concurrency"
    with pytest.raises(ConfigError, match="--port expects an integer"):
        ServeConfig.build(registries, port="8080")
    with pytest.raises(ConfigError, match="--greedy"):
        ServeConfig.build(registries, greedy="yes")
    with pytest.raises(ConfigError, match="unknown serve option --max-batch"):
        ServeConfig.build(registries, max_batch=4)


def test_build_treats_none_as_not_given(registries):
    config = ServeConfig.build(registries, no_prefix_reuse=True, host_state_slots=None, temperature=None)
    assert config.no_prefix_reuse and config.host_state_slots == 8 and config.temperature is None


class ToyBackendPlugin:
    """A plugin registered at runtime that adds a speculative backend with its own draft range."""

    @hookimpl
    def ninfer_speculative_backends(self):
        return [SpeculativeBackend("toy_spec", 2, 4, "toy.", supports_lm_head_draft=False)]


@pytest.fixture(scope="module")
def toy_manager() -> PluginManager:
    manager = PluginManager()
    manager.load_builtins()
    manager.register(ToyBackendPlugin(), PluginInfo("toy", "toy-dist", "9.9", builtin=False))
    manager.check()
    return manager


def test_spec_choices_include_a_runtime_registered_backend(toy_manager, registries):
    config = ServeConfig.build(toy_manager.registries, spec="toy_spec", draft_tokens=3)
    assert (config.spec, config.draft_tokens) == ("toy_spec", 3)
    with pytest.raises(ConfigError, match=r"--draft-tokens 5 is out of range for --spec toy_spec: expected 2\.\.4"):
        ServeConfig.build(toy_manager.registries, spec="toy_spec", draft_tokens=5)
    with pytest.raises(ConfigError, match="--lm-head-draft cannot be combined with --spec toy_spec"):
        ServeConfig.build(toy_manager.registries, spec="toy_spec", draft_tokens=2, lm_head_draft=True)
    with pytest.raises(ConfigError, match="--spec"):
        ServeConfig.build(registries, spec="toy_spec", draft_tokens=3)


def test_cli_sees_a_runtime_registered_backend(toy_manager):
    help_result = CliRunner().invoke(cli, ["serve", "--help"], obj=toy_manager, terminal_width=400)
    assert "[mtp|dflash|dflash2|toy_spec]" in help_result.stdout
    config = print_config("--spec", "toy_spec", "--draft-tokens", "4", obj=toy_manager)
    assert (config["spec"], config["draft_tokens"]) == ("toy_spec", 4)
    assert "2..4" in assert_rejected(["--spec", "toy_spec", "--draft-tokens", "1"], "--draft-tokens", obj=toy_manager)


# -- the installed console script ------------------------------------------------------------------


def run_console_script(*args: str) -> subprocess.CompletedProcess[str]:
    script = shutil.which("ninfer")
    assert script is not None, "the ninfer console script is not installed (pip install -e .)"
    return subprocess.run([script, *args], capture_output=True, text=True, timeout=120)


def test_console_script_version():
    result = run_console_script("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"ninfer {version('ninfer')}"


def test_console_script_plugins_list_json():
    result = run_console_script("plugins", "list", "--json")
    assert result.returncode == 0, result.stderr
    names = {row["name"] for row in json.loads(result.stdout)}
    assert {"ninfer.plugins.qwen3_5", "ninfer.plugins.speculative", "ninfer.plugins.kv_dtypes"} <= names


def test_console_script_bad_option():
    result = run_console_script("serve", "--max-concurrency", "9")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == ["Error: --max-concurrency 9 is out of range (expected 1..8)"]
