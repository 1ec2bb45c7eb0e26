"""What the scanner wake-up costs, ad hoc (not a test, not a scenario): the notify
triggers' cost on a bulk insert of runs, and the probe's plan at 10^5 rows.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/<a scratch database> \\
      .venv/bin/python bench/wake_cost.py [--rows 100000] [--rounds 5]

The database is emptied of jobs and runs first (TRUNCATE ... CASCADE): never point
it at one whose rows matter. Each round inserts --rows runs in one statement and
commits, with the runs' insert trigger enabled and disabled in turn (due in 5 s:
every row passes the trigger's WHEN and calls pg_notify, the most it can cost; and
due next week: the WHEN alone), and prints the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from bench import load  # noqa: E402
from runs.claims import store_now  # noqa: E402
from runs.models import Notice  # noqa: E402
from scanners.scan import NEXT_WORK_SQL  # noqa: E402

TRIGGER = "runs_wake_scanner_insert"


def timed_insert(job_ids: list[int], due_in: timedelta, trigger_on: bool) -> float:
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs CASCADE")
        cursor.execute(f"ALTER TABLE runs {'ENABLE' if trigger_on else 'DISABLE'} TRIGGER {TRIGGER}")
    due = store_now() + due_in
    rows = [(j, due, due) for j in job_ids]
    started = time.perf_counter()
    with transaction.atomic():
        load.insert_runs(rows)
    return time.perf_counter() - started


def trigger_cost(job_ids: list[int], rounds: int) -> None:
    for label, due_in in (("due in 5 s (every row notifies)", timedelta(seconds=5)),
                          ("due in 7 days (WHEN false)", timedelta(days=7))):
        on, off = [], []
        for _ in range(rounds):
            off.append(timed_insert(job_ids, due_in, trigger_on=False))
            on.append(timed_insert(job_ids, due_in, trigger_on=True))
        m_on, m_off = statistics.median(on), statistics.median(off)
        print(f"{len(job_ids)} runs, {label}: trigger on {m_on:.3f} s, off {m_off:.3f} s (medians of {rounds}); "
              f"on/off {m_on / m_off:.3f}; on {[round(x, 3) for x in on]}, off {[round(x, 3) for x in off]}")
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE runs ENABLE TRIGGER {TRIGGER}")


def probe_plan(job_ids: list[int]) -> None:
    """Every index of the probe with rows in it: 10^5 runs scheduled (due next week),
    10^4 queued, 10^4 running, 10^4 paused jobs with a resume time, 10^4 notices."""
    now = store_now()
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs CASCADE")
        cursor.execute("UPDATE jobs SET paused = false, paused_until = NULL")
    week = now + timedelta(days=7)
    load.insert_runs([(j, week, week) for j in job_ids])
    tenth = job_ids[: len(job_ids) // 10]
    load.insert_runs([(j, now - timedelta(days=1), now - timedelta(days=1)) for j in tenth], status="queued")
    load.insert_runs([(j, now - timedelta(days=2), now - timedelta(days=2)) for j in tenth], status="running")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE runs SET queued_at = due_at + interval '1 hour' WHERE status = 'queued'")
        cursor.execute("UPDATE runs SET lease_expires_at = due_at + interval '3 days' WHERE status = 'running'")
        cursor.execute("UPDATE jobs SET paused = true, paused_until = %s WHERE id = ANY(%s)", [week, tenth])
        cursor.execute("DELETE FROM notices")
        columns, values = load.defaults_sql(
            Notice, {"job_id": "id", "kind": "'dead'", "created_at": "now()", "due_at": "%s::timestamptz"})
        cursor.execute(f"INSERT INTO notices ({columns}) SELECT {values} FROM jobs WHERE id = ANY(%s)", [week, tenth])
    load.analyze()
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE notices")
        for parts in (list(range(settings.SCHEDULER_PARTITIONS)), [0, 1, 2, 3]):
            params = [parts, parts, parts, settings.SCHEDULER_PARTITIONS, parts, True]
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + NEXT_WORK_SQL, params)
            print(f"\n-- the probe over partitions {parts}:")
            print("\n".join(row[0] for row in cursor.fetchall()))
            times = []
            for _ in range(50):
                started = time.perf_counter()
                cursor.execute(NEXT_WORK_SQL, params)
                cursor.fetchone()
                times.append(time.perf_counter() - started)
            print(f"-- round trip, median of 50: {statistics.median(times) * 1000:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    assert connection.vendor == "postgresql", "PostgreSQL only (DATABASE_URL)"
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE jobs, runs CASCADE")
    job_ids = load.insert_jobs(count=args.rows, schedule_expr="* * * * *", target="http://127.0.0.1:9/h",
                               window_seconds=0)
    print(f"load average before: {os.getloadavg()}")
    trigger_cost(job_ids, args.rounds)
    probe_plan(job_ids)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
