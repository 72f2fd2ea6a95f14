"""The plugin manager: built-in plugins, ``ninfer`` entry points, the ``NINFER_PLUGINS`` allow-list, registries."""

from __future__ import annotations

import functools
import importlib
import os
from importlib.metadata import distributions
from typing import Any, Iterable, Mapping, TypeVar

import attrs
import pluggy

from ninfer.core import hookspecs
from ninfer.core.descriptors import KVDtype, ModelFamily, ProtocolAdapter, SpeculativeBackend
from ninfer.core.errors import ArtifactError, ConfigError, PluginError

ENTRY_POINT_GROUP = "ninfer"
ALLOW_LIST_ENV = "NINFER_PLUGINS"
#: Module that lists the built-in plugin modules in ``BUILTIN_PLUGINS`` (imported by path, not by name).
BUILTIN_PACKAGE = "ninfer.plugins"

T = TypeVar("T")


@attrs.frozen
class PluginInfo:
    """Where a registered plugin came from."""

    name: str
    distribution: str
    version: str
    builtin: bool


@attrs.frozen
class Registries:
    """Every descriptor registered by every plugin, keyed by unique name, plus who registered it."""

    model_families: Mapping[str, ModelFamily]
    speculative_backends: Mapping[str, SpeculativeBackend]
    kv_dtypes: Mapping[str, KVDtype]
    protocol_adapters: Mapping[str, ProtocolAdapter]
    owners: Mapping[tuple[str, str], str]  # (kind, name) -> plugin name

    def family_for(self, manifest: Any) -> ModelFamily:
        """The model family that recognizes ``manifest``, or a clear error naming the architecture."""
        for family in self.model_families.values():
            if family.matches(manifest):
                return family
        known = ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in self.model_families.values())
        raise ArtifactError(
            f"no registered model family recognizes architecture {manifest.architecture!r}"
            f" (model_type {manifest.text_model_type!r}); registered families: {known}"
        )

    def speculative_backend(self, name: str) -> SpeculativeBackend:
        return _lookup(self.speculative_backends, name, "speculative backend", "--spec")

    def kv_dtype(self, name: str) -> KVDtype:
        return _lookup(self.kv_dtypes, name, "KV dtype", "--kv-dtype")


def _lookup(table: Mapping[str, T], name: str, kind: str, option: str) -> T:
    try:
        return table[name]
    except KeyError:
        raise ConfigError(f"unknown {kind} {name!r} for {option}; choose one of: {', '.join(table)}") from None


#: Registries field -> (registration hook, the kind named in errors and ``ninfer plugins list``).
_REGISTRATIONS = {
    "model_families": ("ninfer_model_families", "model family"),
    "speculative_backends": ("ninfer_speculative_backends", "speculative backend"),
    "kv_dtypes": ("ninfer_kv_dtypes", "KV dtype"),
    "protocol_adapters": ("ninfer_protocol_adapters", "protocol adapter"),
}


class PluginManager:
    """Loads plugins once and builds the registries from their hooks."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self._registries: Registries | None = None

    # -- loading -----------------------------------------------------------------------------------

    def register(self, plugin: object, info: PluginInfo) -> None:
        """Register one plugin object (module or instance) under ``info.name``."""
        if info.name in self.info:
            other = self.info[info.name]
            raise PluginError(
                f"two plugins are both named {info.name!r}: one from {other.distribution} {other.version}, "
                f"one from {info.distribution} {info.version}"
            )
        try:
            self.pm.register(plugin, name=info.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {info.name!r} ({info.distribution}) is invalid: {exc}") from None
        self.info[info.name] = info

    def load_builtins(self) -> None:
        from ninfer import __version__

        package = importlib.import_module(BUILTIN_PACKAGE)
        for module_name in package.BUILTIN_PLUGINS:
            module = importlib.import_module(module_name)
            self.register(module, PluginInfo(module_name, "ninfer", __version__, builtin=True))

    def load_entry_points(self, allow: Iterable[str] | None = None) -> None:
        """Load third-party plugins of the ``ninfer`` entry-point group; ``allow`` restricts them by name."""
        allowed = None if allow is None else set(allow)
        seen: set[str] = set()
        for dist in distributions():
            dist_name = dist.metadata["Name"] or "?"
            for ep in dist.entry_points:
                if ep.group != ENTRY_POINT_GROUP or (dist_name, ep.name) in seen:
                    continue
                seen.add((dist_name, ep.name))
                if allowed is not None and ep.name not in allowed:
                    continue
                try:
                    plugin = ep.load()
                except Exception as exc:  # a broken third-party plugin must say which one it is
                    raise PluginError(f"plugin {ep.name!r} from {dist_name} failed to import: {exc}") from exc
                self.register(plugin, PluginInfo(ep.name, dist_name, dist.version, builtin=False))
        if allowed:
            missing = sorted(allowed - {name for name, info in self.info.items() if not info.builtin})
            if missing:
                raise PluginError(f"{ALLOW_LIST_ENV} names plugins that are not installed: {', '.join(missing)}")

    def check(self) -> None:
        """Fail on hook implementations that match no hook spec (misspelled ``ninfer_*`` names)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"plugin {exc.plugin_name if hasattr(exc, 'plugin_name') else exc.plugin!r} implements an "
                f"unknown hook: {exc} (see ninfer/core/hookspecs.py for the hook names)"
            ) from None

    # -- registries --------------------------------------------------------------------------------

    @property
    def registries(self) -> Registries:
        if self._registries is None:
            self._registries = self._build_registries()
        return self._registries

    def _collect(self, hook_name: str, kind: str, registries: Registries, table: dict[str, Any]) -> None:
        hook = getattr(self.pm.hook, hook_name)
        owners = registries.owners
        # get_hookimpls() lists implementations in registration order, so built-ins come first.
        for impl in hook.get_hookimpls():
            arguments = {"registries": registries} if "registries" in impl.argnames else {}
            for descriptor in impl.function(**arguments) or ():
                name = descriptor.name
                if name in table:
                    raise PluginError(
                        f"{kind} {name!r} is registered twice: by plugin {owners[(kind, name)]!r} "
                        f"and by plugin {impl.plugin_name!r}"
                    )
                table[name] = descriptor
                owners[(kind, name)] = impl.plugin_name

    def _build_registries(self) -> Registries:
        """Collect every registration hook into one Registries. A hook that takes ``registries`` receives this
        object while it is being filled: it may keep it and look other plugins' descriptors up when called."""
        tables: dict[str, dict[str, Any]] = {field: {} for field in _REGISTRATIONS}
        registries = Registries(**tables, owners={})
        for field, (hook_name, kind) in _REGISTRATIONS.items():
            self._collect(hook_name, kind, registries, tables[field])
        return registries

    @property
    def hook(self) -> Any:
        """The pluggy hook relay, for lifecycle calls such as ``hook.ninfer_serve_started(server=...)``."""
        return self.pm.hook

    def describe(self) -> list[dict[str, Any]]:
        """One entry per plugin: name, distribution, version, builtin flag and what it registers."""
        registries = self.registries
        rows = []
        for name, info in self.info.items():
            registered: dict[str, list[Any]] = {}
            for (kind, item), owner in registries.owners.items():
                if owner == name:
                    registered.setdefault(kind, []).append(_describe_item(registries, kind, item))
            rows.append({**attrs.asdict(info), "registers": registered})
        return rows


def _describe_item(registries: Registries, kind: str, name: str) -> Any:
    if kind == "speculative backend":
        backend = registries.speculative_backends[name]
        return {
            "name": name,
            "draft_tokens": [backend.min_draft_tokens, backend.max_draft_tokens],
            "available": backend.build_drafter is not None,
        }
    if kind == "KV dtype":
        dtype = registries.kv_dtypes[name]
        return {
            "name": name,
            "bytes_per_token_per_head_dim": dtype.bytes_per_token_per_head_dim,
            "available": dtype.make_storage is not None,
        }
    if kind == "model family":
        family = registries.model_families[name]
        return {"name": name, "architectures": list(family.architectures), "available": family.load_runtime is not None}
    adapter = registries.protocol_adapters[name]
    return {
        "name": name,
        "routes": [f"{r.method} {r.path}" for r in adapter.routes],
        "available": adapter.mount is not None,
    }


def allow_list_from_env(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """Parse ``NINFER_PLUGINS`` (comma list); unset means every installed third-party plugin loads."""
    raw = (environ if environ is not None else os.environ).get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return [part.strip() for part in raw.split(",") if part.strip()]


def load_plugin_manager(*, entry_points: bool = True, environ: Mapping[str, str] | None = None) -> PluginManager:
    """Build the process's plugin manager: built-ins, then allowed entry points, then validation."""
    manager = PluginManager()
    manager.load_builtins()
    if entry_points:
        manager.load_entry_points(allow_list_from_env(environ))
    manager.check()
    manager.registries  # build now so duplicate names fail at startup
    return manager


@functools.cache
def process_plugin_manager() -> PluginManager:
    """The process's plugin manager, built on first use and shared by every entry point that is not handed one
    (the CLI, the offline ``LLM`` API)."""
    return load_plugin_manager()


def given_or_process(registries: Registries | None) -> Registries:
    """``registries`` when a caller passes them (every entry point does), else the process's."""
    return registries if registries is not None else process_plugin_manager().registries
