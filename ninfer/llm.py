"""The offline Python API: ``LLM(artifact).generate(prompts, SamplingParams(...))``.

Strings are tokenized raw with the artifact's tokenizer (no chat template); token-id lists are used as
given. Every prompt runs through the same resident Engine the server uses: all are submitted (within
the engine's lifetime capacity), then collected in order.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Sequence

import attrs

from ninfer.core.drafting import SpeculativeConfig
from ninfer.core.errors import InvalidRequestError
from ninfer.core.request import SAMPLER_FIELDS, GenerationRequest, SamplingParams
from ninfer.core.runtime import LoadOptions
from ninfer.engine import EngineConfig, RequestHandle, RequestTimings, StopMatch, Usage
from ninfer.server.compose import LoadedModel, load_engine

Prompt = str | Sequence[int]

#: Engine options that differ for offline use: a full batch, room to queue, no pending deadline.
OFFLINE_DEFAULTS: dict[str, Any] = {"max_concurrency": 8, "max_pending_requests": 64, "pending_timeout_ms": None}


@attrs.frozen
class Output:
    """One prompt's result: output token ids (a stop token included), emitted text, why it ended, usage."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str
    usage: Usage
    stop: StopMatch | None
    timings: RequestTimings


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class LLM:
    """A model loaded with its own resident Engine. ``engine_options`` are :class:`EngineConfig` fields."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str | None = None,
        dtype: str = "auto",
        speculative: SpeculativeConfig | None = None,
        **engine_options: Any,
    ) -> None:
        config = EngineConfig(**{**OFFLINE_DEFAULTS, **engine_options})
        self._loaded: LoadedModel = load_engine(
            model,
            config,
            load_options=LoadOptions(device=device or _default_device(), dtype=dtype),
            speculative=speculative,
        )

    @property
    def engine(self) -> Any:
        return self._loaded.engine

    @property
    def tokenizer(self) -> Any:
        return self._loaded.tokenizer

    @property
    def model_id(self) -> str:
        return self._loaded.artifact.manifest.identity.model_id

    def default_sampling(self) -> SamplingParams:
        """Sampler values from the artifact's generation defaults (the rest neutral)."""
        defaults = self._loaded.artifact.manifest.generation_defaults
        fields = {name: defaults[name] for name in SAMPLER_FIELDS if defaults.get(name) is not None}
        return self.engine.resolve_sampling(None, fields)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Output]:
        """Generate for every prompt; one :class:`Output` per prompt, in order."""
        batch = self._token_lists(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or self.default_sampling()] * len(batch)
        else:
            params = list(sampling)
            if len(params) != len(batch):
                raise InvalidRequestError(
                    f"got {len(params)} SamplingParams for {len(batch)} prompts", param="sampling"
                )
        engine = self.engine
        capacity = engine.config.max_concurrency + engine.config.max_pending_requests
        pending: deque[RequestHandle] = deque()
        outputs: list[Output] = []
        submitted = 0
        try:
            while len(outputs) < len(batch):
                while submitted < len(batch) and len(pending) < capacity:
                    request = GenerationRequest(batch[submitted], params[submitted])
                    pending.append(engine.submit(request))
                    submitted += 1
                handle = pending.popleft()
                outcome = handle.result()
                outputs.append(
                    Output(
                        prompt_token_ids=tuple(batch[len(outputs)]),
                        token_ids=outcome.output_token_ids,
                        text=outcome.text,
                        finish_reason=outcome.finish_reason,
                        usage=outcome.usage,
                        stop=outcome.stop,
                        timings=outcome.timings,
                    )
                )
        finally:
            for handle in pending:
                handle.close()
        return outputs

    def _token_lists(self, prompts: Prompt | Sequence[Prompt]) -> list[list[int]]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and all(isinstance(x, int) for x in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        result = []
        for prompt in prompts:  # type: ignore[union-attr]
            if isinstance(prompt, str):
                result.append(self.tokenizer.encode(prompt))
            elif isinstance(prompt, Sequence) and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
                result.append(list(prompt))
            else:
                raise InvalidRequestError(
                    f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}", param="prompts"
                )
        return result

    def close(self) -> None:
        self._loaded.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
