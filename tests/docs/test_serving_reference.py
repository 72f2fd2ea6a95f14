"""docs/serving.md is the serving reference: its options table is ServeConfig's, its endpoint list the built-in routes.

The options table between the ``serve-options`` markers must equal ``options_markdown()`` byte for byte, so a new,
removed or renamed option, a changed default or help text fails here until the page is regenerated with
``python -m ninfer.core.options_doc docs/serving.md``.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

import attrs
import pytest

from ninfer.core.config import option_flag, serve_options
from ninfer.core.options_doc import BEGIN, END, documented_block, options_markdown, replace_block
from ninfer.plugins import BUILTIN_PLUGINS
from paths import DOCS, REPO_ROOT

SERVING = DOCS / "serving.md"
#: An endpoint as the page writes it: a code span holding an HTTP method and a path.
ENDPOINT = re.compile(r"`(GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS) (/[^`\s]*)`")
#: A repository path as the page writes it.
REPO_PATH = re.compile(r"`((?:ninfer|plugins-contrib|tests|docs|lab)/[^`\s]*)`")


def serving_text() -> str:
    return SERVING.read_text(encoding="utf-8")


def builtin(hook: str) -> list[Any]:
    """What the built-in plugins (``BUILTIN_PLUGINS``, wherever they live) register through ``hook``."""
    found: list[Any] = []
    for name in BUILTIN_PLUGINS:
        implementation = getattr(importlib.import_module(name), hook, None)
        if implementation is not None:
            found.extend(implementation())
    return found


def builtin_routes() -> list[str]:
    adapters = builtin("ninfer_protocol_adapters")
    return [f"{route.method} {route.path}" for adapter in adapters for route in adapter.routes]


def test_the_options_table_is_generated_from_serve_config() -> None:
    text = serving_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "docs/serving.md needs exactly one options block"
    assert documented_block(text) == options_markdown(), (
        "docs/serving.md's options table is out of date: run python -m ninfer.core.options_doc docs/serving.md"
    )


def test_the_table_has_one_row_per_option_with_its_flag_and_help() -> None:
    rows = options_markdown().splitlines()[2:]
    options = serve_options()
    assert len(rows) == len(options)
    for row, (name, (_attribute, spec)) in zip(rows, options.items()):
        assert row.startswith(f"| `{option_flag(name)}"), row
        assert spec.help.replace("|", "\\|") in row


def test_a_changed_default_fails_the_comparison() -> None:
    """The guard can fail: the table of a ServeConfig whose --port default differs is not the documented one."""
    options = dict(serve_options())
    attribute, spec = options["port"]
    options["port"] = (attribute.evolve(default=attribute.default + 1), spec)
    changed = options_markdown(options)
    assert f"| `--port N` | `{attribute.default + 1}` |" in changed
    assert documented_block(serving_text()) != changed
    assert documented_block(replace_block(serving_text(), options)) == changed


def test_a_changed_help_text_or_a_new_option_fails_the_comparison() -> None:
    options = dict(serve_options())
    attribute, spec = options["host"]
    helped = {**options, "host": (attribute, attrs.evolve(spec, help=spec.help + " (changed)"))}
    assert options_markdown(helped) != documented_block(serving_text())
    extra = {**options, "brand_new_option": options["greedy"]}
    assert "`--brand-new-option`" in options_markdown(extra)
    assert options_markdown(extra) != documented_block(serving_text())


def test_an_option_without_a_documentable_default_is_refused() -> None:
    options = dict(serve_options())
    attribute, spec = options["device_state_slots"]
    options["device_state_slots"] = (attribute.evolve(default=attrs.NOTHING), attrs.evolve(spec, default_text=None))
    with pytest.raises(ValueError, match="--device-state-slots"):
        options_markdown(options)


@pytest.mark.parametrize("route", builtin_routes())
def test_every_builtin_route_is_documented(route: str) -> None:
    assert f"`{route}`" in serving_text(), f"docs/serving.md does not list the endpoint {route}"


def test_every_documented_endpoint_is_a_builtin_route() -> None:
    documented = {f"{method} {path}" for method, path in ENDPOINT.findall(serving_text())}
    assert documented, "docs/serving.md lists no endpoints"
    assert documented <= set(builtin_routes()), f"not registered: {sorted(documented - set(builtin_routes()))}"


def test_the_builtin_registry_choices_are_named() -> None:
    text = serving_text()
    names = [entry.name for hook in ("ninfer_kv_dtypes", "ninfer_speculative_backends") for entry in builtin(hook)]
    assert names
    for name in names:
        assert f"`{name}`" in text, f"docs/serving.md does not name the built-in choice {name}"


def test_every_repository_path_the_page_names_exists() -> None:
    missing = [path for path in REPO_PATH.findall(serving_text()) if not (REPO_ROOT / path).exists()]
    assert not missing, f"docs/serving.md names paths that do not exist: {missing}"


def test_the_readme_points_at_the_reference_and_keeps_the_ci_command() -> None:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/serving.md" in readme
    ci_command = (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci_command.startswith("pip install ")
    assert f"\n{ci_command}\n" in readme, "README.md's test command must be exactly the one .ci/run runs"
