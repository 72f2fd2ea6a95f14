"""The speculative-round benchmark on the CPU with the tiny preset: it drives the real MTP drafter and round, forces
the acceptance it claims, and its report's arithmetic is consistent (including the projection from the published
acceptance profile)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ninfer.bench.engine import bench_command
from ninfer.bench.spec import MTP_PROFILE, SpecRows, build_spec_runtime, format_spec_table, spec_bench
from ninfer.core.errors import ConfigError
from ninfer.plugins.qwen3_5.speculative.mtp_drafter import MTPDrafter

K = 2


@pytest.fixture(scope="module")
def runtime():
    return build_spec_runtime("tiny", device="cpu")


def test_the_synthetic_runtime_carries_an_mtp_layer(runtime):
    assert runtime.mtp is not None and len(runtime.mtp.weights.layers) == 1
    assert runtime.mtp.weights.fc.shape == (64, 128)


def test_expected_tokens_follow_the_published_profile():
    assert MTP_PROFILE.expected_tokens(3) == pytest.approx(1 + 0.94 + 0.86 + 0.77)
    assert MTP_PROFILE.expected_tokens(8) == pytest.approx(1 + 6.17 - 1, abs=0.01)  # the PR's tau of 6.17
    with pytest.raises(ConfigError, match="1..8 draft tokens"):
        MTP_PROFILE.expected_tokens(9)


@pytest.mark.parametrize(("force", "accepted", "advance"), [("zero", 0, 1), ("full", K, K + 1)])
def test_forced_rounds_accept_what_they_claim(runtime, force, accepted, advance):
    prompts = torch.randint(0, runtime.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    rows = SpecRows(runtime, MTPDrafter(runtime, K), prompts, rounds=3)
    try:
        before = [len(seq.tokens) for seq in rows.sequences]
        rows.run_round(force, instrumented=True)
        assert rows.accepted_tokens() == accepted * 2
        assert [len(seq.tokens) - b for seq, b in zip(rows.sequences, before)] == [advance, advance]
        assert all(seq.fed == len(seq.tokens) - 1 for seq in rows.sequences)  # one pending token, as the engine
        assert len(rows.timed_drafter.times) == len(rows.timed_runtime.times) == 1
    finally:
        rows.close()


def test_partial_forcing_and_the_warm_up_cover_every_tail_length(runtime):
    prompts = torch.randint(0, runtime.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    drafter = MTPDrafter(runtime, K)
    rows = SpecRows(runtime, drafter, prompts, rounds=2 * (K + 1) + 2)
    tails = []
    draft = drafter.draft

    def recording_draft(seqs, counts):
        tails.append([drafter._rows[id(seq)].tail.shape[0] for seq in seqs])
        return draft(seqs, counts)

    drafter.draft = recording_draft
    try:
        rows.run_round(1, instrumented=False)
        assert rows.accepted_tokens() == 2  # one draft per row
        rows.warm_shapes()
        assert rows.accepted_tokens() == 2 + 2 * 2 * sum(range(K + 1))
        # after the first round (tail 2: one accepted draft and the pending token) accepting 0, 1, .., K twice and 0
        # once more drafts every tail length 1..K+1 at least twice
        assert [row[0] for row in tails[1:]] == [2, 1, 2, 3, 1, 2, 3] and all(len(set(row)) == 1 for row in tails)
    finally:
        rows.close()


def test_report_fields_and_arithmetic(runtime):
    result = spec_bench(runtime, "tiny", draft_tokens=K, concurrency=(1, 2), context=9, rounds=1, warmup=0,
                        decode_steps=2)
    expected = 1 + 0.94 + 0.86
    assert result["profile"]["expected_tokens_per_round"] == pytest.approx(expected)
    assert (result["spec"], result["draft_tokens"], result["device"]) == ("mtp", K, "cpu")
    for rows in ("1", "2"):
        entry = result["concurrency"][rows]
        plain = entry["plain_step_ms"]
        for force, accepted in (("zero", 0.0), ("full", float(K))):
            part = entry[force]
            assert part["accepted_per_row_round"] == accepted
            assert min(part["draft_ms"], part["verify_ms"], part["round_ms"]) > 0
            assert part["draft_ms"] + part["verify_ms"] + part["forcing_ms"] <= part["instrumented_round_ms"]
            assert entry["round_over_plain"][force] == pytest.approx(part["round_ms"] / plain)
        slower = max(entry["zero"]["round_ms"], entry["full"]["round_ms"])
        assert entry["projected_tok_s"] == pytest.approx(int(rows) * expected / (slower / 1e3))
        assert entry["projected_speedup"] == pytest.approx(entry["projected_tok_s"] * plain / 1e3 / int(rows))
        assert entry["verify_path"] == "eager"  # no CUDA verify runner on the CPU
        assert entry["draft_path"] == "generic"  # nor fused kernels
    table = format_spec_table(result)
    assert "PROJECTED" in table and "94%/86%" in table


def test_cli_runs_the_spec_bench_and_rejects_what_it_cannot_run():
    runner = CliRunner()
    out = runner.invoke(
        bench_command,
        ["--synthetic", "tiny", "--spec", "mtp", "--draft-tokens", "1", "--concurrency", "1", "--prompt-len", "6",
         "--repeats", "1", "--warmup", "0", "--device", "cpu", "--json"],
    )
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert set(data["concurrency"]) == {"1"} and data["context"] == 6 and data["draft_tokens"] == 1
    assert data["rounds"] == 1
    other = runner.invoke(bench_command, ["--synthetic", "tiny", "--spec", "dflash", "--draft-tokens", "2"])
    assert other.exit_code != 0 and "--spec mtp" in other.output
    alone = runner.invoke(bench_command, ["--synthetic", "tiny", "--spec", "mtp"])
    assert alone.exit_code == 2 and "--draft-tokens" in alone.output
    too_many = runner.invoke(bench_command, ["--synthetic", "tiny", "--spec", "mtp", "--draft-tokens", "9"])
    assert too_many.exit_code != 0 and "1..8 draft tokens" in too_many.output
