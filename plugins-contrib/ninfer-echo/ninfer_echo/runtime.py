"""The echo runtime: one attention layer whose paged K cache holds the token ids themselves.

Each new token's id is written as its K value (float32 represents every vocabulary id exactly), so a row's whole
history lives in the engine-owned pages: prefix reuse, chunked prefill, cancellation and batching behave exactly
as with a real model, and the runtime keeps no per-sequence state. Logits put all probability on the next script
token (:mod:`ninfer_echo.continuation`). The runtime computes nothing worth a GPU and always runs on the CPU.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Mapping

import torch
from ninfer_echo.continuation import Continuation
from ninfer_echo.model import expected_weights

from ninfer.core.artifact.container import TOKENIZER_RESOURCE, ModelSource
from ninfer.core.errors import ArtifactError, ConfigError, NinferError, WeightMismatchError
from ninfer.core.runtime import (
    AttentionLayerSpec,
    CapturedStates,
    ForwardBatch,
    ForwardOutput,
    KVCache,
    LoadOptions,
    RuntimeSpec,
    StateCache,
)
from ninfer.core.tokenizer import Tokenizer

DELAY_ENV = "NINFER_ECHO_DELAY_MS"
#: The logit of every token but the scripted one: finite (so log-probabilities stay JSON numbers) yet far below 0.
REJECTED_LOGIT = -1.0e30
_ACCEPTED_DTYPES = ("auto", "float32")
_EXACT_ID_DTYPES = (torch.float32, torch.float64)


class EchoBatchError(NinferError):
    """A forward batch or cache the echo runtime cannot serve."""

    code = "invalid_forward_batch"


def forward_delay_ms(environ: Mapping[str, str] | None = None) -> float:
    """The per-forward sleep from ``NINFER_ECHO_DELAY_MS`` (0 when unset)."""
    raw = (environ if environ is not None else os.environ).get(DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{DELAY_ENV} must be a non-negative number of milliseconds, got {raw!r}")
    return value


class EchoRuntime:
    """:class:`ninfer.core.runtime.ModelRuntime` of the echo family."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_position_embeddings: int) -> None:
        self.continuation = Continuation(tokenizer)
        self.spec = RuntimeSpec(
            vocab_size=vocab_size,
            hidden_size=1,
            attention_layers=(AttentionLayerSpec(layer_index=0, num_kv_heads=1, head_dim=1),),
            recurrent_layers=(),
            dtype=torch.float32,
            device=torch.device("cpu"),
            max_position_embeddings=max_position_embeddings,
        )

    def forward(self, batch: ForwardBatch, kv: KVCache, state: StateCache) -> ForwardOutput:
        """Store the new token ids in the pages, then score the next token of each requested position."""
        self._check(batch, kv)
        delay = forward_delay_ms()
        if delay:
            time.sleep(delay / 1000.0)
        keys = kv.key[0]
        self._write(batch, keys, kv.page_size)
        states = CapturedStates(conv=[], ssm=[]) if batch.capture_states else None
        if batch.logits == "none":
            return ForwardOutput(logits=None, states=states)
        tokens: list[int] = []
        for row, (start, count) in enumerate(zip(batch.context_lens, batch.query_lens)):
            length = start + count
            history = self._history(batch.page_tables[row], length, keys, kv.page_size)
            scored = (length,) if batch.logits == "last" else range(start + 1, length + 1)
            tokens.extend(self.continuation.next_token(history[:end]) for end in scored)
        logits = torch.empty((len(tokens), self.spec.vocab_size), dtype=torch.float32).fill_(REJECTED_LOGIT)
        logits[torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.int64)] = 0.0
        return ForwardOutput(logits=logits, states=states)

    @staticmethod
    def _write(batch: ForwardBatch, keys: torch.Tensor, page_size: int) -> None:
        query = torch.tensor(list(batch.query_lens), dtype=torch.int64)
        context = torch.tensor(list(batch.context_lens), dtype=torch.int64)
        row = torch.repeat_interleave(torch.arange(query.numel()), query)
        first = torch.cumsum(query, 0) - query
        position = context[row] + torch.arange(row.numel()) - first[row]
        pages = batch.page_tables.to("cpu", torch.int64)[row, position // page_size]
        keys.view(-1)[pages * page_size + position % page_size] = batch.token_ids.to("cpu", keys.dtype)

    @staticmethod
    def _history(page_table: torch.Tensor, length: int, keys: torch.Tensor, page_size: int) -> torch.Tensor:
        pages = page_table[: -(-length // page_size)].to("cpu", torch.int64)
        return keys[pages].reshape(-1)[:length].to(torch.int64)

    def _check(self, batch: ForwardBatch, kv: KVCache) -> None:
        if batch.return_hidden:
            raise EchoBatchError("the echo runtime has no hidden states to return (it cannot drive a drafter)")
        if batch.logits not in ("last", "all", "none"):
            raise EchoBatchError(f"logits must be 'last', 'all' or 'none', got {batch.logits!r}")
        if len(kv.key) != 1 or tuple(kv.key[0].shape[1:]) != (kv.page_size, 1, 1):
            raise EchoBatchError(
                f"the echo runtime needs one KV layer of [pages, {kv.page_size}, 1, 1]; got "
                f"{[tuple(key.shape) for key in kv.key]}"
            )
        if kv.key[0].dtype not in _EXACT_ID_DTYPES or not kv.key[0].is_contiguous():
            raise EchoBatchError(
                f"the echo runtime keeps token ids in its K cache and needs contiguous float32 KV storage; got "
                f"{kv.key[0].dtype} (a quantized --kv-dtype cannot hold them)"
            )
        rows = batch.num_rows
        if rows == 0 or len(batch.context_lens) != rows or batch.page_tables.shape[0] != rows:
            raise EchoBatchError(
                f"a forward batch needs matching rows: {rows} query_lens, {len(batch.context_lens)} context_lens, "
                f"{batch.page_tables.shape[0]} page tables"
            )
        if min(batch.query_lens) < 1 or min(batch.context_lens) < 0 or sum(batch.query_lens) != batch.token_ids.numel():
            raise EchoBatchError(
                f"query_lens {list(batch.query_lens)} must be >= 1 and sum to the {batch.token_ids.numel()} tokens; "
                f"context_lens {list(batch.context_lens)} must be >= 0"
            )
        longest = max(start + count for start, count in zip(batch.context_lens, batch.query_lens))
        if -(-longest // kv.page_size) > batch.page_tables.shape[1]:
            raise EchoBatchError(f"page tables of {batch.page_tables.shape[1]} pages cannot hold {longest} tokens")
        if batch.token_ids.numel() and (
            int(batch.token_ids.min()) < 0 or int(batch.token_ids.max()) >= self.spec.vocab_size
        ):
            raise EchoBatchError(f"token ids must be in [0, {self.spec.vocab_size})")


def load_runtime(artifact: ModelSource, options: LoadOptions) -> EchoRuntime:
    """Check the artifact and options and build the runtime (``options.device`` is accepted; it runs on the CPU)."""
    if options.dtype not in _ACCEPTED_DTYPES:
        raise ConfigError(
            f"the echo model keeps token ids in float32 and cannot run in {options.dtype}; use --dtype auto or float32",
            param="dtype",
        )
    try:
        torch.device(options.device)
    except RuntimeError as exc:
        raise ConfigError(f"invalid device {options.device!r}: {exc}", param="device") from None
    forward_delay_ms()  # a malformed delay fails at startup, not in the first forward
    config = artifact.manifest.config
    _check_weights(artifact, config)
    vocab_size = _positive_int(config, "vocab_size", artifact)
    tokenizer = Tokenizer.from_json(artifact.resource_text(TOKENIZER_RESOURCE))
    if tokenizer.vocab_size > vocab_size:
        raise ArtifactError(
            f"{artifact.path}: the tokenizer has {tokenizer.vocab_size} ids, more than the config's vocab_size "
            f"{vocab_size}"
        )
    return EchoRuntime(tokenizer, vocab_size, _positive_int(config, "max_position_embeddings", artifact))


def _positive_int(config: Mapping[str, Any], key: str, artifact: ModelSource) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArtifactError(f"{artifact.path}: config {key} must be a positive integer, got {value!r}")
    return value


def _check_weights(artifact: ModelSource, config: Mapping[str, Any]) -> None:
    expected = expected_weights(config)
    present = set(artifact.tensor_names)
    missing, unexpected = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or unexpected:
        raise WeightMismatchError(
            f"{artifact.path}: not an echo artifact: missing tensors {missing}, unexpected tensors {unexpected}"
        )
    for name, shape in expected.items():
        actual = tuple(artifact.tensor_info(name).shape)
        if actual != shape:
            raise WeightMismatchError(f"{artifact.path}: tensor {name!r} has shape {actual}, expected {shape}")
