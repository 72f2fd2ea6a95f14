"""Shared helpers for the engine tests (no tests here).

``ChecksumRuntime`` implements the runtime contract with exact integer arithmetic: it writes each token
(and its position) into the paged KV the engine hands it, folds tokens into the recurrent state slot, and
derives the next-token logits from everything it reads back through the page table and the slot. Any
paging, sharing, copy, slot or position mistake of the engine changes its outputs, and
:func:`oracle_greedy` computes the correct continuation from the token list alone.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from ninfer.core.runtime import (
    AttentionLayerSpec,
    ForwardBatch,
    ForwardOutput,
    KVCache,
    RecurrentLayerSpec,
    RuntimeSpec,
    StateCache,
)

VOCAB = 97
STATE_MOD = 1009
CONV_WINDOW = 3


def _next_logits(checksum: int, ssm: int, window: Sequence[int]) -> torch.Tensor:
    target = (checksum + 7 * ssm + 3 * sum(window)) % VOCAB
    return -0.5 * (torch.arange(VOCAB, dtype=torch.float32) - target).abs()


def oracle_logits(tokens: Sequence[int]) -> torch.Tensor:
    """The logits ChecksumRuntime must produce after feeding ``tokens`` from an empty state."""
    ssm = 0
    window = [0] * CONV_WINDOW
    checksum = 0
    for position, token in enumerate(tokens):
        ssm = (ssm * 31 + token + 1) % STATE_MOD
        window = [*window[1:], token]
        checksum += (token + 1) * (position + 1)
    return _next_logits(checksum, ssm, window)


def oracle_greedy(prompt: Sequence[int], count: int, stop_ids: Sequence[int] = ()) -> list[int]:
    """Greedy continuation of ``prompt`` (``count`` tokens, or up to and including a stop id)."""
    tokens = list(prompt)
    out: list[int] = []
    for _ in range(count):
        token = int(oracle_logits(tokens).argmax())
        out.append(token)
        tokens.append(token)
        if token in stop_ids:
            break
    return out


class ChecksumRuntime:
    """A model runtime with integer semantics; records the rows of every forward it runs."""

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.spec = RuntimeSpec(
            vocab_size=vocab_size,
            hidden_size=8,
            attention_layers=(AttentionLayerSpec(layer_index=1, num_kv_heads=1, head_dim=2),),
            recurrent_layers=(
                RecurrentLayerSpec(
                    layer_index=0, conv_dim=1, conv_window=CONV_WINDOW, num_value_heads=1, key_head_dim=1, value_head_dim=1
                ),
            ),
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_position_embeddings=1 << 20,
        )
        self.calls: list[tuple[list[int], str]] = []  # (query_lens, logits mode) per forward
        self._lock = threading.Lock()

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        with self._lock:
            self.calls.append((list(batch.query_lens), batch.logits))
        key, value = kv.key[0], kv.value[0]
        conv, ssm = state.conv[0], state.ssm[0]
        page_size = kv.page_size
        tokens = batch.token_ids.tolist()
        positions = batch.positions.tolist()
        assert positions[0] == positions[1] == positions[2], "text rows must carry equal MRoPE position rows"
        offset = 0
        rows_logits = []
        for row, (count, context) in enumerate(zip(batch.query_lens, batch.context_lens)):
            table = batch.page_tables[row].tolist()
            slot = int(batch.state_slots[row])
            for index in range(count):
                token, position = tokens[offset + index], positions[0][offset + index]
                if position != context + index:
                    raise AssertionError(f"row {row}: position {position} but context+index is {context + index}")
                page, slot_in_page = table[position // page_size], position % page_size
                key[page, slot_in_page, 0, 0] = float(token)
                key[page, slot_in_page, 0, 1] = float(position)
                value[page, slot_in_page, 0, 0] = float(token + 1)
                value[page, slot_in_page, 0, 1] = float(position + 1)
                ssm[slot, 0, 0, 0] = float((int(ssm[slot, 0, 0, 0]) * 31 + token + 1) % STATE_MOD)
                conv[slot, 0] = torch.cat([conv[slot, 0, 1:], torch.tensor([float(token)])])
                if batch.logits == "all" or (batch.logits == "last" and index == count - 1):
                    rows_logits.append(self._read_logits(key, value, table, position + 1, page_size, conv[slot, 0], ssm[slot]))
            offset += count
        logits = torch.stack(rows_logits) if rows_logits else None
        return ForwardOutput(logits=logits)

    @staticmethod
    def _read_logits(key, value, table, length, page_size, window, ssm) -> torch.Tensor:
        checksum = 0
        for position in range(length):
            page, at = table[position // page_size], position % page_size
            stored_token, stored_position = int(key[page, at, 0, 0]), int(key[page, at, 0, 1])
            if stored_position != position or int(value[page, at, 0, 0]) != stored_token + 1:
                raise AssertionError(f"KV of position {position} is corrupt (page {page} holds position {stored_position})")
            checksum += (stored_token + 1) * (position + 1)
        return _next_logits(checksum, int(ssm[0, 0, 0]), [int(x) for x in window.tolist()])


class GatedRuntime:
    """Wraps a runtime; each forward needs a permit from :meth:`allow` (no permits: a blocked engine)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.spec = inner.spec
        self._permits = threading.Semaphore(0)
        self._opened = False
        self.started = 0  # forwards that have begun waiting for a permit
        self.finished = 0

    def allow(self, count: int = 1) -> None:
        for _ in range(count):
            self._permits.release()

    def open(self) -> None:
        """Let every forward through from now on."""
        self._opened = True
        self._permits.release()  # wakes the forward waiting now, if any (one at a time: one executor)

    def close(self) -> None:
        """Require permits again (call only while no forward is waiting)."""
        self._opened = False
        while self._permits.acquire(blocking=False):  # drop permits left over from open()
            pass

    def forward(self, batch, kv, state):
        self.started += 1
        if not self._opened and not self._permits.acquire(timeout=30):
            raise TimeoutError("test gate never opened")
        try:
            return self.inner.forward(batch, kv, state)
        finally:
            self.finished += 1


class FailingRuntime:
    """Wraps a runtime; the forward number ``fail_at`` (0-based) raises."""

    def __init__(self, inner, fail_at: int) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.fail_at = fail_at
        self.count = 0

    def forward(self, batch, kv, state):
        self.count += 1
        if self.count - 1 == self.fail_at:
            raise RuntimeError("simulated device fault")
        return self.inner.forward(batch, kv, state)


class LetterTokenizer:
    """A byte-level tokenizer stand-in: id i is the two letters ``AB``-style pair naming it."""

    vocab_size = VOCAB

    @staticmethod
    def text_of(token_id: int) -> str:
        return chr(ord("A") + token_id // 26) + chr(ord("a") + token_id % 26)

    def id_to_bytes(self, token_id: int) -> bytes:
        return self.text_of(token_id).encode()

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.text_of(token) for token in ids)


def wait_for(predicate, timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it is true (state changes made by the executor thread)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def idle(engine) -> bool:
    """Pools back to their idle state: every page and slot free (checkpoints cleared first)."""
    engine.clear_prefix_cache()
    stats = engine.stats()
    memory = stats.memory
    return (
        memory.free_pages == memory.total_pages
        and memory.free_slots == memory.total_slots
        and memory.promised_pages == 0
        and stats.waiting == stats.prefilling == stats.decoding == 0
    )


class RecordingRuntime:
    """Wraps a runtime and records the rows (query lengths) of every forward, and counts the forwards launched
    ahead (those with ``state_update_stops``)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.calls: list[list[int]] = []
        self.ahead = 0

    def forward(self, batch, kv, state):
        self.calls.append(list(batch.query_lens))
        self.ahead += batch.state_update_stops is not None
        return self.inner.forward(batch, kv, state)
