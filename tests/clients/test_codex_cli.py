"""The real Codex CLI (PyPI ``openai-codex-cli-bin``, version pinned in ``pins.env``) against ``ninfer serve``.

Codex talks to the server's OpenAI Responses endpoint through a custom provider (``wire_api = "responses"``) in
``~/.codex/config.toml`` of a temporary ``HOME``; everything else is Codex's default (its ``include``, its hosted
``web_search`` tool, reasoning summaries, ...). Its shell tool is the ``exec_command`` function with the command line
in ``cmd``. Each test runs ``codex exec --json`` (a second user turn: ``codex exec resume <thread id>``) and reads the
JSONL events on stdout.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import attrs
import pytest

from agent_support import (
    AgentRun,
    RecordingProxy,
    ShellTool,
    client_env,
    iter_jsonl,
    pinned_binary,
    pins,
    run_process,
    second_user_turn,
    single_tool_call,
    three_turn_tool_loop,
)
from live_server import API_KEY, LiveServer

pytestmark = pytest.mark.clients

API_KEY_ENV = "NINFER_API_KEY"
# Non-interactive and unsandboxed: no approval prompts, and no bubblewrap sandbox (unavailable in containers; the
# test's temporary working directory is the only place the scripted commands touch). The directory is no git repo.
EXEC_FLAGS = ("--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox")


@pytest.fixture(scope="module")
def codex_binary() -> Path:
    try:
        import codex_cli_bin
    except ImportError:
        path = None
    else:
        path = Path(codex_cli_bin.bundled_codex_path())
    return pinned_binary(path, pins()["CODEX_CLI_VERSION"], "the Codex CLI (openai-codex-cli-bin)")


def write_config(home: Path, base_url: str, model: str) -> None:
    """``~/.codex/config.toml``: the server's model by default, through a Responses provider at ``base_url``."""
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{model}"\n'
        'model_provider = "ninfer"\n\n'
        "[model_providers.ninfer]\n"
        'name = "ninfer"\n'
        f'base_url = "{base_url}/v1"\n'
        f'env_key = "{API_KEY_ENV}"\n'
        'wire_api = "responses"\n',
        encoding="utf-8",
    )


@attrs.frozen
class CodexCli:
    """``codex exec`` runs with their own ``HOME`` (``~/.codex``: config, sessions)."""

    binary: Path
    home: Path

    shell: ClassVar[ShellTool] = ShellTool("exec_command", "cmd")

    def start(self, prompt: str, workdir: Path) -> AgentRun:
        return self._exec(["exec", *EXEC_FLAGS, prompt], workdir)

    def resume(self, previous: AgentRun, prompt: str, workdir: Path) -> AgentRun:
        assert previous.session_id, "the first run reported no thread id"
        return self._exec(["exec", "resume", *EXEC_FLAGS, previous.session_id, prompt], workdir)

    def _exec(self, args: list[str], workdir: Path) -> AgentRun:
        env = client_env(self.home, **{API_KEY_ENV: API_KEY})
        process = run_process([self.binary, *args], workdir, env)
        events = list(iter_jsonl(process.stdout))
        threads = [event["thread_id"] for event in events if event.get("type") == "thread.started"]
        messages = [event["item"].get("text") for event in events
                    if event.get("type") == "item.completed" and event["item"].get("type") == "agent_message"]
        return AgentRun(process, messages[-1] if messages else None, threads[0] if threads else None)


@pytest.fixture
def codex(codex_binary: Path, echo_server: LiveServer, proxy: RecordingProxy, tmp_path: Path) -> CodexCli:
    home = tmp_path / "home"
    write_config(home, proxy.base_url, echo_server.model_id)
    return CodexCli(codex_binary, home)


def test_single_tool_call(codex: CodexCli, workdir: Path, proxy: RecordingProxy) -> None:
    single_tool_call(codex, workdir, proxy)


def test_three_turn_tool_loop(codex: CodexCli, workdir: Path, proxy: RecordingProxy) -> None:
    three_turn_tool_loop(codex, workdir, proxy)


def test_second_user_turn_resumes_the_session(codex: CodexCli, workdir: Path, proxy: RecordingProxy) -> None:
    second_user_turn(codex, workdir, proxy)
