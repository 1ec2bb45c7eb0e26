"""Shared fixtures: service accounts with tokens, API clients, staff."""
from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from jobs.services import service_account_ensure


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
