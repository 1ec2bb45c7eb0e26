"""How long migration runs 0015 (runs partitioned by kept_for) or, with `--events`,
0019 (run_events partitioned by its run's time) takes on a database with many runs,
and what it blocks while it runs. Ad hoc and standalone: a scratch database of its own
(`scheduler_partition_migration` unless --db), dropped at the end.

    .venv/bin/python bench/partition_migration.py --runs 1000000 --json bench/results/partition-migration.json
    .venv/bin/python bench/partition_migration.py --events --runs 1000000 --json bench/results/events-migration.json

Steps: migrate a fresh database to runs 0014 (0018 with --events); load --jobs jobs and
--runs runs (nine in ten ended, five minutes apart; one open run per job), and with
--events one event a run and the day partitions of the history that holds them;
VACUUM ANALYZE; then `manage.py migrate runs 0015` (0019), timed, while a second
connection tries a one-row read of `runs` (`run_events`) every 0.5 s with a 0.2 s lock
timeout and counts how many of those reads were refused (the migration's ACCESS
EXCLUSIVE lock).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1_000_000)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--db", default="scheduler_partition_migration")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--events", action="store_true", help="time migration runs 0019 instead of 0015")
    args = parser.parse_args()
    before, target, table = ("0018", "0019", "run_events") if args.events else ("0014", "0015", "runs")
    server = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
    url = f"{server}/{args.db}"
    env = dict(os.environ, DATABASE_URL=url)
    env.setdefault("SECRET_KEY", "bench-only-secret-key-not-for-production-0123456789abcdef")

    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{args.db}"')
        admin.execute(f'CREATE DATABASE "{args.db}"')
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v0"], env=env, check=True)
    subprocess.run([*manage, "migrate", "runs", before, "-v0"], env=env, check=True)

    os.environ["DATABASE_URL"] = url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")
    os.environ.setdefault("SECRET_KEY", env["SECRET_KEY"])
    import django

    django.setup()
    from django.db import connection

    from django.utils import timezone

    from bench.load import defaults_sql, owner_id
    from jobs.models import Job
    from runs.models import Run

    per_job = max(1, args.runs // args.jobs)
    job_cols, job_vals = defaults_sql(
        Job, {"owner_id": "%s", "name": "'migration'", "schedule": "'*/5 * * * *'",
              "target": "'http://127.0.0.1:9/h'", "created_at": "now()", "updated_at": "now()"})
    # Run k of a job: k = 0 its open run (due in the next hour), else ended k*5 minutes
    # ago (every tenth dead, the rest succeeded).
    run_cols, run_vals = defaults_sql(
        Run, {"job_id": "j.id", "scheduled_for": "j.t", "due_at": "j.t", "partition": "j.id %% 16",
              "status": "j.status", "finished_at": "CASE WHEN j.status = 'scheduled' THEN NULL ELSE j.t END",
              "attempt": "CASE WHEN j.status = 'scheduled' THEN 0 ELSE 1 END", "created_at": "j.t"})
    started = time.monotonic()
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO jobs ({job_cols}) SELECT {job_vals} FROM generate_series(1, %s)",
                       [owner_id(), args.jobs])
        cursor.execute(
            f"INSERT INTO runs ({run_cols}) SELECT {run_vals} FROM ("
            "SELECT j.id, date_trunc('minute', now()) + CASE WHEN k = 0 THEN interval '1 hour' "
            "ELSE - k * interval '5 minutes' - (j.id %% 300) * interval '1 second' END AS t, "
            "CASE WHEN k = 0 THEN 'scheduled' WHEN k %% 10 = 0 THEN 'dead' ELSE 'succeeded' END AS status "
            "FROM jobs j CROSS JOIN generate_series(0, %s) AS k WHERE j.name = 'migration') j",
            [per_job - 1])
        if args.events:
            from runs import partitions

            cursor.execute("SELECT min(scheduled_for) FROM runs")
            day, end = partitions.span_at(cursor.fetchone()[0]), partitions.span_at(timezone.now() + timedelta(hours=2))
            while day.start <= end.start:
                partitions.make(day)
                day = partitions.span_at(day.end)
            cursor.execute("INSERT INTO run_events (run_id, at, type, detail) "
                           "SELECT id, coalesce(finished_at, created_at), 'retry_scheduled', '{}' FROM runs")
    connection.close()
    loaded_s = time.monotonic() - started
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"VACUUM ANALYZE {table}")
        runs = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        table_bytes = conn.execute(f"SELECT pg_total_relation_size('{table}')").fetchone()[0]

    refused, tried, stop = [0], [0], threading.Event()

    def reader() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '200ms'")
            while not stop.is_set():
                tried[0] += 1
                try:
                    conn.execute(f"SELECT id FROM {table} WHERE id = 1")
                except psycopg.errors.LockNotAvailable:
                    refused[0] += 1
                stop.wait(0.5)

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(1.0)
    started = time.monotonic()
    subprocess.run([*manage, "migrate", "runs", target, "-v0"], env=env, check=True)
    migrate_s = time.monotonic() - started
    time.sleep(1.0)
    stop.set()
    thread.join()
    with psycopg.connect(url, autocommit=True) as conn:
        after = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        parts = dict(conn.execute(
            "SELECT c.relname, c.reltuples::bigint FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            f"WHERE i.inhparent = '{table}'::regclass ORDER BY 1").fetchall())
        after_bytes = conn.execute(
            f"SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits WHERE inhparent = '{table}'::regclass"
        ).fetchone()[0]
        # With --events: each event under its run's time, in that time's partition.
        misplaced = conn.execute(
            "SELECT count(*) FROM run_events e JOIN runs r ON r.id = e.run_id "
            "WHERE e.scheduled_for <> r.scheduled_for OR (r.kept_for <> '9999-12-31' AND "
            "substr(e.tableoid::regclass::text, 11) <> substr(r.tableoid::regclass::text, 5))"
        ).fetchone()[0] if args.events else None
    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE "{args.db}"')
    assert after == runs, (after, runs)
    assert not misplaced, misplaced
    result = {
        "migration": f"runs {target}", "table": table, "rows": runs, "jobs": args.jobs, "load_s": round(loaded_s, 1), "migrate_s": round(migrate_s, 1),
        "bytes_before": table_bytes, "bytes_after": int(after_bytes), "partitions_after_analyze": parts,
        "reads_tried_during": tried[0], "reads_refused_by_lock_timeout": refused[0],
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
