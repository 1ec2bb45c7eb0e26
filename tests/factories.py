"""Rows for tests, made straight through the ORM (no clock math)."""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone
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
