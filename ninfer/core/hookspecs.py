"""All ninfer hook specifications (pluggy project ``ninfer``).

A plugin is any module or object with functions decorated by :data:`hookimpl` whose names match the specs
below; an implementation may take any subset of a spec's arguments. Built-in plugins (``ninfer.plugins``, the
server's adapters) use exactly the same hooks as third-party packages, which are discovered through the ``ninfer``
entry-point group (``NINFER_PLUGINS`` restricts them by name).

Registration hooks run once, when the plugin manager builds its registries at startup; descriptor names must be
unique across all plugins (a duplicate fails startup, naming both plugins). Lifecycle hooks run in the serve
process; their return values are ignored and none is ``firstresult``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.descriptors import KVDtype, ModelFamily, ProtocolAdapter, SpeculativeBackend
    from ninfer.core.plugins import Registries
    from ninfer.core.records import RequestRecord
    from ninfer.core.serving import ServerView

PROJECT = "ninfer"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# --------------------------------------------------------------------------------------------------------------
# Registration: each hook returns descriptors (ninfer.core.descriptors).
# --------------------------------------------------------------------------------------------------------------


@hookspec
def ninfer_model_families(registries: Registries) -> Sequence[ModelFamily]:
    """Return the model families this plugin provides.

    A family recognizes artifacts by architecture, knows the tensor names and shapes of its checkpoints, builds
    the model runtime the engine drives and the frontend that renders prompts and decodes output
    (:class:`~ninfer.core.descriptors.ModelFamily` lists every factory and its arguments). A family may also
    offer named random-weight presets of real configurations (``synthetic_presets`` / ``synthetic_source``), which
    ``ninfer serve --synthetic PRESET`` serves without a checkpoint; a preset name must be unique across families.

    :param registries: the registry this family joins, still being filled. Take it only when a factory needs
        another plugin's descriptor (a family that reuses another family's frontend): keep it and look the
        descriptor up when the factory runs, never while this hook runs.
    """


@hookspec
def ninfer_speculative_backends() -> Sequence[SpeculativeBackend]:
    """Return the speculative-decoding backends this plugin provides (the ``--spec NAME`` choices).

    A backend's ``build_drafter(runtime, artifact, config)`` returns a :class:`ninfer.core.drafting.Drafter`.
    """


@hookspec
def ninfer_kv_dtypes() -> Sequence[KVDtype]:
    """Return the KV-cache storage formats this plugin provides (the ``--kv-dtype NAME`` choices)."""


@hookspec
def ninfer_protocol_adapters() -> Sequence[ProtocolAdapter]:
    """Return the HTTP protocol adapters this plugin provides.

    Each adapter's ``mount(app, server)`` adds its routes to the falcon ASGI app once the engine is loaded;
    ``server`` is the :class:`~ninfer.core.serving.ServerView`.
    """


# --------------------------------------------------------------------------------------------------------------
# Lifecycle: called by ``ninfer serve``; return values are ignored.
# --------------------------------------------------------------------------------------------------------------


@hookspec
def ninfer_serve_started(server: ServerView) -> None:
    """Called once the engine is loaded and the HTTP app is built, before the first request is accepted.

    :param server: the running server (options, model id, engine view, frontend, adapter state).
    """


@hookspec
def ninfer_serve_stopping(server: ServerView) -> None:
    """Called once at graceful shutdown, after the HTTP server has stopped and before the engine stops."""


@hookspec
def ninfer_request_finished(record: RequestRecord) -> None:
    """Called on the event loop after every generation request reaches its terminal outcome.

    :param record: protocol, finish reason, token counts and timings; never prompt or generated text.
        Implementations must not block (they run on the server's event loop).
    """
