"""Fixtures for the trust tests: a clean throttle, a superuser, an environment for subprocesses."""
from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from rest_framework.test import APIClient

from jobs.tokens import token_issue
from runs import signing


@pytest.fixture(autouse=True)
def _fresh_throttle_and_signers() -> Iterator[None]:
    # The throttle counts in the cache and signers are cached per process: both outlive a test.
    cache.clear()
    signing._cache.clear()
    yield
    signing._cache.clear()


@pytest.fixture
def staff_client(db: None) -> APIClient:
    user = get_user_model().objects.create_user("ops-person", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_issue(user=user)}")
    return client


@pytest.fixture
def superuser(db: None) -> Any:
    return get_user_model().objects.create_superuser("root-person", "root@example.test", "a long password 123")


def production_env(**overrides: str) -> dict[str, str]:
    """The environment of a `manage.py` subprocess on the production layout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "DJANGO_SETTINGS"))}
    env.setdefault("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/scheduler")
    env["SECRET_KEY"] = "a-long-random-production-key-" + "k3y7Qz9vX2mB8nR4tW6yP1sD5fG0hJ" * 2
    env.pop("DEBUG", None)
    env.update(overrides)
    return {k: v for k, v in env.items() if v != ""}
