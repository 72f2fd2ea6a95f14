"""Building a ``ForwardBatch`` from sequences and the tokens each one feeds.

The engine's batches hold host (CPU) tensors: building them costs no device transfer, and the runtime moves them
in the way that suits it (the Qwen decode path stages every field in one pinned buffer and copies it in a single
asynchronous transfer; its eager path moves them once).
"""

from __future__ import annotations

from typing import Any
from typing import Sequence as Seq

import torch

from ninfer.core.runtime import ForwardBatch, page_table, text_positions
from ninfer.engine.sequence import Sequence


def build_batch(rows: Seq[Sequence], feeds: Seq[Seq[int]], logits: str, **flags: Any) -> ForwardBatch:
    """Host tensors where each row continues at ``seq.fed`` with its ``feed``; ``flags`` are extra ForwardBatch
    fields."""
    token_ids: list[int] = []
    positions: list[int] = []
    for seq, feed in zip(rows, feeds):
        token_ids.extend(feed)
        positions.extend(range(seq.fed, seq.fed + len(feed)))
    return ForwardBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=text_positions(positions),
        query_lens=[len(feed) for feed in feeds],
        context_lens=[seq.fed for seq in rows],
        page_tables=page_table(rows),
        state_slots=torch.tensor([seq.slot for seq in rows], dtype=torch.int64),
        logits=logits,  # type: ignore[arg-type]
        **flags,
    )


def build_ahead_batch(
    rows: Seq[Sequence], token_ids: torch.Tensor, stops: torch.Tensor, greedy_below: int | None = None
) -> ForwardBatch:
    """One token per row, ``token_ids [R]`` (on any device: the runtime copies device fields on the device), at
    position ``len(seq.tokens)``: each row fed the token it is about to commit; ``stops [R, 1 + W]`` on the ids'
    device: whether each row's recurrent state takes it (``ForwardBatch.state_update_stops``); ``greedy_below``:
    ``ForwardBatch.greedy_below``."""
    lengths = [len(seq.tokens) for seq in rows]
    return ForwardBatch(
        token_ids=token_ids,
        positions=text_positions(lengths),
        query_lens=[1] * len(rows),
        context_lens=lengths,
        page_tables=page_table(rows),
        state_slots=torch.tensor([seq.slot for seq in rows], dtype=torch.int64),
        logits="last",
        state_update_stops=stops,
        greedy_below=greedy_below,
    )
