"""Where the tests find files outside ``tests/``: the repository root, its docs, and the official chat templates.

The official Qwen templates are oracles that the project does not ship. ``NINFER_OFFICIAL_TEMPLATES`` points at a
directory holding them (``qwen3_6.jinja``, ``qwen3_8.jinja``: each model repository's ``chat_template.jinja``);
it defaults to ``../shared/fixtures/chat_templates`` beside the checkout. Without them only the assertions that
compare against the official templates skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = REPO_ROOT / "docs"
OFFICIAL_TEMPLATES = Path(
    os.environ.get("NINFER_OFFICIAL_TEMPLATES") or REPO_ROOT.parent / "shared" / "fixtures" / "chat_templates"
)


def official_template(name: str) -> Path:
    """The official template ``name`` (``qwen3_6``, ``qwen3_8``); skips the calling test when it is not there."""
    path = OFFICIAL_TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"official chat template {path} not found (set NINFER_OFFICIAL_TEMPLATES to the directory "
                    f"holding qwen3_6.jinja and qwen3_8.jinja)")
    return path
