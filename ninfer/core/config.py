"""ServeConfig: every ``ninfer serve`` option, its documented default and its validation.

Each option is one field of the frozen :class:`ServeConfig`; its :class:`OptionSpec` (field metadata) carries the
help text, metavar and per-value check, so the CLI builds its ``serve`` options from this table and can never
miss one. :meth:`ServeConfig.build` is the one constructor that applies defaults, resolves derived defaults and
checks every cross-option rule; each problem is a :class:`ConfigError` whose one-line message names the flag.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Mapping, Sequence

import attrs

from ninfer.core.artifact.synthetic import SYNTHETIC_PRESETS, synthetic_family, synthetic_presets
from ninfer.core.errors import ConfigError
from ninfer.core.request import SAMPLER_FIELDS, RequestPolicy

if TYPE_CHECKING:  # pragma: no cover
    from ninfer.core.plugins import Registries

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "critical", "off")
WEIGHT_DTYPES = ("auto", "bfloat16", "float16", "float32")
HOSTED_TOOL_POLICIES = ("ignore", "reject")
AUTO = "auto"
REDACTED = "<redacted>"
#: The environment variable that supplies the API key when neither --api-key nor --api-key-file is given.
API_KEY_ENV = "NINFER_API_KEY"
#: An --api-key-file holds one key; anything larger is the wrong file (and is not read whole).
API_KEY_FILE_MAX_BYTES = 4096
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
#: The explicit context-cache flags that ``--no-prefix-reuse`` (root-only mode) cannot be combined with.
CONTEXT_CACHE_OPTIONS = (
    "device_state_slots",
    "host_state_slots",
    "host_kv_mib",
    "max_private_continuations",
    "max_shared_prefixes",
    "max_long_anchors_per_continuation",
    "context_cost_presets",
)
_OPTION = "ninfer.option"

#: A per-value check: ``(field name, given value, registries) -> normalized value``; raises ConfigError.
Check = Callable[[str, Any, "Registries"], Any]


def option_flag(name: str) -> str:
    """The command-line spelling of field ``name``: ``max_context`` -> ``--max-context``."""
    return "--" + name.replace("_", "-")


def _error(name: str, problem: str) -> ConfigError:
    return ConfigError(f"{option_flag(name)} {problem}", param=name)


@attrs.frozen
class OptionSpec:
    """How one serve option is spelled, documented and checked.

    ``kind`` is ``flag`` (boolean switch), ``int``, ``float`` or ``text``; ``choices`` lists fixed choices and
    ``registry`` names a :class:`Registries` table whose keys are the choices, or :data:`SYNTHETIC_PRESETS` (the
    presets of every model family; :func:`registry_choices` reads either). ``default_text`` documents a default
    that is not a plain value (derived or unset).
    """

    help: str
    kind: Literal["flag", "int", "float", "text"]
    check: Check
    metavar: str | None = None
    default_text: str | None = None
    choices: tuple[str, ...] = ()
    registry: str | None = None


# -- per-value checks ------------------------------------------------------------------------------


def _range_text(low: float | None, high: float | None, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"{low} < value <= {high}" if low_open else f"{low}..{high}"
    return f">= {low}" if high is None else f"<= {high}"


def _integer(low: int | None = None, high: int | None = None) -> Check:
    def check(name: str, value: Any, _registries: Registries) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(name, f"expects an integer, got {value!r}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise _error(name, f"{value} is out of range (expected {_range_text(low, high)})")
        return value

    return check


def _real(low: float, high: float, *, low_open: bool = False) -> Check:
    def check(name: str, value: Any, _registries: Registries) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _error(name, f"expects a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number):
            raise _error(name, f"must be a finite number, got {value!r}")
        if number > high or number < low or (low_open and number == low):
            raise _error(name, f"{value} is out of range (expected {_range_text(low, high, low_open)})")
        return number

    return check


def _text(name: str, value: Any, _registries: Registries) -> str:
    if not isinstance(value, str):
        raise _error(name, f"expects a string, got {value!r}")
    if not value.strip():
        raise _error(name, "must not be empty")
    return value


def _flag(name: str, value: Any, _registries: Registries) -> bool:
    if not isinstance(value, bool):
        raise _error(name, f"is a switch and takes no value, got {value!r}")
    return value


def _one_of(choices: tuple[str, ...]) -> Check:
    def check(name: str, value: Any, _registries: Registries) -> str:
        for choice in choices:
            if isinstance(value, str) and value.lower() == choice:
                return choice
        raise _error(name, f"{value!r} is not one of: {', '.join(choices)}")

    return check


def _synthetic_preset(name: str, value: Any, registries: Registries) -> str:
    preset = _text(name, value, registries)
    synthetic_family(preset, registries)
    return preset


def _kv_dtype(name: str, value: Any, registries: Registries) -> str:
    return registries.kv_dtype(value).name


def _speculative_backend(name: str, value: Any, registries: Registries) -> str:
    return registries.speculative_backend(value).name


def _kv_capacity(name: str, value: Any, _registries: Registries) -> int | str:
    if isinstance(value, str):
        text = value.strip().lower()
        if text == AUTO:
            return AUTO
        if not text.lstrip("+-").isdigit():
            raise _error(name, f"expects a token count or 'auto', got {value!r}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _error(name, f"expects a token count or 'auto', got {value!r}")
    if value < 1:
        raise _error(name, f"{value} is out of range (expected a token count >= 1, or 'auto')")
    return value


def read_context_cost_presets(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``--context-cost-presets`` file: it must exist, be readable and hold one JSON object."""
    shown = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _error("context_cost_presets", f"{shown}: no such file") from None
    except IsADirectoryError:
        raise _error("context_cost_presets", f"{shown}: is a directory, expected a JSON file") from None
    except (OSError, UnicodeDecodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _error("context_cost_presets", f"{shown}: cannot be read ({detail})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _error(
            "context_cost_presets", f"{shown}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}"
        ) from None
    if not isinstance(data, dict):
        raise _error("context_cost_presets", f"{shown}: must hold a JSON object, found {type(data).__name__}")
    return data


def _path_text(name: str, value: Any, registries: Registries) -> str:
    return _text(name, os.fspath(value) if isinstance(value, os.PathLike) else value, registries)


def _context_cost_presets(name: str, value: Any, registries: Registries) -> str:
    path = _path_text(name, value, registries)
    read_context_cost_presets(path)
    return path


def read_api_key_file(path: str) -> str:
    """The key an ``--api-key-file`` holds: its text with surrounding whitespace (the trailing newline) stripped.

    Errors name the path and the problem, never the file's content."""
    try:
        with open(path, "rb") as file:
            data = file.read(API_KEY_FILE_MAX_BYTES + 1)
    except FileNotFoundError:
        raise _error("api_key_file", f"{path}: no such file") from None
    except IsADirectoryError:
        raise _error("api_key_file", f"{path}: is a directory, expected a file holding the key") from None
    except OSError as exc:
        raise _error("api_key_file", f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    if len(data) > API_KEY_FILE_MAX_BYTES:
        raise _error("api_key_file", f"{path}: is larger than {API_KEY_FILE_MAX_BYTES} bytes, expected just the key")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _error("api_key_file", f"{path}: is not UTF-8 text") from None
    return _one_line_key(text, f"{option_flag('api_key_file')} {path}", "api_key_file")


def _one_line_key(text: str, source: str, param: str) -> str:
    """``text`` stripped of surrounding whitespace (clients' header values are stripped too, so a key could never
    match with it); it must leave one non-empty line."""
    key = text.strip()
    if not key:
        raise ConfigError(f"{source}: is empty, expected the API key", param=param)
    if len(key.splitlines()) != 1:
        raise ConfigError(f"{source}: must hold the API key on a single line", param=param)
    return key


def _request_log(name: str, value: Any, registries: Registries) -> str:
    path = _path_text(name, value, registries)
    target = Path(path)
    if target.is_dir():
        raise _error(name, f"{path}: is a directory, expected a file path")
    parent = target.parent
    if not parent.is_dir():
        raise _error(name, f"{path}: parent directory {os.fspath(parent)!r} does not exist")
    if not os.access(target if target.exists() else parent, os.W_OK):
        raise _error(name, f"{path}: is not writable")
    return path


# -- the option table ------------------------------------------------------------------------------


def _option(
    default: Any = attrs.NOTHING,
    *,
    help: str,
    kind: Literal["flag", "int", "float", "text"],
    check: Check,
    metavar: str | None = None,
    default_text: str | None = None,
    choices: tuple[str, ...] = (),
    registry: str | None = None,
    repr: Callable[[Any], str] | bool = True,
) -> Any:
    spec = OptionSpec(help, kind, check, metavar, default_text, choices, registry)
    return attrs.field(default=default, repr=repr, metadata={_OPTION: spec})


def _int(default: Any, low: int | None, high: int | None = None, *, help: str, **extra: Any) -> Any:
    return _option(default, help=help, kind="int", check=_integer(low, high), metavar="N", **extra)


def _float(low: float, high: float, *, help: str, low_open: bool = False) -> Any:
    check = _real(low, high, low_open=low_open)
    return _option(None, help=help, kind="float", check=check, metavar="F", default_text="unset")


def _switch(help: str) -> Any:
    return _option(False, help=help, kind="flag", check=_flag)


@attrs.frozen(kw_only=True)
class ServeConfig:
    """Every ``ninfer serve`` option, resolved. Build it with :meth:`ServeConfig.build`.

    ``artifact`` is the model path (``None``: the ``synthetic`` preset when one is given, else the built-in demo);
    ``kv_capacity`` is a token count or the string ``"auto"`` (resolved by the engine); unset sampler overrides are
    ``None``; ``api_key`` is the effective key from :func:`resolve_api_key` and ``api_key_source`` names where it
    came from; ``argv`` is the invocation with the API-key value replaced by ``<redacted>``.
    """

    artifact: str | None = None
    synthetic: str | None = _option(
        None,
        help="instead of ARTIFACT: a random-weight model of this named real configuration, served as "
        "synthetic-NAME (no checkpoint: weights drawn on the device in the load dtype; the family's real tokenizer "
        "and chat template); the presets of every model family",
        kind="text",
        check=_synthetic_preset,
        registry=SYNTHETIC_PRESETS,
        default_text="off",
    )
    synthetic_seed: int = _int(0, 0, INT64_MAX, help="seed of the --synthetic weights (same seed, same weights)")
    host: str = _option("127.0.0.1", help="listen address", kind="text", check=_text, metavar="H")
    port: int = _int(8080, 1, 65535, help="listen port")
    header_timeout_ms: int = _int(
        10000,
        1,
        3_600_000,
        help="total time a request's headers may take, counted from the connection opening or from the first byte "
        "after the previous response; a connection still sending them is closed (keep-alive idle time is not "
        "counted); also the longest pause while a request body arrives (then 408 request_timeout)",
    )
    api_key: str | None = _option(
        None,
        help="required bearer or x-api-key value; a flag's value is visible in the process list, so prefer "
        f"--api-key-file or {API_KEY_ENV} (read when neither flag is given)",
        kind="text",
        check=_text,
        metavar="KEY",
        default_text="unset",
        repr=lambda key: repr(None if key is None else REDACTED),
    )
    api_key_file: str | None = _option(
        None,
        help="file holding the required key (surrounding whitespace stripped; not with --api-key)",
        kind="text",
        check=_path_text,
        metavar="FILE",
        default_text="unset",
    )
    model_id: str | None = _option(
        None,
        help="override the public OpenAI model alias",
        kind="text",
        check=_text,
        metavar="ID",
        default_text="artifact identity.model_id",
    )
    max_context: int = _int(8192, 1, help="logical context ceiling of each sequence")
    kv_capacity: int | str = _option(
        help="explicit shared Main Text KV capacity, or maximize it from remaining GPU memory",
        kind="text",
        check=_kv_capacity,
        metavar="N|auto",
        default_text="--max-context",
    )
    max_concurrency: int = _int(1, 1, 8, help="maximum admitted requests; valid range 1..8")
    max_pending_requests: int = _int(16, 0, help="additional requests allowed to wait for admission")
    pending_timeout_ms: int = _int(30000, 1, help="maximum preparation-plus-admission wait")
    prefill_chunk: int = _int(1024, 1, help="text-prefill chunk")
    log_stats_interval_ms: int = _int(5000, 0, help="aggregate throughput report interval; 0 disables it")
    log_level: str = _option(
        "info", help="pretty stderr verbosity", kind="text", check=_one_of(LOG_LEVELS), choices=LOG_LEVELS
    )
    device: int = _int(0, 0, help="CUDA device index")
    context_cost_presets: str | None = _option(
        None,
        help="optional runtime context-cost preset registry (a JSON object)",
        kind="text",
        check=_context_cost_presets,
        metavar="FILE",
        default_text="generic + compiled defaults",
    )
    max_request_mib: int = _int(384, 1, help="body-size limit before JSON parsing")
    media_cache_mib: int = _int(1024, 0, help="LRU-retained prepared BF16 media payloads; 0 disables retention")
    media_live_mib: int = _int(2048, 1, help="all live prepared BF16 media payloads")
    media_preprocess_threads: int = _int(
        0, 0, 1024, help="bounded media preprocessing workers; 0 selects at most 16 from host concurrency"
    )
    request_log_jsonl: str | None = _option(
        None,
        help="append full-precision server/request records",
        kind="text",
        check=_request_log,
        metavar="FILE",
        default_text="disabled",
    )
    response_store_max_records: int = _int(1024, 1, help="maximum locally retained Responses objects")
    response_store_max_mib: int = _int(256, 1, help="total local Response envelope/Item/context budget")
    kv_dtype: str = _option("bf16", help="KV-cache storage", kind="text", check=_kv_dtype, registry="kv_dtypes")
    spec: str | None = _option(
        None,
        help="speculative backend",
        kind="text",
        check=_speculative_backend,
        registry="speculative_backends",
        default_text="off",
    )
    draft_tokens: int | None = _int(
        None, None, help="draft tokens per round; the range comes from --spec (MTP 1..5; DFlash/DFlash2 1..15)",
        default_text="unset",
    )
    lm_head_draft: bool = _switch("optimized proposal head")
    default_max_tokens: int = _int(8192, 1, help="output limit when omitted by a request")
    default_thinking_budget: int | None = _int(
        None, 1, help="positive thinking cap inherited by thinking-enabled requests", default_text="unset"
    )
    vision: bool = _switch("enable media input and load Vision GPU allocations")
    no_cuda_graph: bool = _switch("disable CUDA Graph decode graphs (on by default)")
    no_prefix_reuse: bool = _switch("disable compatible-prefix caching (prefix reuse is on by default)")
    device_state_slots: int = _int(
        attrs.NOTHING,
        0,
        help="extra Device checkpoint StateImages beyond the active-lane guarantee",
        default_text="--max-concurrency",
    )
    host_state_slots: int = _int(8, 0, help="pinned Host StateImage capacity")
    host_kv_mib: int = _int(8192, 0, help="shared pinned Host Main/Backend KV byte capacity in MiB")
    max_private_continuations: int = _int(
        attrs.NOTHING, 0, help="private continuation descriptor capacity", default_text="2 * --max-concurrency"
    )
    max_shared_prefixes: int = _int(
        attrs.NOTHING,
        0,
        help="Engine-wide shared stable-prefix descriptor capacity",
        default_text="max(--max-concurrency, 4)",
    )
    max_long_anchors_per_continuation: int = _int(2, 0, help="private long-anchor limit per continuation")
    no_thinking: bool = _switch("disable thinking by default (thinking is on by default)")
    preserve_thinking: bool = _switch("preserve closed-turn assistant reasoning by default")
    tolerant_tool_calls: bool = _switch("recover complete Qwen calls with malformed wrapper/suffix output")
    hosted_tools: str = _option(
        "ignore",
        help="Responses tools the server cannot run (web_search and other OpenAI-hosted types): ignore leaves them "
        "out of the effective tool set, reject fails the request",
        kind="text",
        check=_one_of(HOSTED_TOOL_POLICIES),
        choices=HOSTED_TOOL_POLICIES,
    )
    strict_effort: bool = _switch("reject a reasoning effort the loaded template does not expose instead of mapping "
                                  "it onto the template's tiers")
    cors: bool = _switch("permissive browser CORS headers")
    temperature: float | None = _float(0.0, 2.0, help="process-level temperature override")
    top_p: float | None = _float(0.0, 1.0, low_open=True, help="process-level top-p override")
    top_k: int | None = _int(
        None, 0, 20, help="process-level top-k override (0..20; zero selects the top-20 cap)", default_text="unset"
    )
    min_p: float | None = _float(0.0, 1.0, help="process-level min-p override")
    presence_penalty: float | None = _float(-2.0, 2.0, help="process-level presence-penalty override")
    frequency_penalty: float | None = _float(-2.0, 2.0, help="process-level frequency-penalty override")
    seed: int | None = _int(
        None,
        INT64_MIN,
        INT64_MAX,
        help="fixed seed when a request omits one (signed 64-bit)",
        default_text="fresh random seed per request",
    )
    greedy: bool = _switch("force exact argmax for all requests")
    dtype: str = _option(
        "auto",
        help="dtype the weights are loaded in; auto lets the model family choose for the artifact and device",
        kind="text",
        check=_one_of(WEIGHT_DTYPES),
        choices=WEIGHT_DTYPES,
    )
    api_key_source: str | None = None
    argv: tuple[str, ...] = ()

    @classmethod
    def build(
        cls,
        registries: Registries,
        *,
        artifact: str | os.PathLike[str] | None = None,
        argv: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
        **options: Any,
    ) -> ServeConfig:
        """Apply defaults, resolve derived defaults and validate every option and cross-option rule.

        ``options`` are keyed by field name; an option that is absent or ``None`` counts as not given, so a
        rule about explicit flags (``--no-prefix-reuse``) sees exactly the options the user spelled out.
        ``environ`` is the environment the API key may come from (the CLI passes ``os.environ``; None: none).
        """
        specs = serve_options()
        unknown = sorted(set(options) - set(specs))
        if unknown:
            raise ConfigError(f"unknown serve option {option_flag(unknown[0])}", param=unknown[0])
        given = {name: value for name, value in options.items() if value is not None}
        values: dict[str, Any] = {}
        for name, (attribute, spec) in specs.items():
            if name in given:
                values[name] = spec.check(name, given[name], registries)
            elif attribute.default is not attrs.NOTHING:
                values[name] = attribute.default
        _resolve_derived_defaults(values, given)
        artifact_path = None if artifact is None else os.fspath(artifact)
        _check_combinations(values, given, registries, artifact_path)
        values["api_key"], source = resolve_api_key(values["api_key"], values["api_key_file"], environ or {})
        return cls(artifact=artifact_path, api_key_source=source, argv=redact_argv(argv), **values)

    @property
    def request_policy(self) -> RequestPolicy:
        """The request rules these options select (output default, context ceiling, sampler flags, greedy)."""
        overrides = {name: getattr(self, name) for name in (*SAMPLER_FIELDS, "seed")}
        return RequestPolicy(self.max_context, self.default_max_tokens, overrides, self.greedy)

    def to_dict(self, *, redact: bool = True) -> dict[str, Any]:
        """A JSON-ready dict of every field; ``redact`` replaces a set API key with ``<redacted>``."""
        data = attrs.asdict(self)
        if redact and self.api_key is not None:
            data["api_key"] = REDACTED
        return data


def serve_options() -> dict[str, tuple[attrs.Attribute, OptionSpec]]:
    """Every serve option in documented order: field name -> (attrs attribute, its OptionSpec)."""
    return {
        attribute.name: (attribute, attribute.metadata[_OPTION])
        for attribute in attrs.fields(ServeConfig)
        if _OPTION in attribute.metadata
    }


def registry_choices(registries: Registries, registry: str) -> tuple[str, ...]:
    """The choices an option's ``registry`` names: a :class:`Registries` table's keys, or the synthetic presets of
    every model family for :data:`SYNTHETIC_PRESETS`."""
    if registry == SYNTHETIC_PRESETS:
        return tuple(synthetic_presets(registries))
    return tuple(getattr(registries, registry))


def resolve_api_key(flag: str | None, path: str | None, environ: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The effective API key and where it came from; the one place that decides it.

    Precedence: ``--api-key``, else the contents of ``--api-key-file``, else :data:`API_KEY_ENV`, else no key.
    Giving both flags is a usage error (two explicit keys are a mistake, not a precedence question); the
    environment is only the fallback. A set but empty variable is an error rather than "no key", so a failed
    secret lookup cannot silently start an open server.
    """
    if flag is not None and path is not None:
        raise ConfigError("--api-key and --api-key-file are mutually exclusive: give one", param="api_key_file")
    if flag is not None:
        return flag, option_flag("api_key")
    if path is not None:
        return read_api_key_file(path), option_flag("api_key_file")
    if API_KEY_ENV in environ:
        return _one_line_key(environ[API_KEY_ENV], f"environment variable {API_KEY_ENV}", "api_key"), API_KEY_ENV
    return None, None


def redact_argv(argv: Iterable[str]) -> tuple[str, ...]:
    """``argv`` with the value of ``--api-key KEY`` / ``--api-key=KEY`` replaced by ``<redacted>``."""
    redacted: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            redacted.append(REDACTED)
            hide_next = False
        elif arg == "--api-key":
            redacted.append(arg)
            hide_next = True
        elif arg.startswith("--api-key="):
            redacted.append("--api-key=" + REDACTED)
        else:
            redacted.append(arg)
    return tuple(redacted)


# -- derived defaults and cross-option rules -------------------------------------------------------


def _resolve_derived_defaults(values: dict[str, Any], given: dict[str, Any]) -> None:
    concurrency = values["max_concurrency"]
    derived = {
        "kv_capacity": values["max_context"],
        "device_state_slots": concurrency,
        "max_private_continuations": 2 * concurrency,
        "max_shared_prefixes": max(concurrency, 4),
    }
    for name, value in derived.items():
        if name not in given:
            values[name] = value


def _check_combinations(
    values: dict[str, Any], given: dict[str, Any], registries: Registries, artifact: str | None
) -> None:
    if values["synthetic"] is not None and artifact is not None:
        raise ConfigError(
            f"--synthetic {values['synthetic']} and the ARTIFACT argument {artifact!r} are mutually exclusive: "
            "give one of them",
            param="synthetic",
        )
    if "synthetic_seed" in given and values["synthetic"] is None:
        raise ConfigError("--synthetic-seed requires --synthetic PRESET", param="synthetic_seed")
    if values["no_prefix_reuse"]:
        explicit = [option_flag(name) for name in CONTEXT_CACHE_OPTIONS if name in given]
        if explicit:
            raise ConfigError(
                f"--no-prefix-reuse cannot be combined with {', '.join(explicit)}: root-only mode keeps no "
                "context cache, so its capacity flags must be omitted",
                param="no_prefix_reuse",
            )
    capacity = values["kv_capacity"]
    if "kv_capacity" in given and capacity != AUTO and capacity < values["max_context"]:
        raise ConfigError(
            f"--kv-capacity {capacity} is smaller than --max-context {values['max_context']}: "
            "one full-length sequence could never fit",
            param="kv_capacity",
        )
    _check_speculation(values, registries)
    log_path = values["request_log_jsonl"]
    if log_path is not None and artifact is not None and os.path.realpath(log_path) == os.path.realpath(artifact):
        raise ConfigError(
            f"--request-log-jsonl {log_path} resolves to the model artifact; choose another file",
            param="request_log_jsonl",
        )


def _check_speculation(values: dict[str, Any], registries: Registries) -> None:
    spec, draft_tokens = values["spec"], values["draft_tokens"]
    if spec is None:
        choices = ", ".join(registries.speculative_backends)
        if draft_tokens is not None:
            raise ConfigError(f"--draft-tokens requires --spec (one of: {choices})", param="draft_tokens")
        if values["lm_head_draft"]:
            raise ConfigError(f"--lm-head-draft requires --spec (one of: {choices})", param="lm_head_draft")
        return
    backend = registries.speculative_backend(spec)
    if draft_tokens is None:
        raise ConfigError(
            f"--spec {spec} requires --draft-tokens N ({backend.min_draft_tokens}..{backend.max_draft_tokens})",
            param="spec",
        )
    backend.validate_draft_tokens(draft_tokens)
    if values["lm_head_draft"] and not backend.supports_lm_head_draft:
        raise ConfigError(
            f"--lm-head-draft cannot be combined with --spec {spec}: it drafts with the full LM head",
            param="lm_head_draft",
        )
