"""Fixtures every test directory may ask for. Only fixtures live here (nothing autouse, no hooks, no markers);
the device, the skips that follow from it and the per-test seeding are importable from ``kernel_support``."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="module")
def registries() -> Any:
    """The plugin registries of the built-in families (entry points not scanned), one per test module."""
    from ninfer.core.plugins import load_plugin_manager

    return load_plugin_manager(entry_points=False).registries
