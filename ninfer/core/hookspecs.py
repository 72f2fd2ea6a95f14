"""All ninfer hook specifications (pluggy project ``ninfer``).

A plugin is any module or object with functions decorated by :data:`hookimpl` whose names match the
specs below. Built-in plugins (``ninfer.plugins``) use exactly the same hooks as third-party packages,
which are discovered through the ``ninfer`` entry-point group.
"""

from __future__ import annotations

from typing import Any, Sequence

import pluggy

from ninfer.core.descriptors import KVDtype, ModelFamily, ProtocolAdapter, SpeculativeBackend

PROJECT = "ninfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------------------------------
# Registration: each hook returns descriptors; names must be unique across all plugins.
# --------------------------------------------------------------------------------------------------


@hookspec
def ninfer_model_families() -> Sequence[ModelFamily]:
    """Return the model families this plugin provides.

    A family recognizes artifacts by architecture, knows the tensor names and shapes of its
    checkpoints, builds the model runtime the engine drives, and builds the prompt frontend.
    """


@hookspec
def ninfer_speculative_backends() -> Sequence[SpeculativeBackend]:
    """Return the speculative-decoding backends this plugin provides (``--spec NAME`` choices)."""


@hookspec
def ninfer_kv_dtypes() -> Sequence[KVDtype]:
    """Return the KV-cache storage formats this plugin provides (``--kv-dtype NAME`` choices)."""


@hookspec
def ninfer_protocol_adapters() -> Sequence[ProtocolAdapter]:
    """Return the HTTP protocol adapters this plugin provides; each mounts its routes on the server."""


# --------------------------------------------------------------------------------------------------
# Lifecycle: called by the server; return values are ignored.
# --------------------------------------------------------------------------------------------------


@hookspec
def ninfer_serve_started(server: Any) -> None:
    """Called once the engine is loaded and the HTTP app is built, before the first request is accepted.

    ``server`` exposes ``config`` (the frozen ServeConfig), ``engine`` and ``model_id``.
    """


@hookspec
def ninfer_serve_stopping(server: Any) -> None:
    """Called once at graceful shutdown, before the engine stops."""


@hookspec
def ninfer_request_finished(record: Any) -> None:
    """Called on the event loop after every generation request reaches its terminal outcome.

    ``record`` is the request's completion record (protocol, token counts, timings, finish reason).
    It never contains prompt or generated text. Implementations must not block.
    """
