"""The hypothesis profiles of the reliability tests and their shared echo artifact.

``ci`` (the default): a fixed, small example budget per endpoint, derandomized so every CI run sends the same
requests, no shrinking (a failure reports the example as generated) and no example database (no files left behind).
``long``: a local exploration run, ``pytest tests/reliability --hypothesis-profile=long`` (the profile is registered
here, so name this directory or a file in it on the command line).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings

from live_server import tiny_artifact

_SUPPRESSED = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]

settings.register_profile("ci", max_examples=80, deadline=None, derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.generate), suppress_health_check=_SUPPRESSED)
settings.register_profile("long", max_examples=5000, deadline=None, derandomize=False, database=None,
                          suppress_health_check=_SUPPRESSED, print_blob=True)


def pytest_configure(config: pytest.Config) -> None:
    settings.load_profile(config.getoption("hypothesis_profile", None) or "ci")


@pytest.fixture(scope="module")
def echo_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_artifact(tmp_path_factory, "echo")
