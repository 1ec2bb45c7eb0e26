"""Helpers for the worker call-path tests: jobs written straight through the ORM
(as if edited in the database, past the API's checks) and a queued run of each."""
from __future__ import annotations

from typing import Any

from django.utils import timezone

from jobs.models import Job
from jobs.secrets import encrypt_headers
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
