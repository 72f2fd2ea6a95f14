"""The resident Engine: admission, paged KV + StateImage pools, prefix checkpoints, scheduling, sampling.

The engine never knows model specifics: it drives a :class:`ninfer.core.runtime.ModelRuntime` with token
ids and reports committed tokens, text and timings through :class:`RequestHandle`. The request it executes
(:class:`ninfer.core.request.GenerationRequest`) is a core contract; this package exports what the engine returns.
"""

from ninfer.engine.admission import AdmissionTicket
from ninfer.engine.config import EngineConfig
from ninfer.engine.engine import Engine, EngineStats
from ninfer.engine.events import (
    AdmittedEvent,
    EngineEvent,
    FinishEvent,
    GenerationOutcome,
    ProgressEvent,
    StopMatch,
    TokensEvent,
    Usage,
)
from ninfer.engine.handle import RequestHandle
from ninfer.engine.memory import MemoryStats
from ninfer.engine.timings import RequestTimings, SpeculativeCounters

__all__ = [
    "AdmissionTicket",
    "AdmittedEvent",
    "Engine",
    "EngineConfig",
    "EngineEvent",
    "EngineStats",
    "FinishEvent",
    "GenerationOutcome",
    "MemoryStats",
    "ProgressEvent",
    "RequestHandle",
    "RequestTimings",
    "SpeculativeCounters",
    "StopMatch",
    "TokensEvent",
    "Usage",
]
