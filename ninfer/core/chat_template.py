"""Sandboxed chat-template rendering with the conventions Hugging Face transformers uses.

A :class:`ChatTemplate` compiles a Jinja chat template once, in an immutable sandbox configured the way
``transformers`` configures it (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, a non-escaping ``tojson``,
``raise_exception`` and ``strftime_now`` globals), so that a template renders here exactly as it does there.
:func:`detect_capabilities` resolves the prompt options a template understands from its text alone.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from typing import Any, Mapping, Sequence

import attrs
import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import jinja2.utils

from ninfer.core.errors import ArtifactError, InvalidRequestError

INVALID_PROMPT = "invalid_prompt"

# Reasoning-effort values a protocol may ask for (OpenAI's vocabulary without "none", which means "thinking off"
# and never reaches a template), weakest first. A template exposes the subset it accepts.
EFFORT_VOCABULARY: tuple[str, ...] = ("minimal", "low", "medium", "high", "xhigh", "max")

# A small conversation with a closed assistant turn, so history-thinking options change the rendering.
_PROBE_MESSAGES: tuple[Mapping[str, Any], ...] = (
    {"role": "system", "content": "probe system"},
    {"role": "user", "content": "probe question 1"},
    {"role": "assistant", "content": "probe answer 1", "reasoning_content": "probe reasoning 1"},
    {"role": "user", "content": "probe question 2"},
)


class TemplateRaisedError(jinja2.TemplateError):
    """Raised by a template's own ``raise_exception(message)``: the template rejects its input."""


@attrs.frozen
class TemplateCapabilities:
    """Prompt options a chat template understands, resolved once from its text.

    ``effort_levels`` are the accepted ``reasoning_effort`` values (weakest first; ``()`` when the template has no
    effort option) and ``default_effort`` the level an omitted effort renders as. ``preserve_thinking_default`` is what
    the template does with closed-turn reasoning when ``preserve_thinking`` is omitted.
    """

    effort_levels: tuple[str, ...] = ()
    default_effort: str | None = None
    supports_preserve_thinking: bool = False
    preserve_thinking_default: bool = False
    supports_enable_thinking: bool = False


def _raise_exception(message: Any) -> None:
    raise TemplateRaisedError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without HTML escaping; member order is kept unless ``sort_keys``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """A ``namespace()`` that refuses underscore-prefixed attribute names (no reach into Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's Namespace
        self, args = args[0], args[1:]
        values = dict(*args, **kwargs)
        for key in values:
            _SafeNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, key: str, value: Any) -> None:
        _SafeNamespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {key!r} on a namespace")


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env


class ChatTemplate:
    """A chat template compiled once in the sandbox.

    ``name`` labels error messages (e.g. the artifact resource path); ``variables`` are the names the template reads
    from its render context (``messages``, ``tools``, ``enable_thinking``, ...).
    """

    def __init__(self, source: str, *, name: str = "chat_template.jinja") -> None:
        if not isinstance(source, str):
            raise ArtifactError(f"chat template {name}: expected template text, got {type(source).__name__}")
        self.source = source
        self.name = name
        env = _environment()
        try:
            parsed = env.parse(source, name=name)
            self._template = env.from_string(parsed)
        except jinja2.TemplateSyntaxError as exc:
            raise ArtifactError(f"chat template {name}: syntax error at line {exc.lineno}: {exc.message}") from exc
        self.variables: frozenset[str] = frozenset(jinja2.meta.find_undeclared_variables(parsed))
        self._reserved_names = frozenset(env.globals)

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` (and ``tools``); extra keyword options become top-level template variables.

        The template rejecting its input (``raise_exception``), or input it cannot render at all, raises
        :class:`InvalidRequestError` with code ``invalid_prompt``.
        """
        shadowing = sorted(self._reserved_names.intersection(kwargs))
        if shadowing:
            raise InvalidRequestError(f"chat template option {shadowing[0]!r} is reserved", code=INVALID_PROMPT)
        try:
            return self._template.render(messages=messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except TemplateRaisedError as exc:
            raise InvalidRequestError(exc.message or "the chat template rejected the request",
                                      code=INVALID_PROMPT) from exc
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:
            raise InvalidRequestError(f"chat template {self.name} cannot render this request: "
                                      f"{type(exc).__name__}: {exc}", code=INVALID_PROMPT) from exc

    @cached_property
    def capabilities(self) -> TemplateCapabilities:
        """The prompt options this template understands (see :func:`detect_capabilities`)."""
        return detect_capabilities(self)


def detect_capabilities(template: ChatTemplate) -> TemplateCapabilities:
    """Resolve a template's prompt options from its text, never from a model name.

    Rules: an option is supported only when the template reads the variable of that name (found in its parsed
    text) AND setting it changes the outcome (text, or a rejection) of rendering a probe conversation (system,
    user, assistant with reasoning, user). Effort levels are the :data:`EFFORT_VOCABULARY` values the template
    renders without raising; the default effort is the single level whose rendering equals the rendering with
    the effort omitted. The ``preserve_thinking`` default is whether omitting it renders like ``True``.
    """

    def probe(**options: Any) -> str | None:
        try:
            return template.render(list(_PROBE_MESSAGES), **options)
        except InvalidRequestError:
            return None

    baseline = probe()
    if baseline is None:
        raise ArtifactError(f"chat template {template.name} cannot render a basic system/user/assistant conversation")

    effort_levels: tuple[str, ...] = ()
    default_effort = None
    rendered = {level: probe(reasoning_effort=level) for level in EFFORT_VOCABULARY}
    if "reasoning_effort" in template.variables and any(text != baseline for text in rendered.values()):
        effort_levels = tuple(level for level, text in rendered.items() if text is not None)
        matching = [level for level in effort_levels if rendered[level] == baseline]
        default_effort = matching[0] if len(matching) == 1 else None

    preserve_on = probe(preserve_thinking=True)
    supports_preserve = "preserve_thinking" in template.variables and preserve_on != probe(preserve_thinking=False)
    supports_enable = "enable_thinking" in template.variables and (
        probe(enable_thinking=True) != probe(enable_thinking=False))
    return TemplateCapabilities(
        effort_levels=effort_levels,
        default_effort=default_effort,
        supports_preserve_thinking=supports_preserve,
        preserve_thinking_default=supports_preserve and baseline == preserve_on,
        supports_enable_thinking=supports_enable,
    )
