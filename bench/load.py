"""Bulk loading of jobs and runs straight into the bench database (not what is measured).

Jobs are made with SQL `generate_series`; each first run's `due_at` is computed
with the project's own `spread_due_at`, so runs created later by the workers
follow the same spread.
"""
from __future__ import annotations

import json
from typing import Any
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection

from jobs import schedule
from jobs.services import service_account_ensure



def owner_id(name: str = "bench") -> int:
    user, _ = service_account_ensure(name=name)
    return int(user.pk)


def insert_jobs(*, count: int, schedule_expr: str, target: str, window_seconds: int, run_at: datetime | None = None,
                owner: str = "bench") -> list[int]:
    from jobs.models import Job

    columns, values = defaults_sql(
        Job,
        {
            "owner_id": "%s", "name": "'bench'", "schedule": "%s", "run_at": "%s::timestamptz", "target": "%s",
            "payload": """'{"n": 1}'""", "window_seconds": "%s", "misfire": "'run_all'", "retry_base_seconds": "1",
            "retry_cap_seconds": "60", "created_at": "now()", "updated_at": "now()",
        },
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO jobs ({columns}) SELECT {values} FROM generate_series(1, %s) RETURNING id",
            [owner_id(owner), schedule_expr, run_at, target, window_seconds, count],
        )
        return sorted(row[0] for row in cursor.fetchall())


def defaults_sql(model: Any, given: dict[str, str]) -> tuple[str, str]:
    """(column list, select list) for INSERT ... SELECT: `given` columns as SQL expressions,
    every other column its model default, so new model fields need no change here."""
    from runs.models import Run

    columns, values = [], []
    for f in model._meta.concrete_fields:
        if f.primary_key or getattr(f, "generated", False):  # the store computes a generated column
            continue
        columns.append(f.column)
        if f.column in given:
            values.append(given[f.column])
            continue
        if f.column == "kept_for" and model is Run:  # a tree with the column has the name
            from runs.models import OPEN_KEPT_FOR

            # The history's key follows the row's status and time (Run.kept_for): the
            # store's check refuses an ended run inserted with the open run's default.
            status = given.get("status", f"'{Run.Status.SCHEDULED}'")
            open_statuses = ", ".join(f"'{s}'" for s in Run.OPEN)
            values.append(f"CASE WHEN ({status}) IN ({open_statuses}) "
                          f"THEN '{OPEN_KEPT_FOR.isoformat()}'::timestamptz ELSE ({given['scheduled_for']}) END")
            continue
        default = f.get_default()
        if default is None:
            values.append("NULL")
        elif isinstance(default, bool):
            values.append("true" if default else "false")
        elif isinstance(default, (int, float)):
            values.append(str(default))
        elif isinstance(default, (dict, list)):
            values.append("'" + json.dumps(default).replace("'", "''") + "'")
        else:
            values.append("'" + str(default).replace("'", "''") + "'")
    return ", ".join(columns), ", ".join(values)


def insert_runs(rows: list[tuple[int, datetime, datetime]], *, status: str = "scheduled", backfill: bool = False) -> None:
    """(job_id, scheduled_for, due_at) rows, in chunks of unnest()ed arrays."""
    from runs.models import Run

    columns, values = defaults_sql(
        Run,
        {
            "job_id": "r.job_id", "scheduled_for": "r.scheduled_for", "due_at": "r.due_at",
            "partition": f"r.job_id %% {settings.SCHEDULER_PARTITIONS}", "status": f"'{status}'",
            "is_backfill": "true" if backfill else "false", "created_at": "now()",
        },
    )
    sql = (
        f"INSERT INTO runs ({columns}) SELECT {values} FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[]) "
        "AS r(job_id, scheduled_for, due_at)"
    )
    with connection.cursor() as cursor:
        for i in range(0, len(rows), 50_000):
            chunk = rows[i : i + 50_000]
            cursor.execute(sql, [[r[0] for r in chunk], [r[1] for r in chunk], [r[2] for r in chunk]])


def cron_jobs_with_first_runs(*, count: int, schedule_expr: str, target: str, window_seconds: int, after: datetime,
                              owner: str = "bench") -> list[int]:
    ids = insert_jobs(count=count, schedule_expr=schedule_expr, target=target, window_seconds=window_seconds,
                      owner=owner)
    first = schedule.next_cron_time(schedule_expr, "UTC", after)
    window = timedelta(seconds=window_seconds)
    insert_runs([(i, first, schedule.spread_due_at(i, first, window)) for i in ids])
    return ids


def one_off_jobs(*, times: list[datetime], target: str, owner: str = "bench") -> list[int]:
    """One one-off job per time (whole seconds), its run due then, of service `owner`."""
    ids: list[int] = []
    for chunk_start in range(0, len(times), 50_000):
        chunk = times[chunk_start : chunk_start + 50_000]
        made = insert_jobs(count=len(chunk), schedule_expr="", target=target, window_seconds=0, run_at=chunk[0],
                           owner=owner)
        insert_runs([(job_id, t, t) for job_id, t in zip(made, chunk)])
        with connection.cursor() as cursor:
            cursor.execute("UPDATE jobs SET run_at = r.scheduled_for FROM runs r WHERE r.job_id = jobs.id AND jobs.id = ANY(%s)", [made])
        ids.extend(made)
    return ids


def analyze() -> None:
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE jobs")
        cursor.execute("ANALYZE runs")
