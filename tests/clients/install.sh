#!/usr/bin/env bash
# Installs the agent clients that tests/clients drives, at the versions pinned in pins.env:
#   - the Codex CLI from PyPI (openai-codex-cli-bin, a wheel bundling the native binary) into the current Python;
#   - Claude Code from npm (@anthropic-ai/claude-code) into .clients/ at the repository root (git-ignored).
# It never fails: without a registry or npm it says what is missing and the client tests skip with the reason.
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
. "$here/pins.env"
prefix="$root/.clients"
claude="$prefix/node_modules/.bin/claude"

warn() { echo "tests/clients/install.sh: $*; its client tests will skip" >&2; }

claude_ok() { "$claude" --version 2>/dev/null | grep -q "^$CLAUDE_CODE_VERSION "; }

python -m pip install --quiet --disable-pip-version-check "openai-codex-cli-bin==$CODEX_CLI_VERSION" \
    || warn "could not install openai-codex-cli-bin==$CODEX_CLI_VERSION"

if ! command -v npm >/dev/null 2>&1; then
    warn "npm is not installed, so Claude Code $CLAUDE_CODE_VERSION cannot be"
elif ! claude_ok; then
    npm install --prefix "$prefix" --no-audit --no-fund --save-exact --loglevel=error \
        "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" \
        || warn "npm could not install @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
    # The package's postinstall copies the platform's native binary over the bin/claude.exe placeholder; an npm
    # that skips dependency install scripts leaves the placeholder, so run that postinstall here.
    if [ -f "$prefix/node_modules/@anthropic-ai/claude-code/install.cjs" ] && ! claude_ok; then
        (cd "$prefix/node_modules/@anthropic-ai/claude-code" && node install.cjs) \
            || warn "the Claude Code postinstall (install.cjs) failed"
    fi
    claude_ok || warn "$claude does not report version $CLAUDE_CODE_VERSION"
fi
exit 0
