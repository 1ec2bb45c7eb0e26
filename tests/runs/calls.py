"""Helpers for the worker call-path tests: jobs written straight through the ORM
(as if edited in the database, past the API's checks) and a queued run of each."""
from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError
from django.utils import timezone

from jobs.models import Job
from jobs.secrets import encrypt_headers
from jobs.services import job_create
from runs.models import Run
from tests.factories import make_job, make_run, timeline_of


def queued_run(owner: Any, target: str, *, secret: dict[str, str] | None = None, **fields: Any) -> Run:
    """A job for `owner` calling `target`, and one run of it queued now."""
    values: dict[str, Any] = {"retry_base_seconds": 1, "secret_headers": encrypt_headers(secret or {})}
    values.update(fields)
    job = make_job(owner, target=target, **values)
    now = timezone.now().replace(microsecond=0)
    return make_run(job, now, status=Run.Status.QUEUED, queued_at=now)


def events_of(run: Run) -> list[tuple[str, dict[str, Any]]]:
    return [(e.type, e.detail) for e in timeline_of(run)]


def job_of(run: Run) -> Job:
    return Job.objects.get(pk=run.job_id)


def queued_now(owner: Any, name: str, url: str, **fields: Any) -> Run:
    """An every-minute job made through the service (one retry, 30 s timeout unless
    `fields` say otherwise), its first run queued and due now."""
    values = {"name": name, "schedule": "* * * * *", "target": url, "retry_max": 1, "retry_base_seconds": 1,
              "timeout_seconds": 30}
    values.update(fields)
    job = job_create(owner=owner, fields=values)
    run = Run.objects.get(job=job, status=Run.Status.SCHEDULED)
    now = timezone.now()
    Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED, due_at=now, queued_at=now)
    return Run.objects.get(pk=run.pk)


def wait_for_status(run: Run, statuses: set[str], seconds: float) -> Run:
    """The run as it is once its status is one of `statuses`, or after `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            found = Run.objects.get(pk=run.pk)
        except OperationalError as exc:
            # The embedded tests' in-memory SQLite shares one cache between the test's
            # connections: a read while a batch's thread writes `runs` is refused at once
            # ("database table is locked"), with no busy wait. The poll just looks again.
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)
            continue
        if found.status in statuses or time.monotonic() > deadline:
            return found
        time.sleep(0.02)
