"""Speculative rounds outside the executor: the fixture that benchmarks and tests use to time or inspect them.

The harness assembles what the executor would (greedy decoding sequences with their own slots and pages, the
caches, a :class:`SpeculativeRound`), prefills the prompts the way the executor's drafting prefill does, and then
runs one round per call. Code outside the engine builds rounds only through it.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from ninfer.core.drafting import Drafter
from ninfer.core.errors import ConfigError
from ninfer.core.request import GenerationRequest, SamplingParams
from ninfer.core.runtime import KVCache, ModelRuntime, StateCache
from ninfer.engine.admission import AdmissionController
from ninfer.engine.batching import build_batch
from ninfer.engine.commit import commit_sampled
from ninfer.engine.handle import RequestHandle
from ninfer.engine.host_work import HostWorkClock
from ninfer.engine.sampler import RowSampler
from ninfer.engine.sequence import Sequence
from ninfer.engine.speculative import SpeculativeRound
from ninfer.engine.stops import OutputText
from ninfer.engine.timings import SpeculativeCounters

PAGE_SIZE = 16


def decoding_sequence(index: int, prompt: list[int], max_output: int, slot: int, pages: list[int],
                      runtime: ModelRuntime, draft_tokens: int) -> Sequence:
    """A decoding sequence as the engine keeps one: greedy, no stop tokens, its own slot and pages."""
    params = SamplingParams(temperature=0.0, max_tokens=max_output, ignore_eos=True, seed=index)
    ticket = AdmissionController(1, 0, None).reserve()
    return Sequence(
        request_id=f"bench-{index}",
        request=GenerationRequest(tuple(prompt), params),
        handle=RequestHandle(f"bench-{index}", ticket, lambda: None),
        ticket=ticket,
        sampler=RowSampler(params, index, runtime.spec.vocab_size, runtime.spec.device),
        text=OutputText(None, ()),
        stop_token_ids=frozenset(),
        max_output=max_output,
        tokens=list(prompt),
        prompt_len=len(prompt),
        phase="decoding",
        slot=slot,
        pages=pages,
        speculative=SpeculativeCounters("mtp", draft_tokens),
    )


class RoundHarness:
    """Sequences prefilled with ``prompts`` and decoded by the engine's speculative round.

    ``rounds`` bounds how many rounds (of up to k+1 tokens each) the caches must hold. The round drives
    :meth:`round_parts` of ``runtime`` and ``drafter`` (themselves by default; a benchmark wraps them to time or
    force what they return); the prefill uses the unwrapped ones.
    """

    def __init__(self, runtime: ModelRuntime, drafter: Drafter, prompts: torch.Tensor, rounds: int) -> None:
        count, prompt_len = prompts.shape
        k = drafter.draft_tokens
        max_output = rounds * (k + 1) + k + 2
        pages_per_row = math.ceil((prompt_len + max_output + k + 1) / PAGE_SIZE)
        num_pages = count * pages_per_row
        self.device = runtime.spec.device
        self.kv = KVCache.allocate(runtime.spec, num_pages, PAGE_SIZE)
        self.state = StateCache.allocate(runtime.spec, count)
        drafter.bind(num_pages, PAGE_SIZE)
        self.drafter = drafter
        self.sequences = [
            decoding_sequence(
                row, prompts[row].tolist(), max_output, row,
                list(range(row * pages_per_row, (row + 1) * pages_per_row)), runtime, k,
            )
            for row in range(count)
        ]
        round_runtime, round_drafter = self.round_parts(runtime, drafter)
        self.round = SpeculativeRound(
            round_runtime, round_drafter, self.kv, self.state, self._ensure_pages, None, HostWorkClock(),
        )
        with torch.no_grad():
            for seq in self.sequences:
                self._prefill(runtime, seq)

    def round_parts(self, runtime: ModelRuntime, drafter: Drafter) -> tuple[Any, Any]:
        """The runtime and drafter the round drives."""
        return runtime, drafter

    def _ensure_pages(self, seq: Sequence, tokens: int) -> None:
        if tokens > len(seq.pages) * PAGE_SIZE:
            raise ConfigError(f"the harness sized {len(seq.pages) * PAGE_SIZE} KV tokens per row, {tokens} needed")

    def _prefill(self, runtime: ModelRuntime, seq: Sequence) -> None:
        """The executor's drafting prefill: hidden states of every prompt position to the drafter, first token."""
        batch = build_batch([seq], [seq.tokens], "none", return_hidden=True)
        output = runtime.forward(batch, self.kv, self.state)
        assert output.hidden is not None
        self.drafter.observe(seq, 0, output.hidden)
        seq.fed = seq.prompt_len
        token = int(self.drafter.target_logits(output.hidden[-1:])[0].argmax())
        commit_sampled(seq, token, time.monotonic())

    def run(self) -> bool:
        """One round over every sequence; True when one of them finished (its budget was sized too small)."""
        with torch.no_grad():
            return bool(self.round.run(self.sequences, time.monotonic))

    def accepted_tokens(self) -> int:
        return sum(seq.speculative.accepted_tokens for seq in self.sequences if seq.speculative is not None)

    def close(self) -> None:
        for seq in self.sequences:
            self.drafter.forget(seq)
