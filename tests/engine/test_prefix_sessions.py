"""Session endpoints in the prefix cache: one endpoint per session, demotion, anonymous-first eviction.

Unit tests drive :class:`PrefixCache` over real page/slot pools; the engine tests run requests through the real
Engine on the ChecksumRuntime, whose outputs expose any KV/state mistake (oracle: ``oracle_greedy``), and judge
retention by the exact reused prefix each request reports (``cached_tokens``).
"""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from ninfer.core.request import GenerationRequest, SamplingParams

from ninfer.engine import Engine, EngineConfig
from ninfer.engine.events import ReuseLimit
from ninfer.engine.pages import PagePool, SlotPool
from ninfer.engine.prefix_cache import eviction_victim, PrefixCache
from ninfer.core.request import MAX_SESSION_KEY_CHARS, SessionKey
from ninfer.core.errors import InvalidRequestError
from ninfer.core.runtime import StateCache
from engine_fakes import ChecksumRuntime, LetterTokenizer, idle, oracle_greedy

PAGE = 4
CHAIN, OTHER = "a" * 32, "b" * 32


class Pools:
    """A PrefixCache of ``capacity`` checkpoints over small real pools, plus a way to fake a finished request."""

    def __init__(self, capacity: int, slots: int = 8, pages: int = 64) -> None:
        self.pages = PagePool(pages)
        self.slots = SlotPool(slots)
        state = StateCache(conv=[torch.zeros(slots, 1, 1)], ssm=[torch.zeros(slots, 1, 1, 1)])
        self.cache = PrefixCache(capacity, PAGE, self.pages, self.slots, state)

    def finish(self, tokens: list[int], session: str | None = None) -> bool:
        """Capture ``tokens`` as a finished request does (its slot handed over), then release its pages."""
        pages = [self.pages.allocate() for _ in range(-(-len(tokens) // PAGE))]
        slot = self.slots.acquire()
        kept = self.cache.capture(tokens, pages, slot, torch.zeros(3), take_slot=True, session=session)
        for page in pages:
            self.pages.release(page)
        if not kept:
            self.slots.release(slot)
        return kept

    def held(self) -> list[tuple[int, ...]]:
        return sorted(entry.tokens for entry in self.cache._entries)


def tokens(first: int, count: int = 6) -> list[int]:
    return list(range(first, first + count))


# -- PrefixCache ---------------------------------------------------------------------------------------------------


def test_without_sessions_eviction_is_plain_lru():
    pools = Pools(capacity=2)
    a, b, c = tokens(0), tokens(10), tokens(20)
    assert pools.finish(a) and pools.finish(b)
    assert pools.cache.lookup(a + [99]).tokens == tuple(a)  # a is now the most recently used
    assert pools.finish(c)
    assert pools.held() == [tuple(a), tuple(c)]
    assert pools.cache.evict() and pools.held() == [tuple(c)]
    assert pools.cache.evict() and not pools.cache.evict() and len(pools.cache) == 0
    assert pools.pages.free_count == 64 and pools.slots.free_count == 8


def test_a_new_endpoint_demotes_the_previous_one_to_anonymous():
    pools = Pools(capacity=4)
    turn1 = tokens(0)
    turn2 = turn1 + [50, 51, 52]
    assert pools.finish(turn1, CHAIN)
    assert pools.cache.endpoint(CHAIN).tokens == tuple(turn1)
    assert pools.finish(turn2, CHAIN)
    assert pools.cache.endpoint(CHAIN).tokens == tuple(turn2)
    demoted = pools.cache.lookup(turn1 + [7])
    assert demoted is not None and demoted.tokens == tuple(turn1) and demoted.session is None
    assert [entry.session for entry in pools.cache._entries].count(CHAIN) == 1


def test_anonymous_checkpoints_are_evicted_before_session_endpoints():
    pools = Pools(capacity=3)
    endpoint = tokens(0)
    assert pools.finish(endpoint, CHAIN)  # the least recently used entry from here on
    for first in (10, 20, 30, 40):
        assert pools.finish(tokens(first))
    assert pools.held() == [tuple(endpoint), tuple(tokens(30)), tuple(tokens(40))]
    assert pools.cache.evict() and pools.cache.evict()  # page pressure: anonymous first
    assert pools.held() == [tuple(endpoint)]
    assert pools.cache.evict() and len(pools.cache) == 0  # an endpoint goes only when nothing else is left


def test_sessions_are_bounded_by_capacity_least_recently_used_first():
    pools = Pools(capacity=2)
    first, second, third = tokens(0), tokens(10), tokens(20)
    assert pools.finish(first, CHAIN) and pools.finish(second, OTHER)
    assert pools.cache.lookup(first).tokens == tuple(first)  # CHAIN used more recently than OTHER
    assert pools.finish(third, "c" * 32)
    assert pools.cache.endpoint(OTHER) is None
    assert pools.cache.endpoint(CHAIN).tokens == tuple(first)


def test_an_anonymous_capture_may_take_the_last_slot_from_a_session_but_not_more():
    pools = Pools(capacity=2)
    assert pools.finish(tokens(0), CHAIN) and pools.finish(tokens(10), OTHER)
    assert pools.finish(tokens(20)) and pools.finish(tokens(30))  # the second evicts the first anonymous one
    assert pools.cache.endpoint(CHAIN) is None and pools.cache.endpoint(OTHER).tokens == tuple(tokens(10))
    assert pools.held() == [tuple(tokens(10)), tuple(tokens(30))]


def test_an_identical_capture_promotes_the_existing_checkpoint():
    pools = Pools(capacity=3)
    old, same = tokens(0), tokens(10)
    assert pools.finish(old, CHAIN) and pools.finish(same)  # e.g. a store:false sibling's anonymous checkpoint
    assert not pools.finish(same, CHAIN)  # nothing new is taken
    assert pools.cache.endpoint(CHAIN).tokens == tuple(same) and len(pools.cache) == 2
    assert pools.cache.lookup(old).session is None
    assert pools.slots.free_count == 6


def test_evict_keeps_the_checkpoint_being_restored():
    pools = Pools(capacity=3)
    assert pools.finish(tokens(0), CHAIN) and pools.finish(tokens(10))
    hit = pools.cache.lookup(tokens(10) + [1])
    assert pools.cache.evict(keep=hit)  # the endpoint goes: the only anonymous entry is being restored
    assert pools.held() == [tuple(tokens(10))] and not pools.cache.evict(keep=hit)


def test_a_session_never_makes_a_non_matching_prefix_match():
    pools = Pools(capacity=3)
    short, endpoint = tokens(0, 4), tokens(0, 4) + [60, 61, 62]
    assert pools.finish(short) and pools.finish(endpoint, CHAIN)
    assert pools.cache.lookup(tokens(0, 4) + [60, 99, 98, 97]).tokens == tuple(short)
    assert pools.cache.lookup(tokens(1, 8)) is None
    assert pools.cache.lookup(endpoint + [5]).tokens == tuple(endpoint)


def test_session_key_is_validated():
    assert SessionKey("ab" * 16).may_replace_endpoint
    for bad in ("", "x" * (MAX_SESSION_KEY_CHARS + 1), "has space", "caf\u00e9", 7, None):
        with pytest.raises(InvalidRequestError) as error:
            SessionKey(bad)
        assert error.value.param == "session.key"
    with pytest.raises(InvalidRequestError):
        SessionKey("k", may_replace_endpoint="yes")
    with pytest.raises(InvalidRequestError) as error:
        GenerationRequest([1, 2], session="k")
    assert error.value.param == "session"


# -- through the Engine ------------------------------------------------------------------------------------------


def make_engine() -> Engine:
    config = EngineConfig(max_concurrency=1, device_state_slots=3, max_context=256, page_size=PAGE,
                          prefill_chunk=16, pending_timeout_ms=None)
    return Engine(ChecksumRuntime(), config, tokenizer=LetterTokenizer())


def run(engine: Engine, prompt: list[int], session: SessionKey | None = None, max_tokens: int = 5):
    request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), session=session)
    outcome = engine.submit(request).result(10)
    assert outcome.output_token_ids == tuple(oracle_greedy(prompt, max_tokens))
    return outcome


def anonymous_traffic(engine: Engine, seed: int) -> None:
    """Two unrelated requests: four anonymous captures (prompt end + finish each), more than the 3 slots."""
    rng = random.Random(seed)
    for _ in range(2):
        run(engine, [rng.randrange(97) for _ in range(9)])


def chain_turn(prompt: list[int], outcome, suffix: list[int]) -> list[int]:
    return prompt + list(outcome.output_token_ids) + suffix


@pytest.mark.parametrize("with_sessions", [True, False])
def test_a_chain_endpoint_survives_anonymous_traffic_only_with_a_session(with_sessions):
    engine = make_engine()
    stored = SessionKey(CHAIN) if with_sessions else None
    root_prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    root = run(engine, root_prompt, stored)
    anonymous_traffic(engine, seed=1)
    child_prompt = chain_turn(root_prompt, root, [7, 7, 7])
    child = run(engine, child_prompt, stored)
    covered = len(root_prompt) + root.completion_tokens - 1  # the root's whole fed turn
    assert (child.cached_tokens == covered) is with_sessions
    assert idle(engine)
    engine.shutdown()


def test_a_store_false_child_reads_the_endpoint_but_does_not_replace_it():
    engine = make_engine()
    root_prompt = [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]
    root = run(engine, root_prompt, SessionKey(CHAIN))
    covered = len(root_prompt) + root.completion_tokens - 1
    side = run(engine, chain_turn(root_prompt, root, [11, 12]), SessionKey(CHAIN, may_replace_endpoint=False))
    assert side.cached_tokens == covered
    anonymous_traffic(engine, seed=2)  # evicts the side branch's anonymous checkpoint, not the chain's endpoint
    child = run(engine, chain_turn(root_prompt, root, [13, 14]), SessionKey(CHAIN))
    assert child.cached_tokens == covered
    assert idle(engine)
    engine.shutdown()


def test_a_stored_child_moves_the_endpoint_forward():
    engine = make_engine()
    root_prompt = [1, 4, 1, 4, 2, 1, 3, 5, 6, 2]
    root = run(engine, root_prompt, SessionKey(CHAIN))
    second_prompt = chain_turn(root_prompt, root, [20, 21])
    second = run(engine, second_prompt, SessionKey(CHAIN))
    anonymous_traffic(engine, seed=3)  # the demoted first endpoint is anonymous now and goes
    third = run(engine, chain_turn(second_prompt, second, [22]), SessionKey(CHAIN))
    assert third.cached_tokens == len(second_prompt) + second.completion_tokens - 1
    branch = run(engine, chain_turn(root_prompt, root, [30]), SessionKey(CHAIN))  # forks from the first turn
    assert branch.cached_tokens < len(root_prompt) + root.completion_tokens - 1
    assert idle(engine)
    engine.shutdown()


def test_eviction_takes_superseded_then_cold_then_hit_checkpoints_and_endpoints_last():
    """Within a group the least recently used goes first; the groups order the choice before recency does."""

    @attrs.define
    class Entry:
        name: str
        last_used: int
        hits: int = 0
        superseded: bool = False
        session: str | None = None
        tokens: tuple[int, ...] = ()

    entries = [
        Entry("endpoint", 0, session="s"),
        Entry("hit", 1, hits=2),
        Entry("cold", 5),
        Entry("superseded", 9, hits=1, superseded=True),
        Entry("older cold", 3),
    ]
    order = []
    while entries:
        victim = eviction_victim(entries)
        order.append(victim.name)
        entries.remove(victim)
    assert order == ["superseded", "older cold", "cold", "hit", "endpoint"]


def test_every_outcome_says_why_it_did_not_reuse_more():
    engine = make_engine()
    first = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
    answer = run(engine, first)
    assert answer.reuse_limit == ReuseLimit("no_checkpoint")
    follow_up = run(engine, [*first, *answer.output_token_ids, 50])
    assert follow_up.cached_tokens == len(first) + answer.completion_tokens - 1
    assert follow_up.reuse_limit == ReuseLimit("longest_available")
    # shares the first 7 tokens with the retained checkpoints, which all continue differently: nothing to resume
    edited = run(engine, [*first[:7], 40, 41, 42])
    assert (edited.cached_tokens, edited.reuse_limit) == (0, ReuseLimit("diverged", 7))
    engine.shutdown()
    config = EngineConfig(max_concurrency=1, max_context=256, page_size=PAGE, prefix_reuse=False,
                          pending_timeout_ms=None)
    with Engine(ChecksumRuntime(), config, tokenizer=LetterTokenizer()) as plain:
        assert run(plain, first).reuse_limit == ReuseLimit("disabled")


def anchored(engine: Engine, prompt: list[int], anchors: tuple[int, ...]):
    request = GenerationRequest(prompt, SamplingParams(max_tokens=3, temperature=0.0), anchor_offsets=anchors)
    outcome = engine.submit(request).result(10)
    assert outcome.output_token_ids == tuple(oracle_greedy(prompt, 3))
    return outcome


@pytest.mark.parametrize(("limit", "expected"), [(2, (40, "private_long_anchor")), (1, (0, "root"))])
def test_an_edit_behind_the_recent_frontiers_resumes_from_a_long_anchor(limit, expected):
    """A history edited at token 60 resumes from the anchor at 40; with room for one anchor per conversation only
    the most recent (80) is kept, which the edit passes, so the request starts at root."""
    config = EngineConfig(max_concurrency=1, device_state_slots=6, max_context=256, page_size=PAGE,
                          prefill_chunk=16, pending_timeout_ms=None, max_long_anchors_per_continuation=limit)
    rng = random.Random(7)
    history = [rng.randrange(1, 97) for _ in range(100)]
    with Engine(ChecksumRuntime(), config, tokenizer=LetterTokenizer()) as engine:
        anchored(engine, history, (40, 80))
        edited = anchored(engine, [*history[:60], 96, 95, 94], (40, 80))
        assert (edited.cached_tokens, edited.reuse_path) == expected
        assert engine.stats().memory.selections.long_anchors_dropped == (2 - limit)


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]
CALLED = oracle_greedy(PROMPT, 4)[1]  # a token the answer emits (as a tool-call opener would be)


@pytest.mark.parametrize("hint, survivor", [(None, "endpoint"), ((), "frontier"), ((7,), "frontier"),
                                            ((7, CALLED), "endpoint")],
                         ids=["resent-as-generated", "re-rendered", "no-marker-in-output", "marker-in-output"])
def test_an_endpoint_the_next_prompt_will_not_repeat_is_evicted_before_the_prompts_frontier(hint, survivor):
    """A closed turn that re-renders differently (``endpoint_reuse_tokens`` without a match in the output) keeps
    its endpoint only as a first-to-evict checkpoint, so the response-prologue frontier the next turn needs outlives
    it; an endpoint the client resends as generated is an ordinary (younger) checkpoint and outlives the frontier."""
    engine = Engine(ChecksumRuntime(), EngineConfig(max_concurrency=1, device_state_slots=3, max_context=256,
                                                    page_size=PAGE, prefill_chunk=16, pending_timeout_ms=None))
    prompt = PROMPT
    frontier = len(prompt) - 3  # where the next prompt stops sharing this one (before the response's prologue)
    request = GenerationRequest(prompt, SamplingParams(max_tokens=4, temperature=0.0),
                                continuation_offsets=(frontier,), endpoint_reuse_tokens=hint)
    outcome = engine.submit(request).result(10)
    assert 7 not in outcome.output_token_ids
    cache = engine._memory.cache
    endpoint = len(prompt) + 4 - 1
    assert sorted(len(entry.tokens) for entry in cache.entries) == [frontier, len(prompt), endpoint]
    cache.evict()  # the prompt end (it only serves an exact repeat)
    cache.evict()
    [left] = [len(entry.tokens) for entry in cache.entries]
    assert left == {"endpoint": endpoint, "frontier": frontier}[survivor]
    engine.shutdown()
