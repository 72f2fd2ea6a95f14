"""The MTP drafter: the checkpoint's ``mtp.*`` layer chained k times, with its own paged KV.

MTP position ``p`` combines the trunk's final-normed hidden state at ``p`` with the token at ``p + 1``, so the
drafter's KV lags the trunk by one position. Per sequence it keeps the trunk hidden states of committed
positions whose MTP KV is not written yet (``tail``, covering ``[tail_start, seq.fed)``). A round's first MTP
step writes that tail (its tokens are already committed) and predicts draft 1 from the last position; steps
2..k chain the MTP's own output hidden state with the previous draft, EAGLE-style. Those chained entries sit at
positions the next round rewrites from true trunk hidden states, so rollback is just the trunk's report of which
positions were committed (:meth:`observe`).

The KV uses the engine's page ids (one attention layer, same page count and size): a prefix checkpoint's pages
therefore also carry the MTP KV of its tokens. The checkpoint's last position ``n - 1`` is the exception: its MTP
entry needs token ``n``, which each resumer chooses itself. So a snapshot (:meth:`MTPDrafter.snapshot`) first
writes every earlier tail position, then keeps the trunk hidden state of position ``n - 1``; a resumer restores it
as its tail (ready at once) and writes entry ``n - 1`` into a private copy of that page (``resume_rewrites``).
Only a sequence whose MTP KV is complete from position 0 can vouch for its pages; one restored from a checkpoint
without a snapshot skips entry ``n - 1`` (acceptance may dip, outputs cannot change) and takes no snapshots.

With the trunk's CUDA decode runner a round drafts in one chain on the fused kernels, captured as a CUDA graph per
shape (:mod:`ninfer.plugins.qwen3_5.cuda.mtp_graph`): rows whose tails (1..k+1 positions: a round's pending token plus
its accepted drafts) have different lengths are padded to the longest, and rows that draft fewer tokens (near their
output limit; counts within 2 of the batch's largest, ``MTPDraftRunner.takes``) keep only their own proposals
(``pad_tails``, the default: on the H200 a mixed batch drafts in 3.4–3.5 ms this way against 9.8–17.3 ms with the
tails on the generic path, proposals equal). Other batches, and every batch with ``pad_tails=False``, write their
tails on the generic path and chain the remaining steps on the fused kernels. On the CPU every step is generic.

``lm_head_draft`` drafts with a frequency-ranked reduced vocabulary (:mod:`ninfer.plugins.qwen3_5.speculative.draft_head`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from typing import Sequence as Seq

import attrs
import torch
import torch.nn.functional as F

from ninfer.core.drafting import Draft, DraftRow, SpeculativeConfig
from ninfer.core.errors import ConfigError
from ninfer.core.runtime import ForwardBatch, KVCache, page_table, text_positions
from ninfer.kernels.transfer import to_device
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.speculative.draft_head import draft_head

if TYPE_CHECKING:
    from ninfer.plugins.qwen3_5.cuda.mtp_graph import MTPDraftRunner

#: Tail length above which committed positions are written to the MTP KV right away (long prefills).
_EAGER_WRITE = 64


@attrs.define
class _RowState:
    tail_start: int
    tail: torch.Tensor | None = None  # [n, H] trunk hidden states of positions tail_start..tail_start+n-1
    complete: bool = False  # the MTP KV of every position before tail_start is written in the sequence's pages

    @property
    def end(self) -> int:
        return self.tail_start + (0 if self.tail is None else self.tail.shape[0])


@attrs.frozen
class MTPSnapshot:
    """Resuming at ``position + 1``: the MTP KV of positions before ``position`` is in the checkpoint's pages;
    ``hidden`` ``[1, H]`` is the trunk's final-normed hidden state at ``position``."""

    position: int
    hidden: torch.Tensor


class MTPDrafter:
    """Drafts with ``runtime.mtp``; argmax proposals (one-hot), so T>0 acceptance draws once per token."""

    backend = "mtp"
    capture_layers: tuple[int, ...] = ()
    resume_rewrites = 1  # a resumer writes the MTP entry of the checkpoint's last position

    def __init__(
        self, runtime: Qwen35Runtime, draft_tokens: int, lm_head_draft: bool = False, pad_tails: bool = True
    ) -> None:
        if runtime.mtp is None:
            raise ConfigError(
                "--spec mtp needs the checkpoint's multi-token-prediction weights (mtp.*), and this artifact has "
                "none; convert a checkpoint that ships them or omit --spec",
                param="spec",
            )
        self.runtime = runtime
        self.mtp = runtime.mtp
        self.draft_tokens = draft_tokens
        self._head = draft_head(runtime.model, lm_head_draft)
        self._kv: KVCache | None = None
        self._rows: dict[int, _RowState] = {}
        self._fused: MTPDraftRunner | None = None
        if runtime.decoder is not None:
            from ninfer.plugins.qwen3_5.cuda.mtp_graph import MTPDraftRunner  # here: CPU-only installs lack triton

            # a round's tail is the pending token's position plus the accepted drafts: 1..k+1 positions
            self._fused = MTPDraftRunner(
                self.mtp, runtime.decoder, self._head, max_tokens_per_row=draft_tokens + 1, pad_tails=pad_tails
            )

    @property
    def fused_runner(self) -> "MTPDraftRunner | None":
        """The fused-kernel draft runner (with the trunk's CUDA decode runner), else None."""
        return self._fused

    # -- engine hooks ----------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> float:
        return self.mtp.spec.kv_bytes_per_token()

    def bind(self, num_pages: int, page_size: int) -> list[KVCache]:
        if self._fused is not None:
            self._fused.reset()  # graphs bound to the previous KV
        self._kv = None  # free the previous KV first
        self._kv = KVCache.allocate(self.mtp.spec, num_pages, page_size)
        return [self._kv]

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runtime.model.logits(hidden)

    def observe(self, seq: DraftRow, start: int, hidden: torch.Tensor) -> None:
        state = self._rows.get(id(seq))
        if state is None or state.end != start:
            state = self._rows[id(seq)] = _RowState(start, complete=start == 0)
        hidden = hidden.detach()
        state.tail = hidden.clone() if state.tail is None else torch.cat([state.tail, hidden])
        if state.tail.shape[0] > _EAGER_WRITE:
            self._write_tail([seq], [state], keep_last=True)

    def ready(self, seq: DraftRow) -> bool:
        state = self._rows.get(id(seq))
        return state is not None and state.tail is not None and state.end == seq.fed

    def forget(self, seq: DraftRow) -> None:
        self._rows.pop(id(seq), None)

    def snapshot(self, seq: DraftRow) -> MTPSnapshot | None:
        """Write ``seq``'s tail but its last position into the MTP KV, and keep that position's hidden state."""
        state = self._rows.get(id(seq))
        if state is None or not state.complete or not self.ready(seq):
            return None
        assert state.tail is not None
        if state.tail.shape[0] > 1:
            self._write_tail([seq], [state], keep_last=True)
            assert state.tail is not None
        return MTPSnapshot(state.tail_start, state.tail.clone())

    def restore(self, seq: DraftRow, snapshot: object) -> None:
        assert isinstance(snapshot, MTPSnapshot) and snapshot.position == seq.fed - 1, "foreign MTP snapshot"
        self._rows[id(seq)] = _RowState(snapshot.position, snapshot.hidden, complete=True)

    def draft(self, rows: Seq[DraftRow], counts: Seq[int]) -> list[Draft]:
        states = [self._rows[id(seq)] for seq in rows]
        if self._fused is not None and self._fused.takes([_tail_length(state) for state in states], counts):
            return self._draft_fused(rows, states, counts, self._fused)
        logits, hidden = self._write_tail(rows, states, keep_last=False)
        if self._fused is not None and len(set(counts)) == 1:
            return self._chain_on_device(rows, counts[0], logits.argmax(dim=-1), hidden, self._fused)
        tokens = [[int(token)] for token in logits.argmax(dim=-1).tolist()]
        for step in range(1, max(counts)):
            active = [index for index, count in enumerate(counts) if count > step]
            chained = [rows[index] for index in active]
            positions = [chained_seq.fed + step - 1 for chained_seq in chained]
            logits, out = self._step(
                chained,
                [tokens[index][-1] for index in active],
                hidden[active],
                positions,
                [1] * len(active),
                positions,
                step,
            )
            for row, token in zip(active, logits.argmax(dim=-1).tolist()):
                tokens[row].append(int(token))
            hidden = hidden.clone()
            hidden[active] = out
        return [Draft(tuple(row_tokens[:count])) for row_tokens, count in zip(tokens, counts)]

    def _draft_fused(
        self, rows: Seq[DraftRow], states: Seq[_RowState], counts: Seq[int], runner: "MTPDraftRunner"
    ) -> list[Draft]:
        """Rows the runner ``takes`` in one chain: the whole draft on the fused kernels (one CUDA graph per shape), one
        staged input copy and one transfer of the proposals; each row keeps its first ``counts[i]``."""
        assert self._kv is not None, "the MTP drafter was not bound to the engine's KV pool"
        token_ids: list[int] = []
        positions: list[int] = []
        tails = []
        for seq, state in zip(rows, states):
            assert state.tail is not None
            q = state.tail.shape[0]
            token_ids.extend(seq.tokens[state.tail_start + 1 : state.tail_start + 1 + q])
            positions.extend(range(state.tail_start, state.tail_start + q))
            tails.append(state.tail)
        batch = ForwardBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            positions=text_positions(positions),
            query_lens=[tail.shape[0] for tail in tails],
            context_lens=[state.tail_start for state in states],
            page_tables=page_table(rows),
            state_slots=torch.zeros(len(rows), dtype=torch.int64),  # the MTP keeps no recurrent state
        )
        proposals = runner.draft(batch, tails, self._kv, max(counts)).tolist()
        for state, tail in zip(states, tails):
            state.tail_start += tail.shape[0]
            state.tail = None
        return [Draft(tuple(row[:count])) for row, count in zip(proposals, counts)]

    def _chain_on_device(
        self, rows: Seq[DraftRow], count: int, first: torch.Tensor, hidden: torch.Tensor, runner: "MTPDraftRunner"
    ) -> list[Draft]:
        """Steps 2..count after a first step of mixed tails, for rows that all draft ``count`` tokens, chained on the
        device through the fused kernels; one transfer brings every proposal back at the end."""
        assert self._kv is not None, "the MTP drafter was not bound to the engine's KV pool"
        if count == 1:
            return [Draft((token,)) for token in first.tolist()]
        device = hidden.device
        tables = to_device(page_table(rows), device)
        fed = to_device(torch.tensor([seq.fed for seq in rows], dtype=torch.int64), device)
        proposals = runner.continue_chain(first, hidden, fed, tables, self._kv, count)
        return [Draft(tuple(row)) for row in proposals.tolist()]

    # -- MTP forwards ----------------------------------------------------------------------------------

    def _write_tail(
        self, rows: Seq[DraftRow], states: Seq[_RowState], *, keep_last: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's tail into the MTP KV (all of it, or all but its last position with ``keep_last``).

        Returns the draft-1 logits and MTP hidden state of each row's last written position.
        """
        hiddens, token_ids, positions, lengths, starts = [], [], [], [], []
        for seq, state in zip(rows, states):
            assert state.tail is not None
            count = state.tail.shape[0] - (1 if keep_last else 0)
            hiddens.append(state.tail[:count])
            token_ids.extend(seq.tokens[state.tail_start + 1 : state.tail_start + 1 + count])
            positions.extend(range(state.tail_start, state.tail_start + count))
            lengths.append(count)
            starts.append(state.tail_start)
        logits, hidden = self._step(rows, token_ids, torch.cat(hiddens), positions, lengths, starts, 0)
        for state, count in zip(states, lengths):
            assert state.tail is not None
            rest = state.tail[count:]
            state.tail_start += count
            state.tail = rest if rest.shape[0] > 0 else None
        return logits, hidden

    def _step(
        self,
        rows: Seq[DraftRow],
        token_ids: list[int],
        hidden: torch.Tensor,
        positions: list[int],
        query_lens: list[int],
        context_lens: list[int],
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP forward; returns the proposal logits and MTP hidden state at each row's last query token."""
        assert self._kv is not None, "the MTP drafter was not bound to the engine's KV pool"
        device = self.runtime.model.device
        _, out = self.mtp.forward(
            torch.tensor(token_ids, dtype=torch.int64, device=device),
            hidden,
            text_positions(positions, device),
            query_lens,
            context_lens,
            page_table(rows, device),
            self._kv,
            logits="none",
            step=step,
        )
        last = torch.tensor(query_lens, device=out.device).cumsum(0) - 1
        selected = out[last]
        return F.linear(selected, self._head).float(), selected


def _tail_length(state: _RowState) -> int:
    return 0 if state.tail is None else state.tail.shape[0]


def build_mtp_drafter(runtime: Any, artifact: Any, config: SpeculativeConfig) -> MTPDrafter:
    """``SpeculativeBackend.build_drafter`` for ``--spec mtp``."""
    mtp = getattr(runtime, "mtp", None) if isinstance(runtime, Qwen35Runtime) else None
    if mtp is None:
        raise ConfigError(
            f"--spec mtp needs multi-token-prediction weights (mtp.*), and {artifact.manifest.identity.model_id} "
            "carries none; use an artifact converted with its MTP layer or omit --spec",
            param="spec",
        )
    return MTPDrafter(runtime, config.draft_tokens, config.lm_head_draft)
