"""Building a ``ForwardBatch`` from sequences and the tokens each one feeds."""

from __future__ import annotations

from typing import Any, Sequence as Seq

import torch

from ninfer.core.engine.sequence import Sequence
from ninfer.core.runtime import ForwardBatch


def page_table(rows: Seq[Sequence], device: torch.device) -> torch.Tensor:
    """``[R, max_pages]`` int32 page ids of ``rows`` (zero-padded)."""
    width = max(len(seq.pages) for seq in rows)
    table = torch.zeros((len(rows), width), dtype=torch.int32)
    for index, seq in enumerate(rows):
        table[index, : len(seq.pages)] = torch.tensor(seq.pages, dtype=torch.int32)
    return table.to(device)


def text_positions(positions: list[int], device: torch.device) -> torch.Tensor:
    """``[3, T]`` MRoPE ids of text tokens (three equal rows)."""
    return torch.tensor(positions, dtype=torch.int64, device=device).unsqueeze(0).expand(3, -1).contiguous()


def build_batch(
    rows: Seq[Sequence], feeds: Seq[Seq[int]], device: torch.device, logits: str, **flags: Any
) -> ForwardBatch:
    """Each row continues at ``seq.fed`` with its ``feed``; ``flags`` are extra ForwardBatch fields."""
    token_ids: list[int] = []
    positions: list[int] = []
    for seq, feed in zip(rows, feeds):
        token_ids.extend(feed)
        positions.extend(range(seq.fed, seq.fed + len(feed)))
    return ForwardBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=text_positions(positions, device),
        query_lens=[len(feed) for feed in feeds],
        context_lens=[seq.fed for seq in rows],
        page_tables=page_table(rows, device),
        state_slots=torch.tensor([seq.slot for seq in rows], dtype=torch.int64, device=device),
        logits=logits,  # type: ignore[arg-type]
        **flags,
    )
