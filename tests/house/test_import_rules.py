"""The layout's rules, checked from the source so a change cannot quietly break them (docs/architecture.md).

Every ``import`` statement counts, including those inside functions and ``TYPE_CHECKING`` blocks: a lazy or
type-only import is still a dependency of the room that writes it. The cycle rule looks at module-level imports
only (the ones that run at import time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from paths import REPO_ROOT

PACKAGE = REPO_ROOT / "ninfer"
CONTRIB = REPO_ROOT / "plugins-contrib"
MAX_MODULE_LINES = 650

#: room -> the ninfer rooms it must never import.
FORBIDDEN = {
    "ninfer.core": ("ninfer.engine", "ninfer.server", "ninfer.protocols", "ninfer.plugins", "ninfer.observability",
                    "ninfer.bench", "ninfer.cli", "ninfer.llm"),
    "ninfer.kernels": ("ninfer.core", "ninfer.engine", "ninfer.server", "ninfer.protocols", "ninfer.plugins",
                       "ninfer.observability", "ninfer.bench"),
    "ninfer.engine": ("ninfer.server", "ninfer.protocols", "ninfer.plugins", "ninfer.observability", "ninfer.bench",
                      "ninfer.cli", "ninfer.llm"),
    "ninfer.plugins": ("ninfer.engine", "ninfer.server", "ninfer.protocols", "ninfer.observability", "ninfer.bench",
                       "ninfer.cli", "ninfer.llm"),
    "ninfer.observability": ("ninfer.server", "ninfer.protocols", "ninfer.plugins", "ninfer.bench", "ninfer.cli"),
    "ninfer.protocols": ("ninfer.plugins", "ninfer.bench", "ninfer.cli"),
    "ninfer.server": ("ninfer.plugins", "ninfer.bench", "ninfer.cli"),
}
#: Rooms outside the engine reach it through its package (``ninfer.engine``), never its modules.
ENGINE_INTERNALS = "ninfer.engine."


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, module: str, *, top_level_only: bool = False) -> set[str]:
    """The absolute names of the modules ``path`` imports (``from a import b`` counts as ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(path, REPO_ROOT): path for path in sorted(PACKAGE.rglob("*.py"))}


def room_of(module: str) -> str | None:
    return next((room for room in FORBIDDEN if module == room or module.startswith(room + ".")), None)


def within(name: str, room: str) -> bool:
    return name == room or name.startswith(room + ".")


def test_the_rooms_import_only_what_they_may():
    problems = []
    modules = package_modules()
    for module, path in modules.items():
        room = room_of(module)
        names = imports(path, module)
        for name in sorted(names):
            if room is not None and any(within(name, other) for other in FORBIDDEN[room]):
                problems.append(f"{module} imports {name}")
            if not within(module, "ninfer.engine") and name.startswith(ENGINE_INTERNALS) and name in modules:
                problems.append(f"{module} imports the engine internal {name} (use ninfer.engine)")
            if within(name, "lab"):
                problems.append(f"{module} imports {name} from lab/")
    assert not problems, "\n".join(problems)


def test_contributed_plugins_use_only_the_contracts():
    problems = []
    for path in sorted(CONTRIB.glob("*/ninfer_*/**/*.py")):
        if "build" in path.parts:
            continue
        module = module_name(path, path.parents[len(path.relative_to(CONTRIB).parts) - 2])
        for name in sorted(imports(path, module)):
            if any(within(name, room) for room in FORBIDDEN["ninfer.plugins"]):
                problems.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
    assert not problems, "\n".join(problems)


def test_no_import_cycle_at_import_time():
    modules = package_modules()
    graph = {
        module: {name for name in imports(path, module, top_level_only=True) if name in modules and name != module}
        for module, path in modules.items()
    }
    # a package's own __init__ importing its submodules is not a cycle with them
    for module in graph:
        graph[module] = {name for name in graph[module] if not module.startswith(name + ".")}
    cycles = strongly_connected(graph)
    assert not cycles, "\n".join(" -> ".join(sorted(cycle)) for cycle in cycles)


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm: the components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in graph:
        if node not in index:
            visit(node)
    return components


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda path: str(path.relative_to(REPO_ROOT)))
def test_no_module_is_over_the_size_limit(path: Path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(REPO_ROOT)} has {lines} lines"


def test_the_rules_catch_a_forbidden_import(tmp_path: Path):
    """The checker itself: a core module importing the engine, lazily, is reported."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from ninfer.engine.executor import Executor\n", encoding="utf-8")
    names = imports(source, "ninfer.core.bad")
    assert "ninfer.engine.executor" in names
    assert any(within(name, other) for name in names for other in FORBIDDEN["ninfer.core"])
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [{"a", "b"}]
