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
