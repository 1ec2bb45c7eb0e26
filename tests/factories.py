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


# A run's timeline as the API reads it (runs.timeline: event rows and the entries on
# the run's row), for tests that assert what happened to a run.


def timeline_of(run: Run | int) -> list[Any]:
    """The run's whole timeline, oldest first, read fresh (the row may have changed)."""
    from runs.timeline import timeline

    return timeline(Run.objects.get(pk=run if isinstance(run, int) else run.pk))


def timeline_types(run: Run | int) -> list[str]:
    return [e.type for e in timeline_of(run)]


def entries(run: Run | int, type_: str) -> list[Any]:
    return [e for e in timeline_of(run) if e.type == type_]


def entry(run: Run | int, type_: str) -> Any:
    """The run's one entry of that type (an error if there is none, or more than one)."""
    found = entries(run, type_)
    assert len(found) == 1, f"{len(found)} {type_} entries: {[e.type for e in timeline_of(run)]}"
    return found[0]


def timelines_of(run_ids: Any) -> dict[int, list[Any]]:
    """Many runs' timelines by run id (runs.timeline.timelines)."""
    from runs.timeline import timelines

    return timelines(Run.objects.filter(pk__in=list(run_ids)))


def drop_time_partitions() -> None:
    """Drop the runs history's time partitions and their events' twins (runs.partitions;
    PostgreSQL). They are tables: the flush between tests empties them but keeps them,
    and a scanner's upkeep in an earlier test may have made some."""
    from django.db import connection

    from runs import partitions

    if not partitions.in_use():
        return
    with connection.cursor() as cursor:
        for span in partitions.spans():
            cursor.execute(f"DROP TABLE {connection.ops.quote_name(span.name)}")
        for span in partitions.spans(partitions.EVENTS):
            cursor.execute(f"DROP TABLE {connection.ops.quote_name(span.events)}")


SCRAPE_TOKEN = "test-scrape-token"


def scrape_metrics() -> Any:
    """GET /metrics as a Prometheus scraper does, with the bearer token (without one
    set, the production layout answers staff sessions only)."""
    from django.test import Client, override_settings

    with override_settings(SCHEDULER_METRICS_TOKEN=SCRAPE_TOKEN):
        return Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {SCRAPE_TOKEN}")
