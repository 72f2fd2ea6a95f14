"""The resident Engine: admission, paged KV + StateImage pools, prefix checkpoints, scheduling, sampling.

The engine never knows model specifics: it drives a :class:`ninfer.core.runtime.ModelRuntime` with token
ids and reports committed tokens, text and timings through :class:`RequestHandle`.
"""

from ninfer.core.engine.admission import AdmissionTicket
from ninfer.core.engine.config import EngineConfig
from ninfer.core.engine.engine import THINKING_BUDGET_CODE, Engine, EngineStats
from ninfer.core.engine.handle import RequestHandle
from ninfer.core.engine.memory import MemoryStats
from ninfer.core.engine.request import (
    AdmittedEvent,
    BudgetClose,
    FinishEvent,
    GenerationOutcome,
    GenerationRequest,
    OutputEvent,
    ProgressEvent,
    SamplingParams,
    StopMatch,
    TokensEvent,
    Usage,
)
from ninfer.core.engine.sampler import resolve_sampling
from ninfer.core.engine.speculative import Draft, Drafter, SpeculativeConfig
from ninfer.core.engine.timings import RequestTimings, SpeculativeCounters

__all__ = [
    "AdmittedEvent",
    "AdmissionTicket",
    "BudgetClose",
    "Draft",
    "Drafter",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "FinishEvent",
    "GenerationOutcome",
    "GenerationRequest",
    "MemoryStats",
    "OutputEvent",
    "ProgressEvent",
    "RequestHandle",
    "RequestTimings",
    "SamplingParams",
    "SpeculativeConfig",
    "SpeculativeCounters",
    "StopMatch",
    "THINKING_BUDGET_CODE",
    "TokensEvent",
    "Usage",
    "resolve_sampling",
]
