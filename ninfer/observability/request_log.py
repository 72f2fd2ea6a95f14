"""``--request-log-jsonl``: the machine-readable measurement log (schema ``ninfer_serve_request_log`` v20).

:class:`RequestLogWriter` appends one JSON object per line and flushes every event. The ``*_fields``
builders turn server/request state into event bodies; they read counters and settings only, never prompts,
generated text, request bodies or credentials. Every field is documented in ``docs/request-log.md``.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import threading
import time
import uuid
from typing import Any

import attrs

from ninfer.core.errors import ConfigError, NinferError
from ninfer.engine import HOST_PHASES as HOST_PHASE_ORDER
from ninfer.engine import PHASE_NAMES, HostExposure

SCHEMA = "ninfer_serve_request_log"
SCHEMA_VERSION = 20
HOST_PHASES = tuple(PHASE_NAMES[phase] for phase in HOST_PHASE_ORDER)
SAMPLER_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty")


class RequestLogWriter:
    """Appends events to one JSONL file; thread-safe; request ids are monotonic within this instance.

    A file whose last line is partial (an earlier server killed mid-write) gets a line break first, so this
    instance's records stay whole lines and readers skip only that partial line."""

    def __init__(self, path: str) -> None:
        try:
            self._file = open(path, "a+b")  # noqa: SIM115 -- closed by close()
            if self._file.seek(0, 2) > 0:
                self._file.seek(-1, 2)
                if self._file.read(1) != b"\n":
                    self._file.write(b"\n")
                    self._file.flush()
        except OSError as exc:
            raise ConfigError(
                f"cannot open --request-log-jsonl {path!r}: {exc.strerror or exc}", param="request_log_jsonl"
            ) from None
        self.path = path
        self.server_instance_id = uuid.uuid4().hex
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def next_request_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def write(self, event: str, fields: dict[str, Any]) -> None:
        """Append one event line and flush it."""
        record = {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "event": event,
            "timestamp_unix_ms": int(time.time() * 1000),
            "server_instance_id": self.server_instance_id,
            **fields,
        }
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line.encode("utf-8"))
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


# -- server_start --------------------------------------------------------------------------------------------


def _preset_dict(preset: Any) -> dict[str, Any] | None:
    if preset is None:
        return None
    return {name: getattr(preset, name) for name in SAMPLER_FIELDS}


def _gpu_environment(device: str) -> dict[str, Any] | None:
    if not device.startswith("cuda"):
        return None
    import torch

    index = torch.device(device).index or 0
    properties = torch.cuda.get_device_properties(index)
    return {
        "device_index": index,
        "name": properties.name,
        "total_memory_bytes": int(properties.total_memory),
        "compute_capability": f"{properties.major}.{properties.minor}",
        "cuda_runtime": torch.version.cuda,
        "device_count": torch.cuda.device_count(),
    }


def server_start_fields(
    *, config: Any, manifest: Any, artifact_path: str, family: str, engine: Any, frontend: Any, presets: dict[str, Any],
    device: str,
) -> dict[str, Any]:
    """Identity, resolved capacities, sampler defaults and overrides, thinking defaults, memory, environment, argv."""
    import torch

    from ninfer.core.config import redact_argv

    memory = engine.stats().memory
    capabilities = getattr(frontend, "capabilities", None)
    overrides = {name: getattr(config, name) for name in (*SAMPLER_FIELDS, "seed")}
    return {
        "identity": {
            "model_id": manifest.identity.model_id,
            "public_model_id": config.model_id or manifest.identity.model_id,
            "family": family,
            "architecture": manifest.architecture,
            "artifact": artifact_path if artifact_path.startswith("<") else os.path.abspath(artifact_path),
        },
        "capacities": {
            "max_context": config.max_context,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
            "max_concurrency": config.max_concurrency,
            "max_pending_requests": config.max_pending_requests,
            "pending_timeout_ms": config.pending_timeout_ms,
            "prefill_chunk": config.prefill_chunk,
            "default_max_tokens": config.default_max_tokens,
            "prefix_reuse": not config.no_prefix_reuse,
            "device_state_slots": config.device_state_slots,
            "host_state_slots": config.host_state_slots,
            "host_kv_mib": config.host_kv_mib,
            "max_private_continuations": config.max_private_continuations,
            "max_shared_prefixes": config.max_shared_prefixes,
            "max_long_anchors_per_continuation": config.max_long_anchors_per_continuation,
            "kv_dtype": config.kv_dtype,
            "spec": config.spec,
            "draft_tokens": config.draft_tokens,
        },
        "context_cost": engine.config.context_cost.record(),
        "sampler": {
            "defaults": {"thinking": _preset_dict(presets.get("thinking")),
                         "non_thinking": _preset_dict(presets.get("non_thinking"))},
            "process_overrides": overrides,
            "greedy": config.greedy,
        },
        "thinking": {
            "enabled_by_default": not config.no_thinking,
            "preserve_thinking_default": config.preserve_thinking,
            "default_thinking_budget": config.default_thinking_budget,
            "effort_levels": list(capabilities.effort_levels) if capabilities is not None else [],
            "default_effort": capabilities.default_effort if capabilities is not None else None,
        },
        "memory": {
            "page_size_tokens": memory.page_size,
            "kv_pages": memory.total_pages,
            "state_slots": memory.total_slots,
            "workspace": None,
            "vision_workspace": None,
            "host": None,
            "cuda_graphs": not config.no_cuda_graph and device.startswith("cuda"),
        },
        "environment": {
            "device": device,
            "dtype": config.dtype,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "gpu": _gpu_environment(device),
        },
        "argv": list(redact_argv(config.argv)),
    }


# -- per-request events ------------------------------------------------------------------------------------


@attrs.frozen
class RequestShape:
    """The content-free shape of a request: counts and flags only."""

    stream: bool
    messages: int
    tools: int
    tool_choice: str
    media_items: int = 0
    ignored_tools: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def shape_of(conversation: Any, stream: bool) -> RequestShape:
    return RequestShape(
        stream=stream,
        messages=len(conversation.messages),
        tools=len(conversation.tools),
        tool_choice=conversation.tool_choice,
        ignored_tools=tuple(conversation.ignored_tools),
    )


def error_fields(error: NinferError) -> dict[str, Any]:
    """The exact HTTP status/type/code/param/message of a typed (server-authored) error."""
    return {
        "status": error.status,
        "type": error.error_type,
        "code": error.code,
        "param": error.param,
        "message": str(error),
    }


def sampler_fields(sampling: Any) -> dict[str, Any]:
    """The resolved sampler; stop strings are client content, so only their count is recorded."""
    return {
        **{name: getattr(sampling, name) for name in SAMPLER_FIELDS},
        "seed": sampling.seed,
        "max_tokens": sampling.max_tokens,
        "stop_strings": len(sampling.stop),
        "stop_token_ids": len(sampling.stop_token_ids),
    }


def configuration_fields(prepared: Any, sampling: Any, shape: RequestShape, output_budget: int) -> dict[str, Any]:
    """The resolved request configuration shared by ``request_start`` and ``request_error``."""
    budget = getattr(prepared.request.budget_close, "limit", None)
    return {
        "sampler": sampler_fields(sampling),
        "requested_reasoning_effort": prepared.requested_effort,
        "resolved_reasoning_effort": prepared.resolved_effort,
        "thinking": prepared.thinking,
        "preserve_thinking": prepared.preserve_thinking,
        "thinking_budget": budget,
        "responses_semantic_change": None,
        "output_budget": output_budget,
        "shape": shape.to_dict(),
    }


def request_start_fields(configuration: dict[str, Any], prompt_tokens: int, shape: RequestShape,
                         prepare_seconds: float) -> dict[str, Any]:
    return {
        **configuration,
        "prompt_tokens": prompt_tokens,
        "preparation": {
            "prepare_seconds": prepare_seconds,
            "media": {
                "items": shape.media_items,
                "acquisition_seconds": None,
                "preprocess_wall_seconds": None,
                "preprocess_work_seconds": None,
                "cache_hits": 0,
                "cache_misses": 0,
                "single_flight_waits": 0,
                "payload_bytes": 0,
            },
        },
    }


def request_rejected_fields(error: NinferError, shape: RequestShape, requested_effort: str | None) -> dict[str, Any]:
    return {
        "phase": "prepare",
        "shape": shape.to_dict(),
        "requested_reasoning_effort": requested_effort,
        "resolved_reasoning_effort": None,
        "media_items": shape.media_items,
        "error": error_fields(error),
    }


def cache_summary(outcome: Any) -> str:
    """The pretty ``cache N (P%, path label)`` fragment of the stderr completion line."""
    prompt_tokens, cached_tokens = outcome.prompt_tokens, outcome.cached_tokens
    percent = 100.0 * cached_tokens / prompt_tokens if prompt_tokens else 0.0
    return f"cache {cached_tokens} ({percent:.0f}%, {outcome.reuse_path.replace('_', ' ')})"


def engine_timing_fields(timings: Any, submitted_at: float) -> dict[str, Any]:
    """Queue wait and the request's measured engine exposure (``RequestTimings.host_work``).

    Every executor segment the request took part in is charged in full, so concurrent requests' values overlap.
    ``total`` is computed from exactly the five phase values written (a request without an exposure, one that never
    reached the executor, reports zeros).
    """
    admitted = timings.admitted_at
    end = timings.finished_at if timings.finished_at is not None else timings.last_token_at
    queue_wait = max((admitted if admitted is not None else (end or submitted_at)) - submitted_at, 0.0)
    exposure = timings.host_work if timings.host_work is not None else HostExposure()
    phases = dict(zip(HOST_PHASES, exposure.phases))
    return {
        "queue_wait_seconds": queue_wait,
        "device_wait_exposed_seconds": exposure.device_wait,
        "host_exposed_seconds": {**phases, "total": exposure.host_total},
        "decode": {
            "host_exposed_seconds": exposure.decode_host,
            "device_wait_seconds": exposure.decode_device_wait,
            "rounds": timings.decode_rounds,
        },
        "units": {"prefill": timings.prefill_units, "control": timings.control_units},
    }


def _materialization_fields(decision: Any) -> dict[str, Any] | None:
    if decision is None:
        return None
    return {
        "predicted_ns": {
            "immediate": decision.predicted_immediate_ns,
            "future_loss": decision.predicted_future_loss_ns,
            "total": decision.predicted_total_ns,
        },
        "evaluated_targets": decision.evaluated_targets,
        "projection_work": decision.projection_work,
        "planning_ns": decision.planning_ns,
        "stop_reason": decision.stop_reason,
        "budget_exhausted": decision.budget_exhausted,
        "degradation_units": list(decision.degradation_units),
        "maximal_root_fallback": decision.maximal_root_fallback,
    }


def request_done_fields(
    *, outcome: Any, parse_report: Any, reasoning_tokens: int, budget_limit: int | None, prepare_seconds: float,
    submitted_at: float, spec: str | None,
) -> dict[str, Any]:
    timings = outcome.timings
    ttft = max(timings.first_token_at - timings.submitted_at, 0.0) if timings.first_token_at is not None else None
    computed = outcome.prompt_tokens - outcome.cached_tokens if timings.prompt_done_at is not None else 0
    stop = outcome.stop
    return {
        "result": {
            "finish_reason": outcome.finish_reason,
            "stop_kind": None if stop is None else ("string" if stop.string is not None else "token"),
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "reasoning_tokens": reasoning_tokens,
            "prefix_cache_hit_tokens": outcome.cached_tokens,
            "computed_prefill_tokens": computed,
            "prefix_reuse_path": outcome.reuse_path,
            "reuse_limit": None if outcome.reuse_limit is None else attrs.asdict(outcome.reuse_limit),
            "seed": outcome.seed,
            "tool_call_parse": {
                "marker_seen": parse_report.marker_seen,
                "calls": parse_report.calls,
                "omitted_empty_arguments": parse_report.omitted_empty_arguments,
                "schema_mismatched_arguments": parse_report.schema_mismatched_arguments,
                "fallback_reason": parse_report.fallback_reason,
            },
            "thinking_budget": {
                "limit": budget_limit,
                "applied": outcome.control_tokens > 0,
                "inserted_tokens": outcome.control_tokens,
            },
        },
        "materialization": _materialization_fields(outcome.materialization),
        "timings_seconds": {
            "prepare": prepare_seconds,
            "ttft": ttft,
            "vision": 0.0,
            "prefill": timings.prompt_s,
            "decode": timings.decode_s,
            "total": timings.total_s,
            "speculative": _speculative_fields(outcome, spec),
        },
        "engine_timing": engine_timing_fields(timings, submitted_at),
    }


def _speculative_fields(outcome: Any, spec: str | None) -> dict[str, Any] | None:
    """The request's speculative counters (null without ``--spec``)."""
    counters = getattr(outcome, "speculative", None)
    if spec is None or counters is None:
        return None
    return counters.to_dict()


def request_error_fields(configuration: dict[str, Any] | None, error: NinferError) -> dict[str, Any]:
    return {"configuration": configuration, "error": error_fields(error)}


# -- the per-server and per-request observers used by the protocol layer ------------------------------------

OBSERVABILITY_KEY = "observability"


def as_ninfer_error(exc: BaseException) -> NinferError:
    """A typed error for the record: NinferErrors as they are, cancellation as a disconnect, others internal."""
    if isinstance(exc, NinferError):
        return exc
    import asyncio

    if isinstance(exc, asyncio.CancelledError):
        error = NinferError("the request was cancelled before an outcome existed", code="client_disconnected")
        error.status, error.error_type = 499, "invalid_request_error"
        return error
    return NinferError(f"internal error ({type(exc).__name__})")


@attrs.define
class ServerObservability:
    """What the serve process records: the optional JSONL writer and the throughput counters."""

    request_log: RequestLogWriter | None
    counters: Any  # ThroughputCounters
    spec: str | None = None

    def observe(self, protocol: str, http_request_id: str, conversation: Any, stream: bool) -> "RequestObserver":
        """A request entering synchronous preparation: it gets the next JSONL request id."""
        request_id = self.request_log.next_request_id() if self.request_log is not None else 0
        return RequestObserver(self, request_id, protocol, http_request_id, shape_of(conversation, stream),
                               getattr(conversation, "reasoning_effort", None))


class RequestObserver:
    """One generation's JSONL records: ``request_start`` or ``request_rejected``, then exactly one terminal."""

    def __init__(self, server: ServerObservability, request_id: int, protocol: str, http_request_id: str,
                 shape: RequestShape, requested_effort: str | None) -> None:
        self.server = server
        self.request_id = request_id
        self.protocol = protocol
        self.http_request_id = http_request_id
        self.shape = shape
        self.requested_effort = requested_effort
        self._configuration: dict[str, Any] | None = None
        self._budget_limit: int | None = None
        self._prepare_seconds = 0.0
        self._submitted_at = 0.0
        self._completion_seen = 0
        self._prefill_counted = False
        self._ended = False

    def _write(self, event: str, fields: dict[str, Any]) -> None:
        if self.server.request_log is not None:
            ids = {"request_id": self.request_id, "protocol": self.protocol, "http_request_id": self.http_request_id}
            self.server.request_log.write(event, {**ids, **fields})

    def rejected(self, exc: BaseException) -> None:
        """Preparation (or synchronous submission) failed: ``request_rejected``, no start, no terminal."""
        if self._ended:
            return
        self._ended = True
        self._write("request_rejected", request_rejected_fields(as_ninfer_error(exc), self.shape, self.requested_effort))

    def started(self, prepared: Any, sampling: Any, prepare_seconds: float, submitted_at: float) -> None:
        prompt_tokens = len(prepared.request.prompt_token_ids)
        self._configuration = configuration_fields(prepared, sampling, self.shape, prepared.output_budget)
        self._budget_limit = self._configuration["thinking_budget"]
        self._prepare_seconds = prepare_seconds
        self._submitted_at = submitted_at
        self.server.counters.add(started=1)
        self._write("request_start", request_start_fields(self._configuration, prompt_tokens, self.shape, prepare_seconds))

    def committed(self, completion_tokens: int, prompt_tokens: int, cached_tokens: int) -> None:
        """An engine commit reached the protocol layer: credit prefill once, then decode-round tokens."""
        added_prefill = 0
        if not self._prefill_counted and completion_tokens > 0:
            self._prefill_counted = True
            added_prefill = max(prompt_tokens - cached_tokens, 0)
        decode = max(completion_tokens - 1, 0) - max(self._completion_seen - 1, 0)
        self._completion_seen = completion_tokens
        self.server.counters.add(prefill_tokens=added_prefill, decode_tokens=max(decode, 0))

    def done(self, outcome: Any, parse_report: Any, reasoning_tokens: int) -> None:
        if self._ended:
            return
        self._ended = True
        self.committed(outcome.completion_tokens, outcome.prompt_tokens, outcome.cached_tokens)
        if not self._prefill_counted and outcome.timings.prompt_done_at is not None:
            self._prefill_counted = True  # the prompt was computed but no token was committed (cancelled)
            self.server.counters.add(prefill_tokens=max(outcome.prompt_tokens - outcome.cached_tokens, 0))
        self.server.counters.add(finished=1)
        self._write("request_done", request_done_fields(
            outcome=outcome, parse_report=parse_report, reasoning_tokens=reasoning_tokens,
            budget_limit=self._budget_limit, prepare_seconds=self._prepare_seconds,
            submitted_at=self._submitted_at, spec=self.server.spec,
        ))

    def failed(self, exc: BaseException) -> None:
        """Generation ended before an engine outcome existed: ``request_error``."""
        if self._ended:
            return
        self._ended = True
        self.server.counters.add(finished=1)
        self._write("request_error", request_error_fields(self._configuration, as_ninfer_error(exc)))

    @property
    def ended(self) -> bool:
        return self._ended


def observability_for(context: Any) -> ServerObservability | None:
    return context.state.get(OBSERVABILITY_KEY)
