"""ninfer plugin exposing ``GET /metrics`` in the Prometheus text exposition format."""

from __future__ import annotations

from typing import Any

import pluggy
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from ninfer.core.descriptors import ProtocolAdapter, Route

hookimpl = pluggy.HookimplMarker("ninfer")


class RequestMetrics:
    """Counters and histograms fed by ``ninfer_request_finished``; one registry per process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ("protocol", "finish_reason")
        self.requests = Counter("ninfer_requests", "Finished generation requests", labels, registry=self.registry)
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens incl. cached", ("protocol",), registry=self.registry)
        self.cached_tokens = Counter("ninfer_cached_prompt_tokens", "Prompt tokens reused from checkpoints", ("protocol",), registry=self.registry)
        self.completion_tokens = Counter("ninfer_completion_tokens", "Accepted generated tokens", ("protocol",), registry=self.registry)
        self.latency = Histogram("ninfer_request_seconds", "Request wall time", ("protocol",), registry=self.registry)

    def observe(self, record: Any) -> None:
        self.requests.labels(record.protocol, record.finish_reason).inc()
        self.prompt_tokens.labels(record.protocol).inc(record.prompt_tokens)
        self.cached_tokens.labels(record.protocol).inc(record.cached_tokens)
        self.completion_tokens.labels(record.protocol).inc(record.completion_tokens)
        self.latency.labels(record.protocol).observe(record.total_seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


METRICS = RequestMetrics()


class MetricsResource:
    """falcon ASGI resource serving the current exposition."""

    def __init__(self, metrics: RequestMetrics) -> None:
        self.metrics = metrics

    async def on_get(self, req: Any, resp: Any) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = self.metrics.exposition()


def mount(app: Any, server: Any) -> None:
    app.add_route("/metrics", MetricsResource(METRICS))


@hookimpl
def ninfer_protocol_adapters() -> list[ProtocolAdapter]:
    return [ProtocolAdapter("prometheus_metrics", (Route("GET", "/metrics"),), "Prometheus metrics", mount=mount)]


@hookimpl
def ninfer_request_finished(record: Any) -> None:
    METRICS.observe(record)
