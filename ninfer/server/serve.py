"""``ninfer serve``: resolve the artifact, check every selected capability, load the model, serve over HTTP.

Startup: artifact (or the demo) -> model family -> runtime -> tokenizer -> Engine -> frontend -> HTTP app ->
uvicorn on a tuned listening socket, then one readiness line. SIGINT/SIGTERM shut down gracefully: stop accepting
connections, cancel every in-flight request, stop the engine, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from typing import TYPE_CHECKING, Any, Iterator

import uvicorn

from ninfer.core.artifact.source import open_model_source
from ninfer.core.artifact.synthetic import open_synthetic_source
from ninfer.core.drafting import SpeculativeConfig
from ninfer.core.errors import ConfigError, NotYetAvailableError
from ninfer.core.runtime import LoadOptions
from ninfer.observability import oplog
from ninfer.observability.request_log import (
    OBSERVABILITY_KEY,
    RequestLogWriter,
    ServerObservability,
    server_start_fields,
)
from ninfer.observability.throughput import ThroughputCounters, ThroughputReporter

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.artifact.container import ModelSource
    from ninfer.core.config import ServeConfig
    from ninfer.core.plugins import PluginManager
    from ninfer.engine import ContextCost
    from ninfer.server.app import ServerContext

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def check_capabilities(config: "ServeConfig", plugins: "PluginManager") -> None:
    """Fail before anything loads when an option selects something that is not implemented yet."""
    registries = plugins.registries
    registries.kv_dtype(config.kv_dtype).require_storage()
    if config.spec is not None:
        registries.speculative_backend(config.spec).require_drafter()
    if config.vision:
        raise NotYetAvailableError("--vision is not yet available: the vision runtime has not been implemented")


def device_for(config: "ServeConfig") -> str:
    import torch

    return f"cuda:{config.device}" if torch.cuda.is_available() else "cpu"


class GracefulServer(uvicorn.Server):
    """uvicorn, with shutdown signals that also cancel in-flight generations and leave the exit status 0."""

    def __init__(self, config: uvicorn.Config, context: "ServerContext") -> None:
        super().__init__(config)
        self.context = context
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop_requested = False

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if not self.stop_requested and self.loop is not None:
            self.stop_requested = True
            self.loop.call_soon_threadsafe(self._begin_shutdown, signal.Signals(sig).name)

    def _begin_shutdown(self, signal_name: str) -> None:
        from ninfer.server.generation import stop_generations

        cancelled = stop_generations(self.context)
        oplog.get_logger().info(
            f"{signal_name} received: shutting down (cancelling {cancelled} in-flight request{'s' * (cancelled != 1)})"
        )

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Install the shutdown handlers; unlike uvicorn, do not re-raise the signal afterwards (exit 0)."""
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def _readiness_line(context: "ServerContext", host: str, port: int) -> str:
    config, engine = context.config, context.engine
    scheme_host = f"[{host}]" if ":" in host else host
    return (
        f"ready: serving {context.model_id} on http://{scheme_host}:{port} (max context {config.max_context}, "
        f"KV capacity {engine.kv_capacity_tokens} tokens, max concurrency {config.max_concurrency}, "
        f"max pending {config.max_pending_requests}, vision {'on' if config.vision else 'off'})"
    )


async def _serve_until_stopped(server: GracefulServer, sock: Any, context: "ServerContext") -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        host, port = sock.getsockname()[:2]
        oplog.get_logger().info(_readiness_line(context, host, port))
    await task


def serve(config: "ServeConfig", plugins: "PluginManager") -> None:
    """Load the model and serve it until SIGINT/SIGTERM; ``--request-log-jsonl`` is opened first (or aborts)."""
    log = oplog.configure(config.log_level)
    check_capabilities(config, plugins)
    request_log = RequestLogWriter(config.request_log_jsonl) if config.request_log_jsonl is not None else None
    try:
        _serve(config, plugins, log, request_log)
    finally:
        if request_log is not None:
            request_log.close()


def context_cost(config: "ServeConfig", model_id: str) -> "ContextCost":
    """The context-cost coefficients for the served model: generic, or from ``--context-cost-presets``."""
    from ninfer.core.config import read_context_cost_presets
    from ninfer.engine import resolve_context_cost

    path = config.context_cost_presets
    if path is None:
        return resolve_context_cost(None, model_id)
    return resolve_context_cost(read_context_cost_presets(path), model_id, origin=str(path))


def _serve(config: "ServeConfig", plugins: "PluginManager", log: Any, request_log: "RequestLogWriter | None") -> None:
    from ninfer.engine import EngineConfig
    from ninfer.server.app import ServerContext, build_app
    from ninfer.server.compose import load_engine
    from ninfer.server.generation import close_generation_resources
    from ninfer.server.runner import listening_socket, server_config

    registries = plugins.registries
    load_options = LoadOptions(device=device_for(config), dtype=config.dtype, cuda_graphs=not config.no_cuda_graph)
    path, source = _open_source(config, registries, load_options, log)
    with source as artifact:
        manifest = artifact.manifest
        family = registries.family_for(manifest)
        log.info(f"loading {manifest.identity.model_id} ({family.name}, {manifest.architecture})")
        loaded = load_engine(
            artifact,
            EngineConfig.from_serve_config(config, context_cost=context_cost(config, manifest.identity.model_id)),
            registries=registries,
            load_options=load_options,
            speculative=speculative_config(config),
        )
        engine, runtime = loaded.engine, loaded.runtime
        try:
            log.info(
                f"model loaded: {len(runtime.spec.attention_layers)} attention + {len(runtime.spec.recurrent_layers)} "
                f"recurrent layers on {runtime.spec.device}"
            )
            log.info("warming up: compiling kernels and capturing graphs for every batch size and prefill length")
            began = time.perf_counter()
            engine.warm_up()
            log.info(f"warmed up in {time.perf_counter() - began:.1f} s")
            cost = engine.config.context_cost
            log.info(
                f"context cost ({cost.source}): restore max({cost.transfer.batch_ns / 1e3:g} us + "
                f"{cost.transfer.op_ns / 1e3:g} us per tensor, {1 / max(cost.transfer.ns_per_byte, 1e-12):g} B/ns), "
                f"prefill {cost.prefill.token_ns / 1e3:g} us per token + {cost.prefill.pair_ns:g} ns per attention pair"
            )
            frontend = family.require("build_frontend")(artifact, config, loaded.tokenizer)
            context = ServerContext(
                config=config,
                plugins=plugins,
                engine=engine,
                frontend=frontend,
                model_id=config.model_id or manifest.identity.model_id,
                max_model_len=config.max_context,
            )
            observability = ServerObservability(request_log, ThroughputCounters(), spec=config.spec)
            context.state[OBSERVABILITY_KEY] = observability
            if request_log is not None:
                presets = family.sampling_presets(manifest) if family.sampling_presets else {}
                request_log.write("server_start", server_start_fields(
                    config=config, manifest=manifest, artifact_path=str(path), family=family.name, engine=engine,
                    frontend=frontend, presets=dict(presets), device=str(runtime.spec.device),
                ))
            reporter = None
            if config.log_stats_interval_ms > 0:
                reporter = ThroughputReporter(engine, observability.counters, config.log_stats_interval_ms, request_log)
            app = build_app(context)
            try:
                sock = listening_socket(config.host, config.port)
            except OSError as exc:
                raise ConfigError(
                    f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", param="port"
                ) from None
            server = GracefulServer(server_config(app, header_timeout_ms=config.header_timeout_ms), context)
            if config.api_key_source is not None:
                log.info(f"API key required (from {config.api_key_source})")  # where from, never the value
            plugins.hook.ninfer_serve_started(server=context)
            if reporter is not None:
                reporter.start()
            try:
                asyncio.run(_serve_until_stopped(server, sock, context))
            finally:
                if reporter is not None:
                    reporter.stop()
                sock.close()
                plugins.hook.ninfer_serve_stopping(server=context)
                close_generation_resources(context)
        finally:
            engine.shutdown()
    log.info("stopped")


def _open_source(
    config: "ServeConfig", registries: Any, load_options: LoadOptions, log: Any
) -> tuple[str, "ModelSource"]:
    """What ``config`` serves, and its path as logged: the ``--synthetic`` preset (its weights drawn on the load
    device in the load dtype when the loader reads them), the artifact, or the built-in demo."""
    if config.synthetic is not None:
        log.info(f"no checkpoint: serving synthetic preset {config.synthetic} with random weights "
                 f"(seed {config.synthetic_seed}) drawn on {load_options.device}")
        source = open_synthetic_source(config.synthetic, registries, load_options, seed=config.synthetic_seed)
        return str(source.path), source
    if config.artifact is None:
        from ninfer.server.demo import demo_artifact_path

        demo = demo_artifact_path(registries)
        log.info(f"no artifact given: serving the built-in tiny demo model {demo} (its weights are random)")
        return str(demo), open_model_source(demo, registries)
    return config.artifact, open_model_source(config.artifact, registries)


def speculative_config(config: "ServeConfig") -> SpeculativeConfig | None:
    """The ``--spec`` selection of ``config`` (None without speculation)."""
    if config.spec is None:
        return None
    assert config.draft_tokens is not None  # the option checks require it with --spec
    return SpeculativeConfig(config.spec, config.draft_tokens, config.lm_head_draft)
