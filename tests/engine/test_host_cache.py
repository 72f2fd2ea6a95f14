"""The host tier of the context cache: device-evicted checkpoints move to host memory and are restored at admission.

Unit tests drive :class:`HostCache` over small real caches (oracle: the tensors that were stored, the LRU order and
page-extent arithmetic stated in the brief). Engine tests run requests through the real Engine on the
ChecksumRuntime, whose outputs expose any KV/state copy mistake (oracle: ``oracle_greedy``), and judge reuse by the
exact prefix each request reports (``cached_tokens``); the MTP test compares with plain greedy decoding on a tiny
artifact and checks that the drafter resumes from its first round after a host hit.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_fakes import ChecksumRuntime, idle, oracle_greedy

from ninfer.core.errors import ConfigError
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.core.runtime import KVCache, StateCache
from ninfer.engine import Engine, EngineConfig
from ninfer.engine.context_cost import ContextCost, TransferCost
from ninfer.engine.host_cache import HostCache, HostTierCounters, page_extent_bytes
from ninfer.engine.memory import EngineMemory
from ninfer.engine.pages import pages_for
from ninfer.engine.prefix_cache import Checkpoint
from ninfer.observability.throughput import IntervalCounts, throughput_fields

PAGE = 4


# -- HostCache -----------------------------------------------------------------------------------------------------


class Device:
    """Small device-side caches (Main + one companion) filled with distinct values, and a host tier over them."""

    def __init__(
        self, state_slots: int, budget_pages: int, slots: int = 4, pages: int = 16, rewritten_positions: int = 0
    ) -> None:
        self.state = StateCache(conv=[torch.randn(slots, 3, 2)], ssm=[torch.randn(slots, 2, 2, 2)])
        self.main = KVCache(PAGE, key=[torch.randn(pages, PAGE, 1, 2)], value=[torch.randn(pages, PAGE, 1, 2)])
        self.companion = KVCache(PAGE, key=[torch.randn(pages, PAGE, 2, 2)], value=[torch.randn(pages, PAGE, 2, 2)])
        self.caches = (self.main, self.companion)
        self.extent = page_extent_bytes(self.caches)
        self.state_bytes = sum(t[0].numel() * t.element_size() for t in (*self.state.conv, *self.state.ssm))
        self.host = HostCache(state_slots, budget_pages * self.extent, self.state, PAGE, rewritten_positions)

    def store(
        self, tokens: list[int], pages: list[int], slot: int = 0, session: str | None = None, drafter: object = None
    ) -> bool:
        checkpoint = Checkpoint(tuple(tokens), pages, slot, torch.zeros(3), last_used=0, session=session,
                                drafter=drafter)
        return self.host.store(checkpoint, self.state, self.caches)

    def image(self, pages: list[int], slot: int) -> list[torch.Tensor]:
        """A copy of what a checkpoint on ``pages`` and ``slot`` holds: every cache's KV pages, then its state."""
        kv = [tensor[pages].clone() for cache in self.caches for tensor in (*cache.key, *cache.value)]
        return kv + [tensor[slot].clone() for tensor in (*self.state.conv, *self.state.ssm)]

    def restores_exactly(self, tokens: list[int], expected: list[torch.Tensor], pages: list[int], slot: int) -> bool:
        """Restore the host checkpoint of ``tokens`` into other ``pages`` and ``slot``: bit-equal to ``expected``?"""
        entry = next(entry for entry in self.host.entries if entry.tokens == tuple(tokens))
        self.host.restore(entry, self.state, slot, self.caches, pages)
        return all(torch.equal(a, b) for a, b in zip(self.image(pages, slot), expected, strict=True))

    def longest(self, prompt: list[int], longer_than: int = 0):  # type: ignore[no-untyped-def]
        """The longest matching host checkpoint, marked used (what admission selects when transfers are cheap)."""
        held = self.host.matches(prompt, longer_than)
        if not held:
            return None
        best = max(held, key=lambda entry: len(entry.tokens))
        self.host.touch(best)
        return best

    def held(self) -> list[tuple[int, ...]]:
        return sorted(entry.tokens for entry in self.host._entries)


def tokens(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


def test_a_page_extent_counts_every_layer_of_every_cache():
    device = Device(state_slots=2, budget_pages=4)
    main_page = PAGE * 1 * 2 * 4 * 2  # positions * heads * head_dim * fp32 bytes * (key, value)
    companion_page = PAGE * 2 * 2 * 4 * 2
    assert device.extent == main_page + companion_page


def test_a_stored_checkpoint_restores_its_state_and_kv_exactly():
    device = Device(state_slots=2, budget_pages=4)
    assert device.store(tokens(0, 6), [5, 9, 3], slot=1)  # 6 tokens: only pages 5 and 9 are held
    entry = device.longest(tokens(0, 6) + [42])
    assert entry is not None and entry.num_pages == 2 and entry.kv_bytes == 2 * device.extent
    expected_state = [tensor[1].clone() for tensor in (*device.state.conv, *device.state.ssm)]
    expected_kv = [tensor[[5, 9]].clone() for cache in device.caches for tensor in (*cache.key, *cache.value)]
    for tensor in (*device.state.conv, *device.state.ssm):  # the device copies are gone (slot and pages reused)
        tensor[1].zero_()
    for cache in device.caches:
        for tensor in (*cache.key, *cache.value):
            tensor[[5, 9]] = 0
    device.host.restore(entry, device.state, 2, device.caches, [7, 0])
    restored_state = [tensor[2] for tensor in (*device.state.conv, *device.state.ssm)]
    restored_kv = [tensor[[7, 0]] for cache in device.caches for tensor in (*cache.key, *cache.value)]
    assert all(torch.equal(a, b) for a, b in zip(restored_state, expected_state))
    assert all(torch.equal(a, b) for a, b in zip(restored_kv, expected_kv))
    state_bytes = sum(tensor[0].numel() * tensor.element_size() for tensor in (*device.state.conv, *device.state.ssm))
    assert device.host.counters == HostTierCounters(
        spills=1, hits=1, bytes_to_host=2 * device.extent + state_bytes, bytes_to_device=2 * device.extent + state_bytes
    )


def test_matches_are_the_exact_prefixes_longer_than_the_device_hit():
    device = Device(state_slots=4, budget_pages=8)
    device.store(tokens(0, 4), [0])
    device.store(tokens(0, 8), [0, 1])
    device.store([9] * 12, [2, 3, 4])
    held = lambda prompt, longer_than=0: sorted(len(e.tokens) for e in device.host.matches(prompt, longer_than))
    assert held(tokens(0, 10)) == [4, 8]
    assert held(tokens(0, 8)) == [4, 8]  # a checkpoint equal to the prompt matches
    assert held(tokens(0, 7)) == [4]
    assert held(tokens(0, 10), longer_than=4) == [8]
    assert held(tokens(0, 10), longer_than=8) == []
    assert held(tokens(1, 10)) == []


def test_slots_evict_least_recently_used_anonymous_first_and_endpoints_last():
    device = Device(state_slots=2, budget_pages=16)
    a, b, c, d = tokens(0, 4), tokens(10, 4), tokens(20, 4), tokens(30, 4)
    assert device.store(a, [0], session="chain") and device.store(b, [1])
    assert device.store(c, [2])  # full: b (anonymous) goes although the endpoint a is older
    assert device.held() == [tuple(a), tuple(c)]
    assert device.store(d, [3])  # c is the only anonymous entry
    assert device.held() == [tuple(a), tuple(d)]
    device.longest(a)
    device.store(b, [1], session="other")  # b is an endpoint now: d (anonymous) goes first
    assert device.held() == [tuple(a), tuple(b)]
    device.store(c, [2])  # two endpoints: the least recently used one (a) goes
    assert device.held() == [tuple(b), tuple(c)]
    assert device.host.counters.evictions == 4 and device.host.counters.dropped == 0


def test_the_kv_budget_counts_whole_page_extents():
    device = Device(state_slots=4, budget_pages=3)
    assert device.store(tokens(0, 5), [0, 1])  # 5 tokens: 2 pages (1.25 pages of data)
    assert device.host.used_kv_bytes == 2 * device.extent
    assert device.store(tokens(10, 4), [2])  # exactly fills the budget
    assert device.held() == [tuple(tokens(0, 5)), tuple(tokens(10, 4))]
    assert device.store(tokens(20, 2), [3])  # one more page: the oldest (2 pages) goes although slots are free
    assert device.held() == [tuple(tokens(10, 4)), tuple(tokens(20, 2))]
    assert device.host.used_kv_bytes == 2 * device.extent and device.host.counters.evictions == 1


def test_a_checkpoint_larger_than_the_whole_budget_is_dropped_without_evicting():
    device = Device(state_slots=4, budget_pages=3)
    device.store(tokens(0, 4), [0])
    assert not device.store(tokens(10, 13), [1, 2, 3, 4])  # 4 pages > 3 pages of budget
    assert device.held() == [tuple(tokens(0, 4))]
    assert device.host.counters.dropped == 1 and device.host.counters.evictions == 0


def test_storing_an_identical_checkpoint_keeps_one_copy_and_moves_the_endpoint():
    device = Device(state_slots=4, budget_pages=8)
    device.store(tokens(0, 4), [0], session="chain")
    device.store(tokens(10, 4), [1], session="chain")  # a newer endpoint of the same session
    assert device.longest(tokens(0, 4)).session is None
    assert device.store(tokens(0, 4), [0])
    assert len(device.host) == 2 and device.host.counters.spills == 2


# A conversation's prompt of 3 whole pages; checkpoints of it resumed on the device reference its pages 0-2.
PROMPT = tokens(0, 3 * PAGE)


def sharing_pair(device: Device) -> dict[tuple[int, ...], list[torch.Tensor]]:
    """Store A (the prompt + 2 tokens) and B (the prompt + 5 other tokens); what each held on the device."""
    a, b = PROMPT + [90, 91], PROMPT + tokens(50, 5)
    assert device.store(a, [0, 1, 2, 3], slot=0) and device.store(b, [0, 1, 2, 8, 9], slot=1)
    return {tuple(a): device.image([0, 1, 2, 3], 0), tuple(b): device.image([0, 1, 2, 8, 9], 1)}


def test_a_checkpoint_sharing_a_prefix_copies_only_its_own_pages_and_both_restore_exactly():
    device = Device(state_slots=4, budget_pages=16)
    images = sharing_pair(device)
    copied = (4 + 2) * device.extent  # A's 4 pages, then only B's 2 pages after the shared prompt
    assert device.host.used_kv_bytes == copied
    assert device.host.counters.bytes_to_host == copied + 2 * device.state_bytes
    (a, a_image), (b, b_image) = images.items()
    assert device.restores_exactly(list(a), a_image, [10, 11, 12, 13], slot=2)
    assert device.restores_exactly(list(b), b_image, [14, 15, 4, 5, 6], slot=3)
    assert device.host.counters.bytes_to_device == (4 + 5) * device.extent + 2 * device.state_bytes


@pytest.mark.parametrize("first, kept_pages", [(0, 6), (1, 4)], ids=["sharer-first", "sharing-first"])
def test_removing_a_checkpoint_frees_only_the_pages_no_other_references(first, kept_pages):
    device = Device(state_slots=4, budget_pages=16)
    images = list(sharing_pair(device).items())
    assert device.host.used_kv_bytes == 6 * device.extent
    removed, (survivor, image) = images[first], images[1 - first]
    device.host.remove(next(entry for entry in device.host.entries if entry.tokens == removed[0]))
    # A's pages stay while B references its prompt pages; B's own pages go with B
    assert device.host.used_kv_bytes == kept_pages * device.extent
    targets = [10, 11, 12, 13, 14][: pages_for(len(survivor), PAGE)]
    assert device.restores_exactly(list(survivor), image, targets, slot=2)
    device.host.remove(device.host.entries[0])
    assert device.host.used_kv_bytes == 0


@pytest.mark.parametrize("held_tokens", [PROMPT, PROMPT + tokens(80, 4)], ids=["prefix", "diverging"])
def test_pages_holding_positions_a_resumed_drafter_rewrites_are_copied(held_tokens):
    """MTP's entry for position p depends on token p + 1: at the held checkpoint's end, or where the two diverge,
    the page holding the last common position differs (here: page 4 on the device, not the held page 2)."""
    device = Device(state_slots=4, budget_pages=16, rewritten_positions=1)
    held_pages = [0, 1, 2, 3][: len(held_tokens) // PAGE]
    assert device.store(held_tokens, held_pages, slot=0, drafter="snapshot")
    checkpoint = PROMPT + tokens(50, 5)
    assert device.store(checkpoint, [0, 1, 4, 5, 6], slot=1, drafter="snapshot")
    assert device.host.used_kv_bytes == (len(held_pages) + 3) * device.extent  # 2 pages shared, 3 copied
    assert device.restores_exactly(checkpoint, device.image([0, 1, 4, 5, 6], 1), [8, 9, 10, 11, 12], slot=2)


def test_a_checkpoint_with_a_drafter_snapshot_shares_pages_only_with_one_that_has_a_snapshot():
    """A checkpoint without a snapshot may hold unwritten drafter entries; one with a snapshot vouches for them."""
    device = Device(state_slots=4, budget_pages=16)
    assert device.store(PROMPT, [0, 1, 2], slot=0)
    assert device.store(PROMPT + [7] * PAGE, [0, 1, 2, 3], slot=1, drafter="snapshot")  # copies all 4 pages
    assert device.store(PROMPT + [8] * PAGE, [0, 1, 2, 4], slot=2)  # shares the prompt, copies 1 page
    assert device.host.used_kv_bytes == (3 + 4 + 1) * device.extent


def three_conversations(device: Device) -> list[list[int]]:
    """Three conversations on the prompt, each with a 2-page tail of its own (device pages 3-8), stored in order."""
    conversations = [PROMPT + tokens(100 * (index + 1), 5) for index in range(3)]
    for index, conversation in enumerate(conversations):
        assert device.store(conversation, [0, 1, 2, 3 + 2 * index, 4 + 2 * index], slot=index)
    return conversations


def test_conversations_sharing_a_prompt_fit_where_full_copies_would_not():
    device = Device(state_slots=4, budget_pages=9)  # the prompt once and three tails; two full copies need 10
    conversations = three_conversations(device)
    assert device.held() == sorted(tuple(conversation) for conversation in conversations)
    assert device.host.used_kv_bytes == 9 * device.extent and device.host.counters.evictions == 0


def test_making_room_evicts_until_the_bytes_are_really_free():
    device = Device(state_slots=4, budget_pages=9)
    conversations = three_conversations(device)
    image = device.image([0, 1, 2, 7, 8], 2)
    other = tokens(500, 2 * PAGE)
    assert device.store(other, [9, 10], slot=3)
    # evicting the oldest conversation frees nothing (its pages hold the prompt the others reference); evicting
    # the next frees its tail
    assert device.held() == sorted([tuple(conversations[2]), tuple(other)])
    assert device.host.counters.evictions == 2 and device.host.used_kv_bytes == 9 * device.extent
    assert device.restores_exactly(conversations[2], image, [11, 12, 13, 14, 15], slot=0)


def test_the_pages_a_store_shares_stay_counted_while_it_makes_room():
    """S shares A's prompt pages; making room evicts A (the least recently used) without freeing its pages, so
    the unrelated U goes too, and the tier stays within its budget."""
    device = Device(state_slots=4, budget_pages=7)
    a, s = PROMPT + tokens(100, 5), PROMPT + tokens(200, 5)
    assert device.store(a, [0, 1, 2, 3, 4]) and device.store(tokens(500, 2 * PAGE), [5, 6], slot=1)
    image = device.image([0, 1, 2, 7, 8], 2)
    assert device.store(s, [0, 1, 2, 7, 8], slot=2)
    assert device.held() == [tuple(s)] and device.host.counters.evictions == 2
    assert device.host.used_kv_bytes == 7 * device.extent  # A's 5 pages (3 of them S's) and S's own 2
    assert device.restores_exactly(s, image, [9, 10, 11, 12, 13], slot=3)


def test_a_store_shares_pages_only_when_the_blocks_it_keeps_leave_room_for_the_rest():
    """Sharing one page of A would keep all 5 of A's pages: B (5 pages) is copied whole and A evicted. C shares 4
    of B's pages and copies 1: both fit."""
    device = Device(state_slots=4, budget_pages=6)
    b, c = tokens(0, PAGE) + [99] * 4 * PAGE, tokens(0, PAGE) + [99] * 3 * PAGE + [98] * PAGE
    assert device.store(tokens(0, 5 * PAGE), [0, 1, 2, 3, 4])
    assert device.store(b, [0, 5, 6, 7, 8], slot=1)
    assert device.held() == [tuple(b)] and device.host.used_kv_bytes == 5 * device.extent
    assert device.store(c, [0, 5, 6, 7, 9], slot=2)
    assert device.held() == sorted([tuple(b), tuple(c)]) and device.host.used_kv_bytes == 6 * device.extent
    assert device.host.counters.evictions == 1 and device.host.counters.dropped == 0


@pytest.mark.parametrize("state_slots, budget_pages", [(0, 8), (4, 0)])
def test_either_capacity_zero_disables_the_tier(state_slots, budget_pages):
    device = Device(state_slots=state_slots, budget_pages=budget_pages)
    assert not device.host.enabled
    assert not device.store(tokens(0, 4), [0]) and len(device.host) == 0


def test_the_options_are_validated():
    for name in ("host_state_slots", "host_kv_mib"):
        with pytest.raises(ConfigError) as error:
            EngineConfig(**{name: -1})
        assert error.value.param == name


# -- through the Engine ------------------------------------------------------------------------------------------


def make_engine(host: bool, runtime: ChecksumRuntime | None = None, **options) -> Engine:
    config = dict(
        max_concurrency=1, device_state_slots=1, max_context=256, page_size=PAGE, prefill_chunk=16,
        pending_timeout_ms=None, host_state_slots=4 if host else 0, host_kv_mib=1 if host else 0,
    )
    config.update(options)
    return Engine(runtime or ChecksumRuntime(), EngineConfig(**config))


def run(engine: Engine, prompt: list[int], max_tokens: int = 5):
    request = GenerationRequest(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    outcome = engine.submit(request).result(10)
    assert list(outcome.output_token_ids) == oracle_greedy(prompt, max_tokens)  # cold-run oracle
    return outcome


def conversation(engine: Engine):
    """A's turn, an unrelated B (evicting A's device checkpoint), then A's follow-up; returns (A, follow-up)."""
    rng = random.Random(3)
    a_prompt = [rng.randrange(97) for _ in range(11)]
    a = run(engine, a_prompt)
    run(engine, [rng.randrange(97) for _ in range(9)])
    follow_up = a_prompt + list(a.output_token_ids) + [5, 6, 7]
    return a_prompt, a, run(engine, follow_up)


def host_counters(engine: Engine) -> HostTierCounters:
    return engine.stats().memory.host_tier


@pytest.mark.parametrize("host", [True, False], ids=["host-tier", "control"])
def test_a_conversation_resumes_from_the_host_tier_after_device_eviction(host):
    engine = make_engine(host)
    a_prompt, a, follow_up = conversation(engine)
    covered = len(a_prompt) + a.completion_tokens - 1  # A's whole fed turn (its last token was never fed)
    counters = host_counters(engine)
    if host:
        assert follow_up.cached_tokens == covered
        assert counters.hits == 1 and counters.spills >= 2 and counters.bytes_to_device > 0
    else:
        assert follow_up.cached_tokens == 0
        assert counters == HostTierCounters()
    assert idle(engine) and len(engine._memory.host) == 0  # clearing empties both tiers
    engine.shutdown()


def test_a_prompt_equal_to_a_host_checkpoint_samples_from_its_logits():
    engine = make_engine(True)
    rng = random.Random(8)
    a_prompt = [rng.randrange(97) for _ in range(10)]
    run(engine, a_prompt)  # the prompt-end checkpoint of A moves to host when A's finish checkpoint is captured
    run(engine, [rng.randrange(97) for _ in range(7)])
    again = run(engine, a_prompt)
    assert again.cached_tokens == len(a_prompt)
    assert idle(engine)
    engine.shutdown()


def test_a_host_hit_under_page_pressure_evicts_device_checkpoints_and_stays_exact():
    # 8 pages: B's two device checkpoints hold 4, and the follow-up reserves 6 (18 prompt + 5 output tokens), so
    # its admission must evict (spill) device checkpoints before restoring A's host checkpoint
    engine = make_engine(True, kv_capacity=8 * PAGE, device_state_slots=2)
    a_prompt, a, follow_up = conversation(engine)
    assert follow_up.cached_tokens == len(a_prompt) + a.completion_tokens - 1
    memory = engine.stats().memory
    assert memory.promised_pages == 0 and memory.free_pages + memory.checkpoint_pages == memory.total_pages
    assert idle(engine)
    engine.shutdown()


def test_the_throughput_event_reports_host_tier_deltas():
    engine = make_engine(True)
    _, _, follow_up = conversation(engine)
    stats = engine.stats()
    delta = stats.memory.host_tier.minus(HostTierCounters(spills=1))
    fields = throughput_fields(IntervalCounts(), 1.0, stats, cache_counters=delta, selections=stats.memory.selections)
    context = fields["context_cache"]
    assert context["counters"]["host_tier"]["hits"] == 1
    assert context["counters"]["host_tier"]["spills"] == stats.memory.host_tier.spills - 1
    assert context["occupancy"]["host_checkpoints"] == len(engine._memory.host) > 0
    # three admissions: A and B from root, the follow-up from A's endpoint restored from the host tier
    selections = context["counters"]["selections"]
    assert (selections["root"], selections["private_endpoint"]) == (2, 1)
    assert selections["reused_prompt_tokens"] == follow_up.cached_tokens > 0
    assert context["counters"]["captures"]["completed"] >= 3
    assert context["last_selection"] == {"frontier_tokens": follow_up.cached_tokens}
    engine.shutdown()


def test_prefix_reuse_off_builds_no_host_tier():
    runtime = ChecksumRuntime()
    memory = EngineMemory(runtime.spec, EngineConfig(prefix_reuse=False, host_state_slots=8, host_kv_mib=8,
                                                     max_context=64, page_size=PAGE))
    assert not memory.host.enabled


# -- with speculative decoding (MTP) -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from speculation_support import open_tiny

    from ninfer.core.artifact.tiny import TinyOptions, write_tiny_artifact
    from ninfer.core.plugins import load_plugin_manager

    registries = load_plugin_manager(entry_points=False).registries
    path = write_tiny_artifact(
        tmp_path_factory.mktemp("host-tier") / "tiny.ninfer", TinyOptions(family="qwen3_5", seed=0, mtp=True),
        registries,
    )
    for opened in open_tiny(path, registries):
        yield opened, registries


def test_mtp_drafts_from_the_first_round_after_a_host_hit(tiny):
    from speculation_support import assert_idle, drafter_for
    from speculation_support import make_engine as make_tiny_engine
    from test_drafter_checkpoints import Plain, Steered, greedy

    opened, registries = tiny
    plain = Plain(opened)  # oracle: plain greedy decoding without reuse; drafts are steered to it
    rng = random.Random(11)
    prompt = [rng.randrange(200, 150_000) for _ in range(21)]
    other = [rng.randrange(200, 150_000) for _ in range(13)]
    fed_turn = prompt + plain(prompt, 9)[:-1]  # exactly A's finish checkpoint (its last token was never fed)

    def speculative(**options):
        drafter = Steered(drafter_for(opened, registries, "mtp", 3), plain)
        engine = make_tiny_engine(opened, drafter, max_concurrency=1, device_state_slots=1, page_size=16, **options)
        drafter.pages = engine._memory.pages
        return engine, drafter

    engine, drafter = speculative(prefix_reuse=False)
    with engine:
        cold = engine.submit(greedy(fed_turn, 8)).result(60)
    cold_drafts = drafter.drafts_after(0)
    engine, drafter = speculative(host_state_slots=4, host_kv_mib=64)
    with engine:
        assert list(engine.submit(greedy(prompt, 9)).result(60).output_token_ids) == plain(prompt, 9)
        engine.submit(greedy(other, 4)).result(60)  # evicts A's device checkpoint to the host tier
        start = len(drafter.recorded)
        resumed = engine.submit(greedy(fed_turn, 8)).result(60)
        resumed_drafts = drafter.drafts_after(start)
        assert_idle(engine)
        counters = engine.stats().memory.host_tier
    assert list(resumed.output_token_ids) == list(cold.output_token_ids) == plain(fed_turn, 8)
    assert counters.hits == 1 and resumed.cached_tokens == len(fed_turn)
    assert resumed.speculative.fallback_steps == 0 and resumed.speculative.rounds > 0
    assert resumed_drafts == cold_drafts  # the restored drafter state drafts what a cold prefill's state does


# -- least-work selection --------------------------------------------------------------------------------------------


def test_admission_takes_the_candidate_that_leaves_the_least_work():
    """The follow-up matches two host checkpoints of A (its prompt end and its endpoint). With the generic
    coefficients restoring the longer one is cheapest; with a restore priced above the whole prompt's prefill, root
    is. Both outputs equal the cold oracle (``run`` checks), and the decision reports the ranked cost."""
    cheap = make_engine(True)
    a_prompt, a, follow_up = conversation(cheap)
    decision = follow_up.materialization
    assert follow_up.cached_tokens == len(a_prompt) + a.completion_tokens - 1
    assert decision.evaluated_targets == 3 and decision.projection_work >= 2  # root + A's two host checkpoints
    cost, memory = cheap.config.context_cost, cheap._memory
    kv_bytes = -(-follow_up.cached_tokens // PAGE) * page_extent_bytes((memory.kv,))
    state = sum(t[0].numel() * t.element_size() for t in (*memory.state.conv, *memory.state.ssm))
    tensors = len(memory.state.conv) + len(memory.state.ssm) + 2 * len(memory.kv.key)
    restore = cost.transfer.ns(kv_bytes + state, tensors)
    suffix = follow_up.prompt_tokens - follow_up.cached_tokens
    assert decision.predicted_immediate_ns == round(restore + cost.prefill.ns(follow_up.cached_tokens, suffix))
    assert decision.stop_reason == "no_pressure" and decision.degradation_units == ()
    assert not decision.maximal_root_fallback and not decision.budget_exhausted
    cheap.shutdown()

    costly = ContextCost(transfer=TransferCost(batch_ns=1e12))
    expensive = make_engine(True, context_cost=costly)
    _, _, follow_up = conversation(expensive)
    assert follow_up.cached_tokens == 0 and follow_up.reuse_path == "root"
    assert follow_up.materialization.evaluated_targets == 3
    assert follow_up.materialization.predicted_immediate_ns == round(costly.prefill.ns(0, follow_up.prompt_tokens))
    expensive.shutdown()


def test_making_room_reports_its_degradation_units():
    """A host hit whose reservation needs the device checkpoints' pages moves them to the host tier first."""
    engine = make_engine(True, kv_capacity=8 * PAGE, device_state_slots=2)
    _, _, follow_up = conversation(engine)
    decision = follow_up.materialization
    assert decision.stop_reason == "queue_exhausted"
    assert decision.degradation_units and set(decision.degradation_units) <= {"demote_to_host", "drop_replica"}
    assert decision.predicted_future_loss_ns > 0
    engine.shutdown()
