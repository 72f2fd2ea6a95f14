"""Speculative drafters resume right after a prefix-checkpoint hit (MTP, DFlash, DFlash2).

A request whose prompt ends exactly at a checkpoint (a repeated prompt, or a follow-up whose prompt is the previous
prompt plus its fed output) restores the drafter's snapshot with the checkpoint and drafts from its first decode
round. Oracles: plain (non-speculative) greedy decoding for outputs and the continuations the drafts are steered to;
the drafts the same drafter made after a cold prefill of the same prompt for the restored drafter state; the
engine's page reference counts for where MTP rewrites the checkpoint's last entry.

Drafts are steered to the plain continuation (the real drafts are still made and recorded), so every round accepts
all of its drafts and the only fallback steps are those of a drafter that is not ready.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.engine.pages import PagePool, SlotPool
from ninfer.engine.prefix_cache import PrefixCache
from ninfer.core.drafting import Draft
from ninfer.core.plugins import load_plugin_manager
from ninfer.core.runtime import StateCache
from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
from speculation_support import assert_idle, drafter_for, make_engine, open_tiny

BACKENDS = ("mtp", "dflash", "dflash2")
PAGE_SIZE = 16
DRAFT_TOKENS = 3
PROMPT = [random.Random(5).randrange(200, 150_000) for _ in range(2 * PAGE_SIZE)]  # ends on a page boundary
SHORT_PROMPT = PROMPT[:21]  # ends inside a page
FIRST, LONGER, FOLLOW_UP = 17, 25, 8  # output lengths; PROMPT + 17 outputs - 1 unfed = 48 tokens, a page boundary


@pytest.fixture(scope="module")
def registries():
    return load_plugin_manager(entry_points=False).registries


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, registries):
    options = TinyOptions(family="qwen3_5", seed=0, mtp=True, dflash=True, dflash2=True)
    path = write_tiny_artifact(tmp_path_factory.mktemp("drafter-ckpt") / "tiny.ninfer", options, registries)
    yield from open_tiny(path, registries)


def greedy(prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), SamplingParams(temperature=0.0, max_tokens=max_tokens))


class Plain:
    """Plain greedy continuations, computed once per prompt (no drafter, no prefix reuse)."""

    def __init__(self, tiny: Any) -> None:
        self.tiny = tiny
        self.outputs: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt)
        known = self.outputs.get(key, [])
        if len(known) < max_tokens:
            with make_engine(self.tiny, prefix_reuse=False) as engine:
                known = list(engine.submit(greedy(prompt, max_tokens)).result(60).output_token_ids)
            self.outputs[key] = known
        return known[:max_tokens]


@pytest.fixture(scope="module")
def plain(tiny):
    return Plain(tiny)


class Steered:
    """The real drafter (its state decides readiness, its drafts are recorded) proposing the plain continuation.

    ``snapshots`` False makes checkpoints captured meanwhile carry no drafter snapshot (as without speculation).
    ``first_draft_refs`` records, at the first draft of a row whose prompt is exactly a checkpoint, the reference
    count of the page holding the checkpoint's last position.
    """

    def __init__(self, inner: Any, plain: Plain) -> None:
        self.inner = inner
        self.plain = plain
        self.snapshots = True
        self.pages: Any = None  # the engine's PagePool, set once the engine exists
        self.recorded: list[tuple[tuple[int, ...], int, tuple[int, ...]]] = []
        self.first_draft_refs: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def snapshot(self, seq: Any) -> Any:
        return self.inner.snapshot(seq) if self.snapshots else None

    def draft(self, rows: Any, counts: Any) -> list[Draft]:
        made = self.inner.draft(rows, counts)
        drafts = []
        for seq, count, real in zip(rows, counts, made):
            tokens = tuple(seq.tokens)
            self.recorded.append((tokens, count, real.tokens))
            if seq.cache_n == seq.prompt_len == seq.fed:  # the first round after an exact checkpoint hit
                self.first_draft_refs.append(self.pages.ref_count(seq.pages[(seq.cache_n - 1) // PAGE_SIZE]))
            prompt = list(tokens[: seq.prompt_len])
            reference = [*prompt, *self.plain(prompt, seq.max_output)]
            drafts.append(Draft(tuple(reference[len(tokens) : len(tokens) + count])))
        return drafts

    def drafts_after(self, start: int) -> dict[tuple[tuple[int, ...], int], tuple[int, ...]]:
        return {(tokens, count): drafted for tokens, count, drafted in self.recorded[start:]}


def steered_engine(tiny: Any, registries: Any, backend: str, plain: Plain) -> tuple[Any, Steered]:
    drafter = Steered(drafter_for(tiny, registries, backend, DRAFT_TOKENS), plain)
    engine = make_engine(tiny, drafter, max_concurrency=2, device_state_slots=4, page_size=PAGE_SIZE)
    drafter.pages = engine._memory.pages
    return engine, drafter


def submit(engine: Any, prompt: list[int], max_tokens: int) -> Any:
    return engine.submit(greedy(prompt, max_tokens)).result(120)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt", [PROMPT, SHORT_PROMPT], ids=["page-boundary", "mid-page"])
def test_a_prompt_ending_at_a_checkpoint_drafts_from_its_first_round(tiny, registries, plain, backend, prompt):
    output = plain(prompt, FIRST)
    fed_turn = prompt + output[:-1]  # exactly the finished request's checkpoint (its last token was never fed)
    full_turn = prompt + output  # that checkpoint plus one token: a one-token suffix prefill
    engine, drafter = steered_engine(tiny, registries, backend, plain)
    with engine:
        cold = submit(engine, prompt, FIRST)
        cold_drafts = drafter.drafts_after(0)
        repeated_from = len(drafter.recorded)
        repeated = submit(engine, prompt, FIRST)
        repeated_drafts = drafter.drafts_after(repeated_from)
        follow_ups = [submit(engine, turn, FOLLOW_UP) for turn in (fed_turn, full_turn)]
        assert_idle(engine)
    assert cold.cached_tokens == 0 and cold.speculative.fallback_steps == 0
    assert list(cold.output_token_ids) == list(repeated.output_token_ids) == output
    assert repeated.cached_tokens == len(prompt) and repeated.speculative.fallback_steps == 0
    assert repeated.speculative.rounds == cold.speculative.rounds
    assert repeated_drafts == cold_drafts  # the restored drafter state drafts what the cold prefill's state did
    for turn, result in zip((fed_turn, full_turn), follow_ups):
        assert list(result.output_token_ids) == plain(turn, FOLLOW_UP)
        assert result.cached_tokens == len(fed_turn)
        assert result.speculative.fallback_steps == 0 and result.speculative.rounds > 0
    # MTP rewrites the checkpoint's last entry: a resumer never writes it into a page the checkpoint still holds
    if backend == "mtp":
        assert drafter.first_draft_refs == [1, 1]
    elif len(prompt) % PAGE_SIZE == 0:
        assert drafter.first_draft_refs[0] > 1  # DFlash writes past the checkpoint only: full pages stay shared


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_without_a_snapshot_fall_back_and_stay_lossless(tiny, registries, plain, backend):
    """Checkpoints captured with no drafter snapshot restore as before: a fallback step, then drafting. A
    sequence resumed that way has no MTP entry for the checkpoint's last position, so MTP takes no snapshot of it
    later; DFlash's pages carry the context of every fed token, so its later checkpoints resume."""
    longer = plain(PROMPT, LONGER)
    next_turn = PROMPT + longer[:-1]
    engine, drafter = steered_engine(tiny, registries, backend, plain)
    with engine:
        drafter.snapshots = False
        first = submit(engine, PROMPT, FIRST)
        drafter.snapshots = True
        resumed = submit(engine, PROMPT, LONGER)  # its finished checkpoint is next_turn, taken with snapshots on
        after = submit(engine, next_turn, FOLLOW_UP)
        assert_idle(engine)
    assert list(first.output_token_ids) == longer[:FIRST] and first.speculative.fallback_steps == 0
    assert list(resumed.output_token_ids) == longer
    assert resumed.cached_tokens == len(PROMPT) and resumed.speculative.fallback_steps == 1
    assert list(after.output_token_ids) == plain(next_turn, FOLLOW_UP) and after.cached_tokens == len(next_turn)
    assert after.speculative.fallback_steps == (1 if backend == "mtp" else 0)


@pytest.mark.parametrize("capacity", [0, 2])
def test_the_drafter_snapshot_is_taken_only_for_a_kept_checkpoint(capacity):
    pages, slots = PagePool(8), SlotPool(4)
    state = StateCache(conv=[torch.zeros(4, 1, 1)], ssm=[torch.zeros(4, 1, 1, 1)])
    cache = PrefixCache(capacity, 4, pages, slots, state)
    taken: list[int] = []

    def snapshot() -> str:
        taken.append(1)
        return f"snapshot {len(taken)}"

    held = [pages.allocate() for _ in range(2)]
    for _ in range(2):  # the second capture finds an identical checkpoint
        cache.capture(range(6), held, slots.acquire(), torch.zeros(3), take_slot=False, drafter_snapshot=snapshot)
    assert len(taken) == min(capacity, 1)
    if capacity:
        assert cache.lookup(list(range(7))).drafter == "snapshot 1"
