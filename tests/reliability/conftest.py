"""Real processes for the reliability tests: the integration suite's Stack fixtures
(and its report hook, so a failing test prints the processes' logs), and the counting
target they judge by."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.harness import free_port
from tests.counting_target import CountingTarget
from tests.integration.conftest import (  # noqa: F401
    broker, integration_env, private_redis, pytest_generate_tests, pytest_runtest_makereport, stack)


@pytest.fixture
def counting_target() -> Iterator[CountingTarget]:
    server = CountingTarget(free_port()).start()  # BENCH_PORTS, when set, names the range
    yield server
    server.stop()
