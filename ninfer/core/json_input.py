"""Client JSON with explicit limits: the one parser for request bodies and for JSON text inside them.

Every request body and every JSON string a client embeds (tool-call ``arguments``) goes through :func:`parse_json`
with :data:`JSON_LIMITS`:

* nesting depth at most 64 (the root container is level 1). Agent clients' tool schemas are 10 to 15 deep; every
  recursive consumer downstream (copying, prompt rendering, the chat template's ``tojson``, response encoding) stays
  far below Python's recursion limit at this depth;
* number literals of at most 64 characters, finite (``1e999`` and the non-JSON ``NaN`` / ``Infinity`` are
  rejected), so no integer reaches Python's int-digit limit and no float overflows a consumer;
* at most 1,000,000 array elements and object members in total, which bounds the memory a parsed body can occupy
  beyond its own size (a body of ``[{},{},...]`` would otherwise take about 25 times its size);
* strictly UTF-8 text and no lone UTF-16 surrogate in any string or member name (``"\\ud800"`` is valid JSON
  syntax but not text: it cannot be encoded into a prompt or echoed in a response).

String values are bounded only by the request-body limit (``--max-request-mib``): data URIs and tool results are
legitimately large. A violation is a :class:`JsonInputError` (HTTP 400, code ``invalid_json``) whose ``param`` is
the JSON path of the offending value (``messages[2].content``) where it can be located.

JSON the model writes as a tool-call argument value is read with :data:`GENERATED_VALUE_LIMITS`, shallower by the
nesting a client adds when it replays the call, so whatever the server returns can be sent back.

The checks on the hot path run at C speed (regular expressions and counts over the text, ``json.loads``); the
slower token walk that names the path runs only once a check has failed.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any, Iterable, Iterator

import attrs

from ninfer.core.errors import InvalidRequestError, quoted

INVALID_JSON = "invalid_json"


@attrs.frozen
class JsonLimits:
    """The structural limits of client JSON (see the module docstring for the reasons behind each value)."""

    max_depth: int = 64
    max_number_chars: int = 64
    max_values: int = 1_000_000  # array elements plus object members, in total
    locate_chars: int = 8 * 1024 * 1024  # how far the error-path walk reads to name a path


JSON_LIMITS = JsonLimits()
#: Containers around a generated tool-argument value when a client replays it in a request body (Chat's object-form
#: ``messages[i].tool_calls[j].function.arguments.NAME`` is the deepest place: root, messages, message, tool_calls,
#: call, function, arguments).
REPLAY_NESTING = 7
#: Limits for JSON the model generates as a tool-argument value, so that its replay stays within JSON_LIMITS.
GENERATED_VALUE_LIMITS = attrs.evolve(JSON_LIMITS, max_depth=JSON_LIMITS.max_depth - REPLAY_NESTING)


class JsonInputError(InvalidRequestError):
    """Client JSON that is malformed, not text, or beyond :data:`JSON_LIMITS`."""

    code = INVALID_JSON


# -- paths -----------------------------------------------------------------------------------------------------------

_PLAIN_KEY = re.compile(r"[A-Za-z_$][A-Za-z0-9_$\-]{0,63}")

PathSegment = str | int


def member_path(parent: str, key: Any) -> str:
    """``parent.key`` for a plain member name, else ``parent[<quoted key>]`` (bounded, escaped)."""
    if isinstance(key, str) and _PLAIN_KEY.fullmatch(key):
        return f"{parent}.{key}" if parent else key
    return f"{parent}[{quoted(key)}]"


def json_path(segments: Iterable[PathSegment], prefix: str = "", dotted: bool = False) -> str:
    """The path of ``segments`` below ``prefix``: ``messages[2].content`` (``messages.2.content`` when ``dotted``)."""
    path = prefix
    for segment in segments:
        if isinstance(segment, int):
            path = f"{path}.{segment}" if dotted and path else f"{path}[{segment}]"
        else:
            path = member_path(path, segment)
    return path


# -- the parser ------------------------------------------------------------------------------------------------------

_NON_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_NUMBER_MARKS = bytes.maketrans(bytes(range(256)), bytes(ord("n") if chr(c) in "-+.0123456789eE" else ord(" ")
                                                         for c in range(256)))
#: A ``\\uD800``-``\\uDFFF`` escape, if an even run of backslashes precedes it (else its backslash is escaped).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def _has_lone_surrogate(text: str, decoded: bool) -> bool:
    """Whether ``text`` spells a lone surrogate: an escaped high surrogate not directly followed by an escaped low
    one, or an escaped low one without that high one; for text not decoded from bytes also a raw one."""
    if not decoded and _SURROGATE.search(text):
        return True
    pending_high = -1  # where the escape after a high surrogate must start to pair with it
    for match in _SURROGATE_ESCAPE.finditer(text):
        escape_start = before = match.start()
        while before > 0 and text[before - 1] == "\\":
            before -= 1
        if (escape_start - before) % 2:  # an escaped backslash followed by the text "u..."
            continue
        is_high = match.group(1) in "89abAB"
        if pending_high >= 0 and (is_high or escape_start != pending_high):
            return True
        if is_high:
            pending_high = match.end()
        elif pending_high < 0:
            return True
        else:
            pending_high = -1
    return pending_high >= 0


def _skeleton(text: str) -> bytes:
    """The text outside strings with each string replaced by ``0`` and whitespace dropped (ASCII only: anything
    else outside a string is invalid JSON, which json.loads reports). Escaped backslashes are removed first, then
    escaped quotes, so the remaining quotes are exactly the string delimiters."""
    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "0".join(unescaped.split('"')[0::2])
    return outside.encode("ascii", "ignore").translate(None, b" \t\r\n")


class _Rejected(Exception):
    """Raised by the ``json.loads`` hooks; the error-path walk then names the value."""


def _reject_constant(name: str) -> Any:
    raise _Rejected(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Rejected(text)
    return value


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)
#: Used only when some exponent has three digits: a float literal of at most 64 characters overflows only then.
_STRICT_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)
_LARGE_EXPONENT = re.compile(rb"[eE][-+]?[0-9]{3}")


def parse_json(text: str | bytes, *, param: str = "", code: str = INVALID_JSON, dotted: bool = False,
               limits: JsonLimits = JSON_LIMITS) -> Any:
    """The JSON value of ``text`` within ``limits``, member order kept; otherwise a :class:`JsonInputError`.

    For a request body the error's ``param`` is the JSON path of the offending value. For JSON text held in a
    field (``param``: ``messages[1].tool_calls[0].function.arguments``) the field is the ``param`` and the message
    adds the path inside the text. ``code`` is the error code (a field's malformed text is ``invalid_value``) and
    ``dotted`` writes array indices Anthropic's way (``messages.2``).
    """
    decoded = isinstance(text, (bytes, bytearray))
    if decoded:
        try:
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise JsonInputError(f"{param or 'request body'}: not valid UTF-8 (byte {exc.start})",
                                 param=param or None, code=code) from None
    context = _Context(text, param, code, dotted, limits)
    skeleton = _skeleton(text)
    context.check_size(skeleton)
    context.check_structure(skeleton)
    try:
        decoder = _STRICT_DECODER if _LARGE_EXPONENT.search(skeleton) else _DECODER
        value = decoder.decode(text)
    except json.JSONDecodeError as exc:
        context.fail_syntax(exc)
    except (_Rejected, ValueError, RecursionError):
        context.locate()
        raise context.error(None, "exceeds the JSON input limits") from None
    if _has_lone_surrogate(text, decoded):
        context.fail_text(value)
    return value


@attrs.define
class _Context:
    """One parse: the text, how its errors are reported, the limits."""

    text: str
    param: str
    code: str
    dotted: bool
    limits: JsonLimits

    def error(self, path: list[PathSegment] | None, problem: str) -> JsonInputError:
        inner = json_path(path, "", self.dotted) if path else ""
        if self.param:
            where = f" (at {inner})" if inner else ""
            return JsonInputError(f"{self.param}: {problem}{where}", param=self.param, code=self.code)
        return JsonInputError(f"{inner or 'request body'}: {problem}", param=inner or None, code=self.code)

    def check_size(self, skeleton: bytes) -> None:
        """Elements plus members: one per comma, plus one for the first child of each non-empty container."""
        containers = skeleton.count(b"[") + skeleton.count(b"{") - skeleton.count(b"[]") - skeleton.count(b"{}")
        values = skeleton.count(b",") + containers
        if values > self.limits.max_values:
            raise self.error(None, f"{values} array elements and object members; at most "
                                   f"{self.limits.max_values} are accepted")

    def check_structure(self, skeleton: bytes) -> None:
        """Depth and number length, both from the skeleton; the walk names the offending value."""
        brackets = skeleton.translate(None, _NON_BRACKETS)
        too_deep = brackets.count(b"[") + brackets.count(b"{") > self.limits.max_depth and max(
            itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets))) > self.limits.max_depth
        too_long = b"n" * (self.limits.max_number_chars + 1) in skeleton.translate(_NUMBER_MARKS)
        if too_deep or too_long:
            self.locate()  # a suspicion the walk does not confirm is left to json.loads (a syntax error)

    def locate(self) -> None:
        """Raise the first limit violation the walk finds, naming its path; return when it finds none."""
        found = _first_violation(self.text, self.limits)
        if found is not None:
            raise self.error(*found)

    def fail_syntax(self, exc: json.JSONDecodeError) -> None:
        path = _path_at(self.text, exc.pos, self.limits)
        problem = f"not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})"
        raise self.error(path, problem) from None

    def fail_text(self, value: Any) -> None:
        raise self.error(_surrogate_path(value), "contains a lone UTF-16 surrogate, which is not text")


# -- the error-path walk ---------------------------------------------------------------------------------------------

_TOKEN = re.compile(r'[ \t\n\r]*(?:("[^"\\]*(?:\\.[^"\\]*)*")|([\[\]{},:])|([^ \t\n\r\[\]{},:"]+))')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


@attrs.define
class _Frame:
    is_object: bool
    position: PathSegment | None  # the current member name or element index
    expect_key: bool = False


def _walk(text: str, limits: JsonLimits) -> Iterator[tuple[int, list[_Frame], str | None, str | None]]:
    """``(offset, open containers, punctuation, scalar)`` for each token, up to ``limits.locate_chars``."""
    frames: list[_Frame] = []
    position = 0
    end = min(len(text), limits.locate_chars)
    while position < end:
        match = _TOKEN.match(text, position)
        if match is None:
            return
        string, punctuation, scalar = match.groups()
        if string is None and punctuation is None and scalar is None:
            return
        offset = match.start(1) if string else match.start(2) if punctuation else match.start(3)
        position = match.end()
        yield offset, frames, punctuation, scalar
        if punctuation in ("[", "{"):
            frames.append(_Frame(punctuation == "{", None if punctuation == "{" else 0, punctuation == "{"))
        elif punctuation in ("]", "}"):
            if frames:
                frames.pop()
        elif punctuation == "," and frames:
            if frames[-1].is_object:
                frames[-1].expect_key = True
            elif isinstance(frames[-1].position, int):
                frames[-1].position += 1
        elif string is not None and frames and frames[-1].is_object and frames[-1].expect_key:
            frames[-1].expect_key = False
            try:
                frames[-1].position = json.loads(string)
            except ValueError:
                frames[-1].position = string[1:-1]


def _segments(frames: list[_Frame]) -> list[PathSegment]:
    return [frame.position for frame in frames if frame.position is not None]


def _first_violation(text: str, limits: JsonLimits) -> tuple[list[PathSegment], str] | None:
    for _offset, frames, punctuation, scalar in _walk(text, limits):
        if punctuation in ("[", "{") and len(frames) >= limits.max_depth:
            return _segments(frames), f"nests deeper than {limits.max_depth} levels"
        if scalar is None:
            continue
        if scalar in ("NaN", "Infinity", "-Infinity"):
            return _segments(frames), f"{scalar} is not a JSON number"
        if _NUMBER.fullmatch(scalar) is None:
            continue
        if len(scalar) > limits.max_number_chars:
            return _segments(frames), (f"a number literal of {len(scalar)} characters; at most "
                                       f"{limits.max_number_chars} are accepted")
        if not math.isfinite(float(scalar)):
            return _segments(frames), f"the number {quoted(scalar)} is out of range"
    if len(text) > limits.locate_chars:  # not read to the end: the suspicion stands, unlocated
        return [], "exceeds the JSON input limits"
    return None


def _path_at(text: str, stop: int, limits: JsonLimits) -> list[PathSegment] | None:
    """The path of the value being read at character ``stop`` (a syntax error), if the walk reaches it."""
    segments = None
    for offset, frames, _punctuation, _scalar in _walk(text, limits):
        if offset > stop:
            break
        segments = _segments(frames)
    return segments


def _surrogate_path(value: Any) -> list[PathSegment]:
    """The path of the first string or member name holding a lone surrogate (iterative: depth is bounded anyway)."""
    pending: list[tuple[list[PathSegment], Any]] = [([], value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key in item:
                if _SURROGATE.search(key):
                    return [*path, key]
            pending.extend((([*path, key], member) for key, member in reversed(list(item.items()))))
        elif isinstance(item, list):
            pending.extend((([*path, index], element) for index, element in reversed(list(enumerate(item)))))
    return []
