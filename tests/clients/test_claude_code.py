"""The real Claude Code (npm ``@anthropic-ai/claude-code``, version pinned in ``pins.env``) against ``ninfer serve``.

``tests/clients/install.sh`` installs it under ``.clients/``. Claude Code talks to the server's Anthropic Messages
endpoint through ``ANTHROPIC_BASE_URL`` and ``ANTHROPIC_API_KEY``, with a temporary ``HOME`` and otherwise its
defaults (its default model name, adaptive thinking, effort, context management, betas, ...). Its shell tool is
``Bash`` with the command line in ``command``. Each test runs ``claude -p PROMPT --output-format json`` (a second user
turn: ``--continue``, the latest session of the working directory) and reads the result object on stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import attrs
import pytest

from agent_support import (
    REPO_ROOT,
    AgentRun,
    RecordingProxy,
    ShellTool,
    client_env,
    pinned_binary,
    pins,
    run_process,
    second_user_turn,
    single_tool_call,
    three_turn_tool_loop,
)
from live_server import API_KEY

pytestmark = pytest.mark.clients

CLAUDE = REPO_ROOT / ".clients" / "node_modules" / ".bin" / "claude"
# Non-interactive, with the Bash tool allowed without a prompt. (--dangerously-skip-permissions is refused when the
# tests run as root, as in CI containers.)
PRINT_FLAGS = ("--output-format", "json", "--allowedTools", "Bash")


@pytest.fixture(scope="module")
def claude_binary() -> Path:
    return pinned_binary(CLAUDE, pins()["CLAUDE_CODE_VERSION"], "Claude Code (@anthropic-ai/claude-code)")


@attrs.frozen
class ClaudeCode:
    """``claude -p`` runs with their own ``HOME`` (settings, sessions), talking to ``base_url``."""

    binary: Path
    home: Path
    base_url: str

    shell: ClassVar[ShellTool] = ShellTool("Bash", "command")

    def start(self, prompt: str, workdir: Path) -> AgentRun:
        return self._print(["-p", prompt, *PRINT_FLAGS], workdir)

    def resume(self, previous: AgentRun, prompt: str, workdir: Path) -> AgentRun:
        return self._print(["--continue", "-p", prompt, *PRINT_FLAGS], workdir)

    def _print(self, args: list[str], workdir: Path) -> AgentRun:
        env = client_env(self.home, ANTHROPIC_BASE_URL=self.base_url, ANTHROPIC_API_KEY=API_KEY)
        process = run_process([self.binary, *args], workdir, env)
        try:
            result = json.loads(process.stdout)
        except json.JSONDecodeError:
            return AgentRun(process, None, None)
        text = result.get("result") if not result.get("is_error") else None
        return AgentRun(process, text, result.get("session_id"))


@pytest.fixture
def claude(claude_binary: Path, proxy: RecordingProxy, tmp_path: Path) -> ClaudeCode:
    home = tmp_path / "home"
    return ClaudeCode(claude_binary, home, proxy.base_url)


def test_single_tool_call(claude: ClaudeCode, workdir: Path, proxy: RecordingProxy) -> None:
    single_tool_call(claude, workdir, proxy)


def test_three_turn_tool_loop(claude: ClaudeCode, workdir: Path, proxy: RecordingProxy) -> None:
    three_turn_tool_loop(claude, workdir, proxy)


def test_second_user_turn_continues_the_session(claude: ClaudeCode, workdir: Path, proxy: RecordingProxy) -> None:
    second_user_turn(claude, workdir, proxy)
