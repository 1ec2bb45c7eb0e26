"""Real processes for the reliability tests: the integration suite's Stack fixtures
(and its report hook, so a failing test prints the processes' logs)."""
from __future__ import annotations

from tests.integration.conftest import (  # noqa: F401
    broker, integration_env, pytest_generate_tests, pytest_runtest_makereport, stack)
