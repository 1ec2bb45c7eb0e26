"""Fixtures for the API tests: a staff caller, row counts, a clean throttle."""
from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from rest_framework.test import APIClient

from jobs.models import Job
from jobs.tokens import token_issue
from runs.models import Run, RunEvent


@pytest.fixture(autouse=True)
def _fresh_throttle() -> None:
    # The throttle counts requests in the cache, which outlives a test's transaction.
    cache.clear()


@pytest.fixture
def staff_client(db: None) -> APIClient:
    user = get_user_model().objects.create_user("ops-person", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_issue(user=user)}")
    return client


def row_counts() -> tuple[int, int, int]:
    return Job.objects.count(), Run.objects.count(), RunEvent.objects.count()


def error_messages(value: Any) -> list[str]:
    """Every message in a DRF error body, however nested."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [m for v in value.values() for m in error_messages(v)]
    if isinstance(value, list):
        return [m for v in value for m in error_messages(v)]
    return []
