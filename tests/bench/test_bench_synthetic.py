"""The synthetic benchmark on the CPU with the tiny preset: it runs end to end, its arithmetic is consistent,
ninfer's greedy tokens equal transformers' on the same (shared) fp32 weights, and its overlapped steps feed the same
tokens."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ninfer.bench.engine import bench_command
from ninfer.bench.synthetic import Clock, bench_ninfer_decode, decode_bytes, run_synthetic_bench
from ninfer.core.errors import ConfigError
from ninfer.plugins.qwen3_5.model.config import Qwen35TextConfig
from ninfer.plugins.qwen3_5.model.presets import preset_config, preset_names
from ninfer.plugins.qwen3_5.model.synthetic import random_runtime


def test_presets_parse_with_the_real_shapes():
    assert {"qwen3.6-27b", "qwen3.6-35b-a3b", "tiny"} <= set(preset_names())
    dense = Qwen35TextConfig.from_hf(preset_config("qwen3.6-27b"))
    assert (dense.hidden_size, dense.num_hidden_layers, dense.intermediate_size) == (5120, 64, 17408)
    assert len(dense.full_attention_layers) == 16 and dense.conv_dim == 10240
    moe = Qwen35TextConfig.from_hf(preset_config("qwen3.6-35b-a3b"))
    assert (moe.num_experts, moe.num_experts_per_tok, len(moe.linear_attention_layers)) == (256, 8, 30)
    with pytest.raises(ConfigError, match="unknown synthetic model"):
        preset_config("qwen9")


def test_decode_bytes_counts_kv_state_and_distinct_experts():
    dense = Qwen35TextConfig.from_hf(preset_config("qwen3.6-27b"))
    base = decode_bytes(dense, 10**9, 0, rows=1, context=0)
    state_per_row = 48 * (48 * 128 * 128 * 4 + 10240 * 3 * 2)
    assert base == 10**9 + state_per_row
    assert decode_bytes(dense, 10**9, 0, 1, 100) - base == 100 * 16 * 2 * 4 * 256 * 2  # 64 KiB of KV per token
    moe = Qwen35TextConfig.from_hf(preset_config("qwen3.6-35b-a3b"))
    one = decode_bytes(moe, 256 * 10**6, 256 * 10**6, rows=1, context=0)  # only the experts: 1 MB each
    assert one == pytest.approx(8 * 10**6 + 30 * (32 * 128 * 128 * 4 + 8192 * 3 * 2))


def test_tiny_synthetic_bench_runs_and_agrees_with_transformers():
    lines: list[str] = []
    result = run_synthetic_bench(
        "tiny", concurrency=(1, 2), prompt_len=48, decode_steps=4, decode_context=9, transformers_decode_steps=4,
        prefill_repeats=1, device="cpu", echo=lines.append,
    )
    assert result["device"] == "cpu" and result["dtype"] == "float32"
    for rows in ("1", "2"):
        entry = result["decode"][rows]
        ours = entry["ninfer"]
        assert ours["tok_s"] > 0 and ours["of_roofline"] == pytest.approx(ours["tok_s"] / entry["roofline_tok_s"])
        assert entry["ninfer_over_transformers"] == pytest.approx(ours["tok_s"] / entry["transformers"]["tok_s"])
    assert result["prefill"]["ninfer"]["tok_s"] == pytest.approx(48 / (result["prefill"]["ninfer"]["ttft_ms"] / 1e3))
    agreement = result["greedy_agreement"]
    assert agreement["compared"] == 5 and agreement["matching_prefix"] == 5
    assert "decode rows" in lines[0]


def test_overlapped_benchmark_steps_generate_the_same_tokens():
    """Steps launched on the previous step's device-side ids (the engine's overlapped decode) feed the same tokens."""
    prompts = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))
    tokens = []
    for overlap in (False, True):
        runtime = random_runtime("tiny", device=torch.device("cpu"), dtype=torch.float32)
        elapsed, generated, _ = bench_ninfer_decode(runtime, prompts, 6, Clock(torch.device("cpu")), overlap=overlap)
        assert elapsed > 0 and len(generated) == 1 + 8 + 6 + 1  # the timed steps follow one untimed step
        tokens.append(generated)
    assert tokens[0] == tokens[1]


def test_bench_synthetic_cli_prints_json_and_rejects_bad_concurrency():
    runner = CliRunner()
    out = runner.invoke(
        bench_command,
        ["--synthetic", "tiny", "--concurrency", "1", "--prompt-len", "16", "--no-transformers", "--device", "cpu", "--json"],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert set(data["decode"]) == {"1"} and "transformers" not in data["prefill"]
    bad = runner.invoke(bench_command, ["--synthetic", "tiny", "--concurrency", "one"])
    assert bad.exit_code != 0 and "--concurrency" in bad.output
    unknown = runner.invoke(bench_command, ["--synthetic", "no-such-model", "--device", "cpu"])
    assert unknown.exit_code != 0 and "no-such-model" in unknown.output
    neither = runner.invoke(bench_command, [])
    assert neither.exit_code == 2 and "--synthetic" in neither.output
