"""Fixtures for the ops surface: an operator and a read-only person (staff, in the
ops groups the post_migrate handler makes), their admin clients, and run shapes."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.test import Client
from django.utils import timezone

from jobs.models import Job
from jobs.services import job_create, service_account_ensure
from runs import events
from runs.models import Run
from runs.ops import OPERATOR_GROUP, READONLY_GROUP
from tests.factories import make_run

# The real-process fixtures, for the browser test (tests/integration/conftest.py makes them).
from tests.integration.conftest import broker, integration_env, stack  # noqa: F401
from tests.target import LoopbackTarget

S = Run.Status
PASSWORD = "correct horse battery staple"


def person(name: str, group: str) -> Any:
    user = get_user_model().objects.create_user(name, password=PASSWORD, is_staff=True)
    user.groups.add(Group.objects.get(name=group))
    return user


@pytest.fixture
def operator(db: None) -> Any:
    return person("olga-operator", OPERATOR_GROUP)


@pytest.fixture
def viewer(db: None) -> Any:
    return person("rita-readonly", READONLY_GROUP)


@pytest.fixture
def operator_client(operator: Any) -> Client:
    client = Client()
    client.force_login(operator)
    return client


@pytest.fixture
def viewer_client(viewer: Any) -> Client:
    client = Client()
    client.force_login(viewer)
    return client


@pytest.fixture
def owner(db: None) -> Any:
    user, _ = service_account_ensure(name="reports", email="reports-team@example.test")
    return user


def new_job(owner: Any, **fields: Any) -> Job:
    values: dict[str, Any] = {
        "name": "nightly-report",
        "schedule": "0 2 * * *",
        "timezone": "Asia/Kolkata",
        "target": "https://reports.internal/rebuild",
    }
    values.update(fields)
    return job_create(owner=owner, fields=values)


def dead_run(
    job: Job,
    when: datetime,
    *,
    attempt: int = 4,
    fence: int = 4,
    notified: str = "reports-team@example.test",
    finished: datetime | None = None,
) -> Run:
    """A run that went dead as the lifecycle leaves one: terminal, with its `dead` event."""
    finished = finished or timezone.now()
    run = make_run(
        job,
        when,
        status=S.DEAD,
        attempt=attempt,
        fence=fence,
        started_at=when,
        finished_at=finished,
        last_error="target answered HTTP 500",
    )
    events.record(run.pk, "dead", finished, reason="out of tries", notified=notified)
    return run


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def ago(**delta: float) -> datetime:
    return (timezone.now() - timedelta(**delta)).replace(microsecond=0)
