"""Bulk writes for the hot path: new runs, as COPY on PostgreSQL.

An INSERT of model instances prepares every field of every row in Python (Django
5.2 sends them as UNNEST arrays, dumped one element at a time). COPY sends rows as
they are; the ids come back with one read of the jobs' open runs, which the
partial unique index runs_one_open_run_per_job makes exact.
"""
from __future__ import annotations

from django.db import connection
from django.utils import timezone

from runs.models import Run
from scheduler_project import statement_counter

_FIELDS = [f for f in Run._meta.concrete_fields if not f.primary_key]
COPY_RUNS_SQL = "COPY runs ({}) FROM STDIN".format(", ".join(f.column for f in _FIELDS))


def insert_open_runs(rows: list[Run]) -> list[Run]:
    """Insert each job's next open run (never a backfill); sets each row's pk."""
    if not rows:
        return rows
    assert all(not r.is_backfill and r.status in Run.OPEN for r in rows)
    if connection.vendor != "postgresql":
        created = Run.objects.bulk_create(rows)
        if created and created[0].pk is None:  # a backend that cannot return ids from a bulk insert
            for r in created:
                r.pk = Run.objects.get(job_id=r.job_id, scheduled_for=r.scheduled_for).pk
        return created
    now = timezone.now()
    for r in rows:
        r.created_at = r.created_at or now
    with connection.wrap_database_errors, connection.cursor() as cursor:
        with cursor.cursor.copy(COPY_RUNS_SQL) as copy:
            for r in rows:
                copy.write_row([getattr(r, f.attname) for f in _FIELDS])
    statement_counter.note()
    ids = dict(
        Run.objects.filter(job_id__in=[r.job_id for r in rows], status__in=Run.OPEN, is_backfill=False).values_list(
            "job_id", "pk"
        )
    )
    for r in rows:
        r.pk = ids[r.job_id]
    return rows
