"""A secret header reaches its target, and nowhere else: not an API answer, an admin
page, a log line, a run event, an audit entry or a database column in clear."""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.services import service_account_ensure
from runs import delivery
from runs.models import Run
from runs.services import run_execute
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]
SECRET = "s3cret"


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


@pytest.fixture
def every_log_line(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    # DEBUG everywhere, the loggers with a level of their own included.
    for name in (None, "scheduler", "django", "django.request", "django.db.backends", "urllib3", "celery"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def database_dump() -> str:
    """Every column of every row of every table, as text."""
    lines = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names(cursor):
            cursor.execute(f"SELECT * FROM {connection.ops.quote_name(table)}")
            for row in cursor.fetchall():
                lines.append(f"{table}: " + " | ".join(_text(value) for value in row))
    return "\n".join(lines)


def _text(value: Any) -> str:
    if isinstance(value, (bytes, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def test_a_secret_header_reaches_its_target_and_appears_nowhere_else(
    target: LoopbackTarget, every_log_line: pytest.LogCaptureFixture, superuser: Any
) -> None:
    _, token = service_account_ensure(name="reports")
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    seen: list[str] = []

    def keep(response: Any) -> Any:
        seen.append(f"{response.status_code} {response.content.decode()}")
        return response

    created = keep(api.post("/api/jobs/", {
        "name": "with-credentials", "schedule": "*/5 * * * *", "target": target.url("/hook"),
        "headers": {"Authorization": "Bearer s3cret", "X-Api-Key": "s3cret-too", "X-Team": "reports"},
        "secret_headers": ["X-Api-Key"], "payload": {"report": "daily"},
    }, format="json")).json()
    job_path = f"/api/jobs/{created['id']}/"
    assert created["headers"] == {"Authorization": "***", "X-Api-Key": "***", "X-Team": "reports"}

    # Sent back as read (with "***"), the stored credentials stay.
    keep(api.patch(job_path, {"name": "renamed", "headers": created["headers"]}, format="json"))
    run = Run.objects.get(job__name="renamed", status=Run.Status.SCHEDULED)
    Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED, queued_at=timezone.now(), due_at=timezone.now())
    assert run_execute(run_id=run.pk) == "succeeded"
    delivery.close_connections()

    [call] = target.calls("/hook")
    assert call.headers["Authorization"] == "Bearer s3cret" and call.headers["X-Api-Key"] == "s3cret-too"

    for path in (job_path, "/api/jobs/", f"{job_path}runs/", "/api/runs/", f"/api/runs/{run.public_id}/",
                 "/api/audit/", "/api/schema/"):
        response = keep(api.get(path))
        assert response.status_code == 200, (path, response.content)

    admin = Client()
    admin.force_login(superuser)
    job_pk = created["id"].removeprefix("job_")
    for path in ("/admin/jobs/job/", f"/admin/jobs/job/{job_pk}/change/", "/admin/runs/run/",
                 f"/admin/runs/run/{run.pk}/change/", "/admin/jobs/auditentry/", "/admin/runs/run/?status=succeeded"):
        response = admin.get(path)
        assert response.status_code == 200, (path, response.status_code)
        seen.append(response.content.decode())

    assert SECRET not in "\n".join(seen)
    assert every_log_line.records, "no log line was captured: the check would prove nothing"
    assert SECRET not in "\n".join(r.getMessage() + str(r.args) for r in every_log_line.records)
    assert SECRET not in every_log_line.text
    dump = database_dump()
    assert "with-credentials" not in dump and "renamed" in dump  # the dump does read the jobs table
    assert SECRET not in dump
