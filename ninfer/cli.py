"""The ``ninfer`` command line: serve, bench (and bench serve), plugins list, artifact inspect, make-tiny, convert.

Every error that escapes a command is one line ``Error: <message>`` on stderr: exit status 2 for usage and
configuration errors, 1 for everything else ninfer raises on purpose. The plugin manager is loaded once, lazily,
the first time a command (or its ``--help``) needs the registries; ``ctx.obj`` may carry a prepared one.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections import Counter
from typing import Any, Callable, Mapping, NoReturn, Sequence

import click

from ninfer import __version__
from ninfer.bench.engine import bench_command
from ninfer.bench.serve import serve_command as bench_serve_command
from ninfer.core.config import ServeConfig, option_flag, registry_choices, serve_options
from ninfer.core.errors import ArtifactError, ConfigError, NinferError
from ninfer.core.plugins import PluginManager, process_plugin_manager

_ARGV_KEY = "ninfer.argv"
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 110}


# -- plugin manager and lazy choices ---------------------------------------------------------------


def plugin_manager(ctx: click.Context | None = None) -> PluginManager:
    """The invocation's plugin manager: ``ctx.obj`` of the root context, loaded on first use."""
    ctx = ctx or click.get_current_context(silent=True)
    if ctx is None:
        return process_plugin_manager()
    root = ctx.find_root()
    if root.obj is None:
        root.obj = process_plugin_manager()
    return root.obj


class RegistryChoice(click.Choice):
    """A choice among the names of one registry table (``kv_dtypes``, ``speculative_backends``...).

    The names are read when click first needs them, so ``--help`` and parsing see third-party plugins.
    """

    def __init__(self, registry: str) -> None:
        self.registry = registry
        super().__init__(())

    @property
    def choices(self) -> tuple[str, ...]:  # type: ignore[override]
        return registry_choices(plugin_manager().registries, self.registry)

    @choices.setter
    def choices(self, _value: Sequence[str]) -> None:
        """Choices always come from the registry; click's constructor assignment is ignored."""


# -- the group and its error policy ----------------------------------------------------------------


def _fail(message: str, status: int) -> NoReturn:
    click.echo(f"Error: {' '.join(message.split())}", err=True)
    sys.exit(status)


class NinferGroup(click.Group):
    """A click group that reports every error as one ``Error:`` line with a meaningful exit status."""

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any):
        raw = (info_name or "ninfer", *args)
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta[_ARGV_KEY] = raw
        return ctx

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, *a: Any, **kw: Any) -> Any:
        kw["standalone_mode"] = False
        try:
            status = super().main(args, prog_name, *a, **kw)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            _fail(exc.format_message(), exc.exit_code)
        except ConfigError as exc:
            _fail(exc.message, 2)
        except NinferError as exc:
            _fail(exc.message, 1)
        except (click.Abort, KeyboardInterrupt, EOFError):
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(status if isinstance(status, int) else 0)


@click.group(name="ninfer", cls=NinferGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="ninfer", message="%(prog)s %(version)s")
def cli() -> None:
    """ninfer: a plugin-driven LLM inference server for hybrid Gated-DeltaNet Qwen models."""


def main(args: Sequence[str] | None = None) -> None:
    """Console-script entry point (``ninfer = ninfer.cli:main``)."""
    cli.main(args=args, prog_name="ninfer")


# -- serve -----------------------------------------------------------------------------------------


def _serve_param(name: str, default: Any, spec: Any) -> click.Option:
    flag = option_flag(name)
    if spec.kind == "flag":
        return click.Option([flag], is_flag=True, default=None, help=spec.help)
    if spec.registry is not None:
        value_type: click.ParamType = RegistryChoice(spec.registry)
    elif spec.choices:
        value_type = click.Choice(spec.choices, case_sensitive=False)
    else:
        value_type = {"int": click.INT, "float": click.FLOAT, "text": click.STRING}[spec.kind]
    shown = spec.default_text if spec.default_text is not None else str(default)
    return click.Option([flag], type=value_type, default=None, metavar=spec.metavar, help=f"{spec.help}  [default: {shown}]")


def _serve_command() -> click.Command:
    params: list[click.Parameter] = [click.Argument(["artifact"], required=False)]
    params += [_serve_param(name, attribute.default, spec) for name, (attribute, spec) in serve_options().items()]
    params.append(
        click.Option(
            ["--print-config"], is_flag=True, help="print the resolved configuration as JSON (API key redacted) and exit"
        )
    )
    return click.Command(
        "serve",
        params=params,
        callback=click.pass_context(_serve),
        context_settings=CONTEXT_SETTINGS,
        help="Serve ARTIFACT (a .ninfer file or Hugging Face directory; the built-in demo model when omitted) "
        "over OpenAI- and Anthropic-compatible HTTP endpoints.",
        short_help="Serve a model over OpenAI- and Anthropic-compatible HTTP.",
    )


def _serve(ctx: click.Context, artifact: str | None, print_config: bool, **options: Any) -> None:
    manager = plugin_manager(ctx)
    config = ServeConfig.build(
        manager.registries, artifact=artifact, argv=ctx.meta.get(_ARGV_KEY, ()), environ=os.environ, **options
    )
    if print_config:
        click.echo(json.dumps(config.to_dict(), indent=2))
        return
    importlib.import_module("ninfer.server.serve").serve(config, manager)  # lazily: keeps --help and parsing light


cli.add_command(_serve_command())


# -- bench -----------------------------------------------------------------------------------------


class BenchGroup(click.Group):
    """``ninfer bench``: an invocation whose first argument names a subcommand (``serve``) or asks for help runs
    that; every other one (``ninfer bench [ARTIFACT] [options]``, ``--synthetic NAME``) is the engine benchmark
    ``engine``, parsed and run exactly as the plain command. An artifact literally named like a subcommand needs a
    path prefix (``./serve``)."""

    def __init__(self, engine: click.Command, commands: Sequence[click.Command], **attrs: Any) -> None:
        super().__init__(engine.name, commands=commands, **attrs)
        self.engine = engine

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None, **extra: Any):
        help_names = parent.help_option_names if parent is not None else CONTEXT_SETTINGS["help_option_names"]
        if args and (args[0] in self.commands or args[0] in help_names):
            return super().make_context(info_name, args, parent=parent, **extra)
        return self.engine.make_context(info_name, args, parent=parent, **extra)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] [ARTIFACT]")
        for name in self.list_commands(ctx):
            formatter.write_usage(ctx.command_path, f"{name} [OPTIONS]", prefix="   or: ")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The engine benchmark's options, then the subcommands."""
        self.engine.format_options(click.Context(self.engine, info_name=ctx.info_name, parent=ctx.parent), formatter)
        self.format_commands(ctx, formatter)


cli.add_command(
    BenchGroup(
        bench_command,
        [bench_serve_command],
        help="Benchmarks. `ninfer bench [ARTIFACT] [options]` (the options below) runs synthetic prompts through "
        "the resident Engine in this process, or with --synthetic NAME times a random-weight model of a real shape; "
        "`ninfer bench serve [options]` is a client benchmark of a running server over HTTP (Chat Completions, "
        "Responses or Messages; `ninfer bench serve --help`).",
        short_help="Benchmark the engine offline (ARTIFACT, --synthetic) or a running server (serve).",
    )
)


# -- plugins list ----------------------------------------------------------------------------------


@cli.group()
def plugins() -> None:
    """Inspect installed plugins."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
@click.pass_context
def plugins_list(ctx: click.Context, as_json: bool) -> None:
    """List every plugin, its distribution and version, and what it registers."""
    rows = plugin_manager(ctx).describe()
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    table = [("PLUGIN", "DISTRIBUTION", "VERSION", "REGISTERS")]
    for row in rows:
        items = [_registered_item(kind, item) for kind, items in row["registers"].items() for item in items]
        first = (row["name"], row["distribution"], row["version"], items[0] if items else "(nothing)")
        table.append(first)
        table.extend(("", "", "", item) for item in items[1:])
    widths = [max(len(line[col]) for line in table) for col in range(3)]
    for line in table:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(line[:3], widths)) + "  " + line[3])


def _registered_item(kind: str, item: Mapping[str, Any]) -> str:
    if "draft_tokens" in item:
        low, high = item["draft_tokens"]
        detail = f"draft tokens {low}..{high}"
    elif "bytes_per_token_per_head_dim" in item:
        detail = f"{item['bytes_per_token_per_head_dim']:g} bytes/token/head-dim"
    elif "architectures" in item:
        detail = ", ".join(item["architectures"])
    else:
        detail = ", ".join(item.get("routes", ()))
    availability = "available" if item.get("available") else "not yet available"
    return f"{kind} {item['name']} ({detail}; {availability})"


# -- artifact inspect ------------------------------------------------------------------------------


@cli.group()
def artifact() -> None:
    """Work with .ninfer artifacts."""


@artifact.command("inspect")
@click.argument("file")
@click.option("--json", "as_json", is_flag=True, help="print a JSON object instead of text")
@click.pass_context
def artifact_inspect(ctx: click.Context, file: str, as_json: bool) -> None:
    """Show what FILE (a .ninfer artifact or Hugging Face directory) contains."""
    from ninfer.core.artifact.source import open_model_source

    registries = plugin_manager(ctx).registries
    with open_model_source(file, registries) as opened:
        summary = describe_artifact(opened, registries)
    if as_json:
        click.echo(json.dumps({"path": file, **summary}, indent=2))
    else:
        click.echo(_format_summary(file, summary))


def describe_artifact(opened: Any, registries: Any) -> dict[str, Any]:
    """A JSON-ready summary of an opened artifact (identity, family, config numbers, weights, resources)."""
    manifest = opened.manifest
    try:
        family: str | None = registries.family_for(manifest).name
    except ArtifactError:
        family = None
    text = manifest.text_config
    sizes = [opened.tensor_info(name).nbytes for name in opened.tensor_names]
    return {
        "model_id": manifest.identity.model_id,
        "family": family,
        "architecture": manifest.architecture,
        "model_type": manifest.text_model_type,
        "format": {"name": manifest.format, "version": manifest.format_version},
        "config": {
            "num_hidden_layers": text.get("num_hidden_layers"),
            "layer_kinds": dict(Counter(_layer_types(text))),
            "hidden_size": text.get("hidden_size"),
            "num_attention_heads": text.get("num_attention_heads"),
            "num_key_value_heads": text.get("num_key_value_heads"),
            "head_dim": text.get("head_dim"),
            "vocab_size": text.get("vocab_size"),
            "num_experts": text.get("num_experts"),
            "num_experts_per_tok": text.get("num_experts_per_tok"),
            "max_position_embeddings": text.get("max_position_embeddings"),
            "vision": "vision_config" in manifest.config,
        },
        "weight_format": dict(manifest.weight_format),
        "companions": list(manifest.companions),
        "generation_defaults": dict(manifest.generation_defaults),
        "resources": {name: len(opened.resource(name)) for name in opened.resource_names},
        "tensors": {"count": len(sizes), "total_bytes": sum(sizes)},
    }


def _layer_types(text_config: Mapping[str, Any]) -> list[str]:
    """The per-layer kinds: the explicit ``layer_types`` list, else every ``full_attention_interval``-th layer."""
    explicit = text_config.get("layer_types")
    if explicit:
        return list(explicit)
    layers = text_config.get("num_hidden_layers")
    if not isinstance(layers, int):
        return []
    interval = text_config.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def format_bytes(count: int) -> str:
    """A byte count in binary units: ``1536`` -> ``1.5 KiB``."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{count} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _format_summary(path: str, summary: Mapping[str, Any]) -> str:
    config = summary["config"]
    kinds = ", ".join(f"{count} {kind}" for kind, count in config["layer_kinds"].items())
    heads = (
        f"{config['num_attention_heads']} query / {config['num_key_value_heads']} KV, head_dim {config['head_dim']}"
    )
    weight_format = ", ".join(f"{key} {value}" for key, value in summary["weight_format"].items())
    defaults = " ".join(f"{key}={value}" for key, value in summary["generation_defaults"].items())
    resources = ", ".join(f"{name} ({format_bytes(size)})" for name, size in summary["resources"].items())
    tensors = summary["tensors"]
    lines = [
        ("artifact", path),
        ("model id", summary["model_id"]),
        ("family", summary["family"] or "(no registered family recognizes this architecture)"),
        ("architecture", f"{summary['architecture']} (model_type {summary['model_type']})"),
        ("format", f"{summary['format']['name']} v{summary['format']['version']}"),
        ("layers", f"{config['num_hidden_layers']} ({kinds})" if kinds else str(config["num_hidden_layers"])),
        ("hidden size", str(config["hidden_size"])),
        ("attention heads", heads),
        ("vocab", str(config["vocab_size"])),
    ]
    if config["num_experts"] is not None:
        lines.append(("experts", f"{config['num_experts']} ({config['num_experts_per_tok']} per token)"))
    if config["max_position_embeddings"] is not None:
        lines.append(("max positions", str(config["max_position_embeddings"])))
    lines += [
        ("vision tower", "yes" if config["vision"] else "no"),
        ("weight format", weight_format or "-"),
        ("companions", ", ".join(summary["companions"]) or "none"),
        ("generation", defaults or "-"),
        ("resources", resources or "none"),
        ("tensors", f"{tensors['count']} tensors, {format_bytes(tensors['total_bytes'])}"),
    ]
    width = max(len(label) for label, _ in lines)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in lines)


# -- make-tiny -------------------------------------------------------------------------------------


@cli.command("make-tiny")
@click.argument("out")
@click.option("--family", type=RegistryChoice("model_families"), default="qwen3_5", show_default=True,
              help="registered model family to build")
@click.option("--mtp", is_flag=True, help="add MTP companion weights")
@click.option("--dflash", is_flag=True, help="add DFlash companion weights")
@click.option("--dflash2", is_flag=True, help="add DFlash2 companion weights")
@click.option("--template", type=click.Choice(("qwen3_6", "qwen3_8")), default="qwen3_6", show_default=True,
              help="which Qwen chat template to embed")
@click.option("--seed", type=int, default=0, show_default=True, help="random-weight seed")
@click.pass_context
def make_tiny(ctx: click.Context, out: str, **options: Any) -> None:
    """Write a tiny random-weight artifact of a real architecture to OUT (for tests and demos)."""
    tiny = importlib.import_module("ninfer.core.artifact.tiny")
    path = tiny.write_tiny_artifact(out, tiny.TinyOptions(**options), plugin_manager(ctx).registries)
    click.echo(f"wrote {path}")


# -- convert ---------------------------------------------------------------------------------------


class _ProgressLine:
    """A one-line, rewritten-in-place byte progress display on a terminal."""

    def __init__(self) -> None:
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        percent = 100.0 * done / total if total else 100.0
        click.echo(f"\rconverting {format_bytes(done)} / {format_bytes(total)} ({percent:.0f}%)", nl=False, err=True)
        self.shown = True

    def finish(self) -> None:
        if self.shown:
            click.echo(err=True)


@cli.command()
@click.argument("hf_dir")
@click.option("-o", "--output", "out", required=True, help="the .ninfer file to write")
@click.option("--model-id", default=None, help="identity.model_id to record [default: the directory name]")
@click.option("--dflash", "dflash_dir", default=None, metavar="DIR",
              help="a DFlash drafter directory whose weights to carry along (dflash.*)")
@click.option("--dflash2", "dflash2_dir", default=None, metavar="DIR",
              help="a DFlash2 drafter directory whose weights to carry along (dflash2.*)")
@click.option("--quantize", type=click.Choice(("fp8", "nvfp4")), default=None,
              help="quantize the projection weights of a dense checkpoint (block-wise FP8 128x128, or NVFP4)")
def convert(hf_dir: str, out: str, model_id: str | None, dflash_dir: str | None, dflash2_dir: str | None,
            quantize: str | None) -> None:
    """Convert a Hugging Face checkpoint directory HF_DIR into one .ninfer artifact."""
    converter = importlib.import_module("ninfer.core.artifact.convert")
    progress: Callable[[int, int], None] | None = _ProgressLine() if sys.stderr.isatty() else None
    drafters = {name: path for name, path in (("dflash", dflash_dir), ("dflash2", dflash2_dir)) if path}
    try:
        path = converter.convert_checkpoint(
            hf_dir, out, model_id=model_id, progress=progress, drafters=drafters, quantize=quantize
        )
    finally:
        if isinstance(progress, _ProgressLine):
            progress.finish()
    click.echo(f"wrote {path}")
