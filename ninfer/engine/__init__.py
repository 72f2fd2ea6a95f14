"""The resident Engine: admission, paged KV + StateImage pools, prefix checkpoints, scheduling, sampling.

The engine never knows model specifics: it drives a :class:`ninfer.core.runtime.ModelRuntime` with token
ids and reports committed tokens, text and timings through :class:`RequestHandle`. The request it executes
(:class:`ninfer.core.request.GenerationRequest`) is a core contract; this package exports what the engine returns:
the request's events and outcome, and the stats records the server's observability reads (``Engine.stats()``,
the host-work totals and their phase names). Code outside the engine imports only this package, never its modules.
"""

from ninfer.engine.admission import AdmissionTicket
from ninfer.engine.config import EngineConfig
from ninfer.engine.context_cost import ContextCost, resolve_context_cost
from ninfer.engine.engine import Engine, EngineStats
from ninfer.engine.events import (
    AdmittedEvent,
    EngineEvent,
    FinishEvent,
    GenerationOutcome,
    Materialization,
    ProgressEvent,
    StopMatch,
    TokensEvent,
    Usage,
)
from ninfer.engine.handle import RequestHandle
from ninfer.engine.host_cache import HostTierCounters, SelectionCounters
from ninfer.engine.host_work import CLASS_NAMES, DETAIL_NAMES, HOST_PHASES, PHASE_NAMES, HostPhase, HostWorkTotals
from ninfer.engine.memory import MemoryStats
from ninfer.engine.round_harness import RoundHarness, decoding_sequence
from ninfer.engine.sampler import greedy_token_ids
from ninfer.engine.timings import HostExposure, RequestTimings, SpeculativeCounters

__all__ = [
    "CLASS_NAMES",
    "DETAIL_NAMES",
    "HOST_PHASES",
    "PHASE_NAMES",
    "HostExposure",
    "HostPhase",
    "HostTierCounters",
    "HostWorkTotals",
    "AdmissionTicket",
    "AdmittedEvent",
    "ContextCost",
    "Engine",
    "EngineConfig",
    "EngineEvent",
    "EngineStats",
    "FinishEvent",
    "GenerationOutcome",
    "Materialization",
    "MemoryStats",
    "ProgressEvent",
    "RequestHandle",
    "RequestTimings",
    "RoundHarness",
    "SelectionCounters",
    "SpeculativeCounters",
    "StopMatch",
    "TokensEvent",
    "Usage",
    "decoding_sequence",
    "greedy_token_ids",
    "resolve_context_cost",
]
