"""The MTP draft of a speculative round on the fused kernels, captured as one CUDA graph per batch shape.

A round's draft for rows that all write a tail of ``q`` positions and draft ``count`` tokens is one chain on the
device: the tail step (``Qwen35MTP.fused_step`` over the q positions of each row; its last position proposes draft 1),
then steps 2..count (one token per row, each feeding the previous draft and the MTP's own output hidden state). The
inputs go over in one staged copy (``DecodeInputs``: the tail's next tokens, the rows' MTP KV lengths and page
tables) plus one device copy of the tail hidden states into a static buffer; the proposals ``[R, count]`` come back in
one transfer. The first draft of a shape (rows, q, count, page-table width bucket) runs eagerly and warms every
kernel; it is captured right after and replayed from then on. With graphs disabled the same kernels run eagerly.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ninfer.core.runtime import ForwardBatch, KVCache
from ninfer.kernels.triton import next_power_of_2
from ninfer.plugins.qwen3_5.decode_graph import MIN_PAGE_BUCKET, DecodeGraphRunner, DecodeInputs
from ninfer.plugins.qwen3_5.mtp import Qwen35MTP


@attrs.define
class CapturedDraft:
    """One captured draft chain: its graph, static inputs (``hidden``: the tail hidden states) and proposals."""

    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs
    hidden: torch.Tensor
    proposals: torch.Tensor


class MTPDraftRunner:
    """Drafts uniform batches with ``mtp`` on the kernels of the trunk's decode runner ``decoder``, scoring proposals
    with ``head``; rows of up to ``max_tokens_per_row`` tail positions."""

    def __init__(
        self, mtp: Qwen35MTP, decoder: DecodeGraphRunner, head: torch.Tensor, *, max_tokens_per_row: int
    ) -> None:
        self.mtp = mtp
        self.decoder = decoder
        self.head = head
        self.use_graphs = decoder.use_graphs
        self.max_tokens_per_row = max_tokens_per_row
        self.device = decoder.model.device
        self._graphs: dict[tuple, CapturedDraft] = {}
        self._eager_inputs: dict[tuple[int, int, int], DecodeInputs] = {}
        self._pool: object | None = None

    def supports(self, rows: int, tokens_per_row: int) -> bool:
        return 0 < rows <= self.decoder.max_batch and 1 <= tokens_per_row <= self.max_tokens_per_row

    def draft(self, batch: ForwardBatch, hidden: Sequence[torch.Tensor], kv: KVCache, count: int) -> torch.Tensor:
        """Proposals ``[R, count]`` (int64, on the device) for ``batch``: every row ``q`` tail tokens (the tokens
        following the tail positions) continuing its MTP KV at ``context_lens[r]``; ``hidden`` holds each row's
        ``[q, H]`` tail hidden states on the device. Writes the MTP KV of the tail and of draft positions 1..count-1.

        A replayed graph returns its static proposals buffer: read it before the next draft.
        """
        rows, q = batch.num_rows, batch.query_lens[0]
        if count < 1 or not self.supports(rows, q) or any(n != q for n in batch.query_lens) or len(hidden) != rows:
            raise ValueError(
                f"the MTP draft runner takes 1..{self.max_tokens_per_row} tail tokens in every row, one hidden part "
                f"per row and count >= 1; got {list(batch.query_lens)}, {len(hidden)}, {count}"
            )
        width = max(MIN_PAGE_BUCKET, next_power_of_2(batch.page_tables.shape[1]))
        key = (rows, q, count, width, kv.page_size, kv.key[0].data_ptr(), kv.value[-1].data_ptr())
        captured = self._graphs.get(key) if self.use_graphs else None
        if captured is not None:
            captured.inputs.load(batch)
            torch.cat(list(hidden), out=captured.hidden)
            captured.graph.replay()
            return captured.proposals
        inputs = self._eager_inputs.get((rows, q, width))
        if inputs is None:
            inputs = self._eager_inputs[(rows, q, width)] = DecodeInputs(rows, width, self.device, q=q)
        inputs.load(batch)
        proposals = self.chain(inputs, torch.cat(list(hidden)), kv, count)
        if self.use_graphs:
            self._graphs[key] = self._capture(rows, q, count, width, kv)
        return proposals

    def chain(self, inputs: DecodeInputs, hidden: torch.Tensor, kv: KVCache, count: int) -> torch.Tensor:
        """The tail step and ``count - 1`` chained steps over static ``inputs``: proposals ``[R, count]``."""
        q = inputs.q
        token, out = self.mtp.fused_step(
            self.decoder, inputs.token_ids, hidden, inputs.context_lens, inputs.page_tables, kv, self.head,
            tokens_per_row=q, step=0,
        )
        fed = inputs.context_lens + q  # the position of each row's pending token, the first fed draft's MTP entry
        return self.continue_chain(token, out, fed, inputs.page_tables, kv, count)

    def continue_chain(
        self, first: torch.Tensor, hidden: torch.Tensor, fed: torch.Tensor, page_tables: torch.Tensor, kv: KVCache,
        count: int,
    ) -> torch.Tensor:
        """Proposals ``[R, count]``: each row's draft 1 ``first [R]`` (its MTP hidden state ``hidden [R, H]``), then
        drafts 2..count, one fused step each; ``fed [R]``: the position draft 1 is fed at."""
        proposals = [first]
        for step in range(1, count):  # step s feeds draft s at position fed + s - 1
            first, hidden = self.mtp.fused_step(
                self.decoder, first, hidden, fed + (step - 1), page_tables, kv, self.head, step=step
            )
            proposals.append(first)
        return torch.stack(proposals, dim=1)

    def captured(self) -> list[tuple[int, int, int]]:
        """The (rows, q, count) shapes captured so far."""
        return [key[:3] for key in self._graphs]

    def reset(self) -> None:
        """Drop every captured graph (the drafter's KV was reallocated); their memory pool goes with them."""
        self._graphs.clear()
        self._pool = None

    def _capture(self, rows: int, q: int, count: int, width: int, kv: KVCache) -> CapturedDraft:
        """Record one draft chain over fresh static buffers (capturing executes nothing, so no cache is touched)."""
        inputs = DecodeInputs(rows, width, self.device, q=q)
        config = self.decoder.config
        hidden = torch.zeros((rows * q, config.hidden_size), dtype=self.decoder.model.dtype, device=self.device)
        torch.cuda.synchronize(self.device)  # the eager warm-up draft has finished
        if self._pool is None:  # a pool lives while a graph captured into it does
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            proposals = self.chain(inputs, hidden, kv, count)
        return CapturedDraft(graph=graph, inputs=inputs, hidden=hidden, proposals=proposals)
