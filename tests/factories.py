"""Rows for tests, made straight through the ORM (no clock math)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any

from django.conf import settings

from jobs.models import Job
from jobs.services import service_account_ensure
from runs.models import Run


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(dt_timezone.utc)


def make_job(owner: Any = None, **fields: Any) -> Job:
    if owner is None:
        owner, _ = service_account_ensure(name="factory-service")
    values: dict[str, Any] = {"name": "job", "schedule": "* * * * *", "target": "http://127.0.0.1:9/hook"}
    values.update(fields)
    return Job.objects.create(owner=owner, **values)


def created_long_ago(job: Job, when: datetime | None = None) -> Job:
    """The job as if it had been created at `when` (default: a year before 2026), so a
    backfill may reach back past the test's own creation of it."""
    when = when or datetime(2025, 1, 1, tzinfo=dt_timezone.utc)
    Job.objects.filter(pk=job.pk).update(created_at=when)
    job.refresh_from_db()
    return job


def make_run(job: Job, scheduled_for: datetime, **fields: Any) -> Run:
    values: dict[str, Any] = {
        "job": job,
        "scheduled_for": scheduled_for,
        "due_at": scheduled_for,
        "partition": job.pk % settings.SCHEDULER_PARTITIONS,
    }
    values.update(fields)
    return Run.objects.create(**values)


def expire_lease(run_id: int) -> None:
    """The run's lease has run out, by the store's clock (the one leases are kept in):
    what a holder that stopped heartbeating leaves behind, without waiting for it."""
    from runs.claims import StoreClock

    Run.objects.filter(pk=run_id).update(lease_expires_at=StoreClock(-timedelta(seconds=1)))
