"""The ``ninfer serve`` options reference, rendered from :class:`ServeConfig` so the docs cannot drift from the CLI.

``docs/serving.md`` holds :func:`options_markdown` verbatim between :data:`BEGIN` and :data:`END`;
``tests/docs/test_serving_reference.py`` checks that it still does. After changing an option, refresh the page with
``python -m ninfer.core.options_doc docs/serving.md``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

import attrs

from ninfer.core.config import OptionSpec, option_flag, serve_options

BEGIN = "<!-- serve-options:begin -->"
END = "<!-- serve-options:end -->"

Options = Mapping[str, tuple[attrs.Attribute, OptionSpec]]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe inside a GFM table cell (code spans included) must be escaped


def option_usage(name: str, spec: OptionSpec) -> str:
    """How the option is written: ``--port N``, ``--log-level trace|...``, ``--kv-dtype NAME``, ``--greedy``."""
    flag = option_flag(name)
    if spec.kind == "flag":
        return flag
    if spec.choices:
        return f"{flag} {'|'.join(spec.choices)}"
    return f"{flag} {spec.metavar or 'NAME'}"


def option_default(name: str, attribute: attrs.Attribute, spec: OptionSpec) -> str:
    """The documented default: the spec's ``default_text``, ``on``/``off`` for a switch, else the value in code."""
    if spec.default_text is not None:
        return spec.default_text
    default: Any = attribute.default
    if default is attrs.NOTHING:
        raise ValueError(f"{option_flag(name)} has neither a default nor a default_text to document")
    if spec.kind == "flag":
        return "on" if default else "off"
    return f"`{default}`"


def option_meaning(spec: OptionSpec) -> str:
    """The help text, plus where the choices come from when a plugin registry supplies them."""
    if spec.registry is None:
        return spec.help
    listed = "`ninfer serve --help`" if spec.registry == "synthetic_presets" else "`ninfer plugins list`"
    return f"{spec.help}; one of the registered `{spec.registry}` ({listed})"


def options_markdown(options: Options | None = None) -> str:
    """Every serve option as one Markdown table (option, default, meaning) in ServeConfig's order, ending in a newline.

    ``options`` defaults to :func:`serve_options`; passing another mapping renders that instead (tests use it).
    """
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for name, (attribute, spec) in (serve_options() if options is None else options).items():
        usage = _cell(option_usage(name, spec))
        rows.append(f"| `{usage}` | {_cell(option_default(name, attribute, spec))} | {_cell(option_meaning(spec))} |")
    return "\n".join(rows) + "\n"


def _block_span(text: str) -> tuple[int, int]:
    start = text.index(BEGIN + "\n") + len(BEGIN) + 1
    return start, text.index(END, start)


def documented_block(text: str) -> str:
    """The lines of ``text`` between the :data:`BEGIN` line and the :data:`END` marker (ValueError without them)."""
    start, end = _block_span(text)
    return text[start:end]


def replace_block(text: str, options: Options | None = None) -> str:
    """``text`` with the lines between the :data:`BEGIN` line and :data:`END` replaced by :func:`options_markdown`."""
    start, end = _block_span(text)
    return text[:start] + options_markdown(options) + text[end:]


def main(argv: list[str] | None = None) -> None:
    """``python -m ninfer.core.options_doc FILE...``: rewrite the options block of each FILE in place."""
    for path in map(Path, sys.argv[1:] if argv is None else argv):
        path.write_text(replace_block(path.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main()
