"""The DFlash drafter: k draft tokens per row from ONE non-causal block forward conditioned on target features.

The engine captures the target's outputs at the drafter's ``target_layer_ids`` for every fed token
(``capture_layers``); :meth:`DFlashDrafter.observe` turns the committed ones into context K/V right away, written
into the drafter's own paged KV at the target's page ids (so a prefix checkpoint's pages carry it too). A sequence is
ready once its context reaches ``seq.fed``; its one unfed committed token then opens the block
``[token, MASK x k]`` at positions ``fed..fed+k`` whose mask slots, through the drafter's norm and the target lm_head,
are the k greedy drafts (one-hot proposals, as the z-lab reference drafts, so T>0 verification stays lossless). The
block's own K/V is never stored, so rollback needs nothing beyond which positions the target committed. Every fed
position is observed, so a checkpoint's pages hold its whole context and the snapshot is just its end.
"""

from __future__ import annotations

from typing import Any
from typing import Sequence as Seq

import torch
import torch.nn.functional as F

from ninfer.core.drafting import Draft, DraftRow, SpeculativeConfig
from ninfer.core.errors import ConfigError
from ninfer.core.runtime import KVCache
from ninfer.plugins.qwen3_5.model.model import WeightLoader
from ninfer.plugins.qwen3_5.model.runtime import Qwen35Runtime
from ninfer.plugins.qwen3_5.speculative.dflash import BlockRow, DFlashModel
from ninfer.plugins.qwen3_5.speculative.draft_head import draft_head


class DFlashDrafter:
    """Drafts with a DFlash companion model; argmax proposals."""

    backend = "dflash"
    resume_rewrites = 0  # a resumer writes context K/V only past the checkpoint

    def __init__(self, runtime: Qwen35Runtime, model: DFlashModel, draft_tokens: int, lm_head_draft: bool = False):
        block = model.config.block_size
        if draft_tokens > block - 1:
            raise ConfigError(
                f"--draft-tokens {draft_tokens} exceeds what this {model.label} drafter's block of {block} proposes "
                f"({block - 1}); use at most {block - 1}",
                param="draft_tokens",
            )
        self.runtime = runtime
        self.model = model
        self.draft_tokens = draft_tokens
        self.capture_layers = model.config.target_layer_ids
        self._head = draft_head(runtime.model, lm_head_draft)
        self._kv: KVCache | None = None
        self._context_end: dict[int, int] = {}  # per sequence: context KV is written for positions [0, end)

    # -- engine hooks ----------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> float:
        return self.model.spec.kv_bytes_per_token()

    def bind(self, num_pages: int, page_size: int) -> list[KVCache]:
        self._kv = KVCache.allocate(self.model.spec, num_pages, page_size)
        return [self._kv]

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runtime.model.logits(hidden)

    def observe(self, seq: DraftRow, start: int, hidden: torch.Tensor) -> None:
        """``hidden`` are the captured target-layer features ``[n, K*H]`` of committed positions from ``start``."""
        assert self._kv is not None, "the DFlash drafter was not bound to the engine's KV pool"
        count = hidden.shape[0]
        if count == 0:
            return
        device = self.runtime.model.device
        positions = torch.arange(start, start + count, dtype=torch.int64, device=device)
        pages = torch.as_tensor(seq.pages, dtype=torch.int64, device=device)
        page_size = self._kv.page_size
        slots = pages[positions // page_size] * page_size + positions % page_size
        self.model.write_context(hidden.detach(), positions, slots, self._kv)
        self._context_end[id(seq)] = start + count

    def ready(self, seq: DraftRow) -> bool:
        return self._context_end.get(id(seq)) == seq.fed

    def forget(self, seq: DraftRow) -> None:
        self._context_end.pop(id(seq), None)

    def snapshot(self, seq: DraftRow) -> int | None:
        """The context end, when it reaches ``seq.fed`` (the pages then carry the context of every fed token)."""
        return seq.fed if self.ready(seq) else None

    def restore(self, seq: DraftRow, snapshot: object) -> None:
        assert snapshot == seq.fed, f"a DFlash snapshot at {snapshot} restored at {seq.fed}"
        self._context_end[id(seq)] = seq.fed

    def draft(self, rows: Seq[DraftRow], counts: Seq[int]) -> list[Draft]:
        tokens = F.linear(self.mask_hidden(rows, counts), self._head).argmax(dim=-1).tolist()
        drafts, offset = [], 0
        for count in counts:
            drafts.append(Draft(tuple(int(token) for token in tokens[offset : offset + count])))
            offset += count
        return drafts

    def mask_hidden(self, rows: Seq[DraftRow], counts: Seq[int]) -> torch.Tensor:
        """Final-normed drafter hidden states ``[sum(counts), H]`` of every row's mask slots, in row order; each
        mask slot predicts the token at its own position."""
        assert self._kv is not None, "the DFlash drafter was not bound to the engine's KV pool"
        mask = self.model.config.mask_token_id
        blocks = [BlockRow((seq.tokens[-1], *([mask] * count)), seq.fed, seq.pages) for seq, count in zip(rows, counts)]
        hidden = self.model.draft_hidden(blocks, self._kv)
        mask_slots: list[int] = []
        block_start = 0
        for count in counts:
            mask_slots.extend(range(block_start + 1, block_start + 1 + count))
            block_start += count + 1
        return hidden[torch.tensor(mask_slots, dtype=torch.int64, device=hidden.device)]


def load_drafter_model(runtime: Any, artifact: Any, model_type: type[DFlashModel]) -> Any:
    """``model_type``'s companion drafter of ``artifact`` over ``runtime``'s target; a clear ConfigError when the
    runtime is not Qwen3.5-family or the artifact carries no such companion."""
    backend = model_type.companion
    if not isinstance(runtime, Qwen35Runtime):
        raise ConfigError(
            f"--spec {backend} needs a Qwen3.5-family runtime, got {type(runtime).__name__}", param="spec"
        )
    target = runtime.model
    model = model_type.load(WeightLoader(artifact, target.dtype, target.device), target)
    if model is None:
        raise ConfigError(
            f"--spec {backend} needs {model_type.label} companion weights ({backend}.*), and "
            f"{artifact.manifest.identity.model_id} carries none; convert with "
            f"`ninfer convert HF_DIR --{backend} DRAFTER_DIR` or omit --spec",
            param="spec",
        )
    return model


def build_dflash_drafter(runtime: Any, artifact: Any, config: SpeculativeConfig) -> DFlashDrafter:
    """``SpeculativeBackend.build_drafter`` for ``--spec dflash``: loads the artifact's ``dflash.*`` companion."""
    model = load_drafter_model(runtime, artifact, DFlashModel)
    return DFlashDrafter(runtime, model, config.draft_tokens, config.lm_head_draft)
