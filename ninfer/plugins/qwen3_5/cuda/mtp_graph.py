"""The MTP draft of a speculative round on the fused kernels, captured as one CUDA graph per batch shape.

A round's draft for rows that all write a tail of ``q`` positions and draft ``count`` tokens is one chain on the
device: the tail step (``Qwen35MTP.fused_step`` over the q positions of each row; its last position proposes draft 1),
then steps 2..count (one token per row, each feeding the previous draft and the MTP's own output hidden state). The
inputs go over in one staged copy (``DecodeInputs``: the tail's next tokens, the rows' MTP KV lengths and page
tables) plus one device copy of the tail hidden states into a static buffer; the proposals ``[R, count]`` come back in
one transfer. The first draft of a shape (rows, q, count, page-table width bucket) runs eagerly and warms every
kernel; it is captured right after and replayed from then on. With graphs disabled the same kernels run eagerly.

Ragged drafts (``pad_tails``, the default): rows whose tails have different lengths are padded
to the longest (``verify_graph.pad_batch``: each padding token repeats its row's last real tail token, and its hidden
state row is repeated too); ``Qwen35MTP.fused_step`` gives a padding token its row's last real position and KV slot
and an exact copy of that token's projection, so the KV bytes written are the real ones and nothing lands past the
row's tail, and it carries on each row's last *real* token (read at its own index, ``RaggedInputs.last_offsets``).
Rows that draft fewer tokens than the chain's ``count`` drop their extra proposals; their extra chained steps write
scratch MTP entries, which :meth:`MTPDraftRunner.takes` keeps inside the positions the round's verify writes.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from ninfer.core.runtime import ForwardBatch, KVCache
from ninfer.kernels.triton import next_power_of_2
from ninfer.plugins.qwen3_5.cuda.decode_graph import MIN_PAGE_BUCKET, DecodeGraphRunner, DecodeInputs
from ninfer.plugins.qwen3_5.cuda.verify_graph import RaggedInputs, load_ragged, pad_batch
from ninfer.plugins.qwen3_5.speculative.mtp import Qwen35MTP


@attrs.define
class CapturedDraft:
    """One captured draft chain: its graph, static inputs (``hidden``: the tail hidden states; ``ragged``: the rows'
    real tail lengths, for a padded batch) and proposals."""

    graph: torch.cuda.CUDAGraph
    inputs: DecodeInputs
    hidden: torch.Tensor
    proposals: torch.Tensor
    ragged: RaggedInputs | None = None


class MTPDraftRunner:
    """Drafts batches with ``mtp`` on the kernels of the trunk's decode runner ``decoder``, scoring proposals with
    ``head``; rows of up to ``max_tokens_per_row`` tail positions. Without ``pad_tails`` every row must have the same
    tail length and draft count; with it, rows of different tail lengths and counts draft in one chain (padded)."""

    def __init__(
        self, mtp: Qwen35MTP, decoder: DecodeGraphRunner, head: torch.Tensor, *, max_tokens_per_row: int,
        pad_tails: bool = True,
    ) -> None:
        self.mtp = mtp
        self.decoder = decoder
        self.head = head
        self.use_graphs = decoder.use_graphs
        self.max_tokens_per_row = max_tokens_per_row
        self.pad_tails = pad_tails
        self.device = decoder.model.device
        self._graphs: dict[tuple, CapturedDraft] = {}
        self._eager_inputs: dict[tuple[int, int, int], DecodeInputs] = {}
        self._ragged_inputs: dict[tuple[int, int], RaggedInputs] = {}
        self._pool: object | None = None

    def supports(self, rows: int, tokens_per_row: int) -> bool:
        return 0 < rows <= self.decoder.max_batch and 1 <= tokens_per_row <= self.max_tokens_per_row

    def takes(self, tails: Sequence[int], counts: Sequence[int]) -> bool:
        """Whether rows with these tail lengths and draft counts draft in one chain (``draft`` with the largest count).

        Without ``pad_tails``: equal tails and counts. With it, any tails (padded) and counts within 2 of the largest
        ``M``: a row of ``c`` drafts, fed at ``f`` (its pending token's position), has its chained steps ``c..M-1``
        write MTP entries at ``f + c - 1 .. f + M - 2``, past its committed MTP KV like every chained entry (rewritten
        before they are read, see ``MTPDrafter``) and, for ``M - 2 <= c``, within ``f .. f + c``: the positions the
        round's verify writes, whose pages the engine holds for the row.
        """
        if not tails or len(tails) != len(counts) or min(counts) < 1 or min(tails) < 1:
            return False
        if not self.pad_tails and (len(set(tails)) > 1 or len(set(counts)) > 1):
            return False
        return max(counts) - 2 <= min(counts) and self.supports(len(tails), max(tails))

    def draft(self, batch: ForwardBatch, hidden: Sequence[torch.Tensor], kv: KVCache, count: int) -> torch.Tensor:
        """Proposals ``[R, count]`` (int64, on the device) for ``batch``: row r's ``query_lens[r]`` tail tokens (the
        tokens following the tail positions) continue its MTP KV at ``context_lens[r]``; ``hidden`` holds each row's
        ``[query_lens[r], H]`` tail hidden states on the device. Writes the MTP KV of the tail and of draft positions
        1..count-1. Rows of different tail lengths need ``pad_tails``; a row that asked for fewer drafts reads its
        first ones (``takes`` says which counts may share a chain).

        A replayed graph returns its static proposals buffer: read it before the next draft.
        """
        lens = [int(n) for n in batch.query_lens]
        rows, q = len(lens), max(lens, default=0)
        ragged = min(lens, default=0) != q
        parts_fit = len(hidden) == rows and all(part.shape[0] == n for part, n in zip(hidden, lens))
        if count < 1 or not self.supports(rows, q) or (ragged and not self.pad_tails) or not parts_fit:
            raise ValueError(
                f"the MTP draft runner takes 1..{self.max_tokens_per_row} tail tokens in every row (the same number "
                f"unless pad_tails), one hidden part of that length per row and count >= 1; got {lens}, "
                f"{[part.shape[0] for part in hidden]}, {count}"
            )
        width = max(MIN_PAGE_BUCKET, next_power_of_2(batch.page_tables.shape[1]))
        if ragged:  # padding repeats each row's last real token and its hidden state row
            batch = pad_batch(batch, q, width)
            hidden = [
                part if n == q else torch.cat([part, part[-1:].expand(q - n, -1)]) for part, n in zip(hidden, lens)
            ]
        key = (rows, q, count, width, ragged, kv.page_size, kv.key[0].data_ptr(), kv.value[-1].data_ptr())
        captured = self._graphs.get(key) if self.use_graphs else None
        if captured is not None:
            captured.inputs.load(batch)
            if captured.ragged is not None:
                captured.ragged.load(lens)
            torch.cat(list(hidden), out=captured.hidden)
            captured.graph.replay()
            return captured.proposals
        inputs = self._eager_inputs.get((rows, q, width))
        if inputs is None:
            inputs = self._eager_inputs[(rows, q, width)] = DecodeInputs(rows, width, self.device, q=q)
        inputs.load(batch)
        ragged_inputs = load_ragged(self._ragged_inputs, q, lens, self.device) if ragged else None
        proposals = self.chain(inputs, torch.cat(list(hidden)), kv, count, ragged_inputs)
        if self.use_graphs:
            self._graphs[key] = self._capture(rows, q, count, width, ragged, kv)
        return proposals

    def chain(
        self, inputs: DecodeInputs, hidden: torch.Tensor, kv: KVCache, count: int, ragged: RaggedInputs | None = None
    ) -> torch.Tensor:
        """The tail step and ``count - 1`` chained steps over static ``inputs`` (padded rows of the real lengths in
        ``ragged``): proposals ``[R, count]``."""
        last_offsets = None if ragged is None else ragged.last_offsets
        token, out = self.mtp.fused_step(
            self.decoder, inputs.token_ids, hidden, inputs.context_lens, inputs.page_tables, kv, self.head,
            tokens_per_row=inputs.q, step=0, last_offsets=last_offsets,
        )
        # the position of each row's pending token (after its last real tail token): the first fed draft's MTP entry
        fed = inputs.context_lens + (inputs.q if last_offsets is None else last_offsets + 1)
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

    def captured(self, padded: bool = False) -> list[tuple[int, int, int]]:
        """The (rows, q, count) shapes captured so far: of uniform tails, or (``padded``) of tails padded to q."""
        return [key[:3] for key in self._graphs if key[4] == padded]

    def reset(self) -> None:
        """Drop every captured graph (the drafter's KV was reallocated); their memory pool goes with them."""
        self._graphs.clear()
        self._pool = None

    def _capture(self, rows: int, q: int, count: int, width: int, ragged: bool, kv: KVCache) -> CapturedDraft:
        """Record one draft chain over fresh static buffers (capturing executes nothing, so no cache is touched)."""
        inputs = DecodeInputs(rows, width, self.device, q=q)
        ragged_inputs = RaggedInputs(rows, q, self.device) if ragged else None
        config = self.decoder.config
        hidden = torch.zeros((rows * q, config.hidden_size), dtype=self.decoder.model.dtype, device=self.device)
        torch.cuda.synchronize(self.device)  # the eager warm-up draft has finished
        if self._pool is None:  # a pool lives while a graph captured into it does
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            proposals = self.chain(inputs, hidden, kv, count, ragged_inputs)
        return CapturedDraft(graph=graph, inputs=inputs, hidden=hidden, proposals=proposals, ragged=ragged_inputs)
