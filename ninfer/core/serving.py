"""What protocol adapters and lifecycle hooks receive of the running server.

``ninfer.server.app.ServerContext`` implements :class:`ServerView`; plugins type against these protocols, so they
never import the server or the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.config import ServeConfig
    from ninfer.core.frontend import Frontend
    from ninfer.core.plugins import PluginManager


class EngineView(Protocol):
    """The resident engine as a plugin may read it: health, KV capacity and a point-in-time stats record."""

    @property
    def healthy(self) -> bool: ...

    @property
    def kv_capacity_tokens(self) -> int: ...

    def stats(self) -> Any: ...


class ServerView(Protocol):
    """The running server: its frozen options, the served model id, the engine, the family frontend, and
    ``state``, a dict where adapters keep what they own (one key per adapter)."""

    config: ServeConfig
    plugins: PluginManager
    model_id: str
    max_model_len: int
    created: int
    state: dict[str, Any]

    @property
    def engine(self) -> EngineView: ...

    @property
    def frontend(self) -> Frontend: ...
