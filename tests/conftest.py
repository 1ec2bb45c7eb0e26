"""Shared fixtures: service accounts with tokens, API clients, staff."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings
from rest_framework.test import APIClient

from jobs.services import service_account_ensure

# Hypothesis profiles. "ci" is the normal run's (loaded here); `pytest
# --hypothesis-profile=long` loads "long" over it (hypothesis's plugin loads the
# named profile after this file is imported). Tests that set max_examples in their
# own @settings keep it; the stateful test (tests/runs/test_stateful.py) takes its
# example and step counts from the profile. docs/reliability.md records a long run.
hypothesis_settings.register_profile("ci", max_examples=200, stateful_step_count=12)
hypothesis_settings.register_profile("long", max_examples=5000, stateful_step_count=20)
hypothesis_settings.load_profile("ci")


class Service:
    def __init__(self, name: str) -> None:
        self.user, self.token = service_account_ensure(name=name, email=f"{name}@example.test")
        self.client = APIClient()
        self.client.credentials(HTTP_AUTHORIZATION=f"Token {self.token}")

    def post(self, path: str, data: Any) -> Any:
        return self.client.post(path, data, format="json")

    def patch(self, path: str, data: Any) -> Any:
        return self.client.patch(path, data, format="json")

    def get(self, path: str, **params: Any) -> Any:
        return self.client.get(path, params)

    def delete(self, path: str) -> Any:
        return self.client.delete(path)


@pytest.fixture(autouse=True)
def _no_breaker_read_left_over() -> Any:
    """A worker process keeps its read of the breakers for a moment (runs.services
    BREAKER_READ_FOR); a test's rows are new, so each test starts without one."""
    from runs import services

    services._PROCESS_BREAKERS.forget()
    yield


@pytest.fixture(autouse=True)
def _no_services_read_left_over() -> Any:
    """A scanner keeps its read of how many services have jobs for a moment
    (scanners.shares.SERVICES_KNOWN_FOR); a test's jobs are new, so each test starts
    without one."""
    from scanners import shares

    shares.forget_services()
    yield


@pytest.fixture(autouse=True)
def _no_bulkhead_slots_left_over() -> Any:
    """Bulkhead slots in Redis outlive a test's database; start each test without any."""
    from django.conf import settings

    if settings.SCHEDULER_BULKHEAD == "redis":
        import redis

        client = redis.Redis.from_url(settings.SCHEDULER_BULKHEAD_REDIS_URL)
        for key in client.scan_iter(match=f"{settings.SCHEDULER_BULKHEAD_PREFIX}*"):
            client.delete(key)
    yield


@pytest.fixture
def service(db: None) -> Service:
    return Service("reports")


@pytest.fixture
def other_service(db: None) -> Service:
    return Service("billing")
