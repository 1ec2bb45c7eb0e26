"""Bulk writes for the hot path: new runs, as COPY on PostgreSQL.

An INSERT of model instances prepares every field of every row in Python (Django
5.2 sends them as UNNEST arrays, dumped one element at a time). COPY sends rows as
they are; the ids come back with one read of the jobs' open runs, which the
partial unique index runs_one_open_run_per_job makes exact.
"""
from __future__ import annotations

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from runs.models import JOBS_OPEN_RUN, Run
from scheduler_project import statement_counter

# Not the key, nor a column the store generates (Run.stage).
_FIELDS = [f for f in Run._meta.concrete_fields if not f.primary_key and not getattr(f, "generated", False)]
COPY_RUNS_SQL = "COPY runs ({}) FROM STDIN".format(", ".join(f.column for f in _FIELDS))


def insert_open_runs(rows: list[Run]) -> tuple[list[Run], list[Run]]:
    """Insert each job's next open run (never a backfill); sets each inserted row's pk.
    Returns (inserted, refused).

    The batch is a speed-up, not a unit of failure: the whole batch goes in one
    COPY under a savepoint; if a row breaks a unique constraint (its time already
    has a run: runs_one_run_per_time; or its job already has an open run), the
    savepoint is rolled back and each row is inserted alone under a savepoint of
    its own, so the clash costs that row only. A refused row is returned for the
    caller to place (runs.nextrun.job_next_runs); the rest of the transaction
    goes on.
    """
    if not rows:
        return rows, []
    assert all(not r.is_backfill and r.status in Run.OPEN for r in rows)
    try:
        with transaction.atomic():
            _insert_all(rows)
        return rows, []
    except IntegrityError:
        for r in rows:
            r.pk = None
    inserted, refused = [], []
    for r in rows:
        try:
            with transaction.atomic():
                r.save(force_insert=True)
            inserted.append(r)
        except IntegrityError:
            r.pk = None
            refused.append(r)
    return inserted, refused


def _insert_all(rows: list[Run]) -> None:
    if connection.vendor != "postgresql":
        created = Run.objects.bulk_create(rows)
        if created and created[0].pk is None:  # a backend that cannot return ids from a bulk insert
            for r in created:
                r.pk = Run.objects.get(job_id=r.job_id, scheduled_for=r.scheduled_for).pk
        return
    now = timezone.now()
    for r in rows:
        r.created_at = r.created_at or now
    with connection.wrap_database_errors, connection.cursor() as cursor:
        with cursor.cursor.copy(COPY_RUNS_SQL) as copy:
            for r in rows:
                copy.write_row([getattr(r, f.attname) for f in _FIELDS])
    statement_counter.note()
    ids = dict(
        Run.objects.filter(JOBS_OPEN_RUN, job_id__in=[r.job_id for r in rows]).values_list(
            "job_id", "pk"
        )
    )
    for r in rows:
        r.pk = ids[r.job_id]
