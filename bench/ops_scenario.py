"""`ops`: the dashboard, the system page and one `/metrics` scrape with 10^7 runs.

Fills the bench database (straight SQL, generate_series: not what is measured)
with 10^4 jobs over 50 target hosts, one open run each plus a few hundred late,
queued, running, held and dead-not-handled ones; `--runs` finished runs (1% dead,
mostly handled, 1% skipped, the rest succeeded) with one timeline event each; and
a busy day of rollup rows (every minute: starts with lag buckets, outcomes,
skips, and calls per host). Then asks each page 20 times through Django's test
client in this process (the whole middleware stack, no network: the server's
time) and reports the median, p90 and the number of queries.

`--reuse` keeps a bench database that already holds the rows (the timing only).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import print_table, write_result

UTC = timezone.utc
JOBS = 10_000
HOSTS = 50
PAGES = ("/admin/", "/admin/system/", "/metrics")


def run(args: argparse.Namespace) -> int:
    harness.start_zookeeper()
    try:
        return _run(args)
    finally:
        harness.stop_zookeeper()


def _run(args: argparse.Namespace) -> int:
    if not args.reuse:
        harness.reset_database()
    else:
        harness.sh(harness.PY, "manage.py", "migrate", "-v", "0", cwd=harness.ROOT, env=harness.bench_env())
    harness.setup_django(ALLOWED_HOSTS="127.0.0.1,localhost")
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs")
        have = cursor.fetchone()[0]
    if have < args.runs:
        _fill(args.runs)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM runs")
        rows = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM run_events")
        event_rows = cursor.fetchone()[0]
        cursor.execute("SELECT count(*) FROM run_rollups")
        rollup_rows = cursor.fetchone()[0]
    print(f"runs: {rows:,}  run_events: {event_rows:,}  run_rollups: {rollup_rows:,}")
    results = {path: _time_page(path, args.repeat) for path in PAGES}
    summary: dict[str, Any] = {
        "runs": rows,
        "run_events": event_rows,
        "run_rollups": rollup_rows,
        "repeat": args.repeat,
        "pages": results,
        "all_under_200ms": all(r["median_ms"] <= 200 for r in results.values()),
    }
    print_table(
        "ops",
        [(path, f"median {r['median_ms']} ms, p90 {r['p90_ms']} ms, {r['queries']} queries") for path, r in results.items()],
    )
    print("written", write_result("ops", summary))
    return 0 if summary["all_under_200ms"] else 1


def _time_page(path: str, repeat: int) -> dict[str, Any]:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    user, _ = get_user_model().objects.get_or_create(username="bench-admin", defaults={"is_staff": True, "is_superuser": True})
    client = Client(HTTP_HOST="127.0.0.1")
    client.force_login(user)
    client.get(path)  # warm: templates, the coordinator's connection
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(path)
        timings.append((time.perf_counter() - started) * 1000)
        assert response.status_code == 200, (path, response.status_code)
    with CaptureQueriesContext(connection) as queries:
        client.get(path)
    return {
        "median_ms": round(statistics.median(timings), 1),
        "p90_ms": round(harness.percentile(timings, 90), 1),
        "max_ms": round(max(timings), 1),
        "queries": len(queries),
    }


def _fill(count: int) -> None:
    from django.conf import settings
    from django.db import connection

    from bench import load
    from bench.load import defaults_sql
    from runs.models import Run, RunEvent

    started = time.time()
    now = datetime.now(UTC).replace(microsecond=0)
    job_ids = load.insert_jobs(count=JOBS, schedule_expr="0 2 * * *", target="http://x.bench/h", window_seconds=0)
    first = job_ids[0]
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE jobs SET target = 'http://host' || (id % {HOSTS}) || '.bench:8080/h'")
    # One open run per job: most in the future, some due, late, queued, running, held.
    opens = []
    for i, j in enumerate(job_ids):
        when = now + timedelta(minutes=1 + i) if i >= 400 else now - timedelta(minutes=i % 40)
        opens.append((j, when, when))
    load.insert_runs(opens)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE runs SET status = 'queued', queued_at = due_at WHERE job_id < %s", [first + 100])
        cursor.execute(
            "UPDATE runs SET status = 'running', started_at = due_at, lease_expires_at = now() + interval '1 hour' "
            "WHERE job_id >= %s AND job_id < %s",
            [first + 100, first + 200],
        )
        cursor.execute("UPDATE runs SET held = true WHERE job_id >= %s AND job_id < %s", [first + 200, first + 250])
    columns, values = defaults_sql(
        Run,
        {
            "job_id": f"{first} + g %% {JOBS}",
            "scheduled_for": "%s::timestamptz - g * interval '1 second'",
            "due_at": "%s::timestamptz - g * interval '1 second'",
            "partition": f"({first} + g %% {JOBS}) %% {settings.SCHEDULER_PARTITIONS}",
            "status": "CASE WHEN g %% 100 = 0 THEN 'dead' WHEN g %% 100 = 1 THEN 'skipped' ELSE 'succeeded' END",
            "is_backfill": "true",
            "attempt": "1",
            "started_at": "%s::timestamptz - g * interval '1 second' + interval '0.2 second'",
            "finished_at": "%s::timestamptz - g * interval '1 second' + interval '0.5 second'",
            "handled_at": "CASE WHEN g %% 100 = 0 AND g %% 1000 <> 0 THEN now() END",
            "created_at": "now()",
        },
    )
    chunk = 1_000_000
    # The events' run time (migration runs 0019), where the tree's model has it.
    keyed = "scheduled_for, " if any(f.name == "scheduled_for" for f in RunEvent._meta.fields) else ""
    with connection.cursor() as cursor:
        for low in range(1, count + 1, chunk):
            high = min(low + chunk - 1, count)
            cursor.execute(
                f"INSERT INTO runs ({columns}) SELECT {values} FROM generate_series(%s, %s) g",
                [now, now, now, now, low, high],
            )
            cursor.execute(
                f"INSERT INTO run_events (run_id, at, {keyed}type, detail) "
                f"SELECT id, finished_at, {keyed}status, '{{}}'::jsonb "
                "FROM runs WHERE id > (SELECT coalesce(max(run_id), 0) FROM run_events) AND finished_at IS NOT NULL"
            )
            print(f"  {high:,} runs ({time.time() - started:.0f} s)", flush=True)
        _fill_rollups(cursor, now)
        cursor.execute("VACUUM ANALYZE")
    print(f"filled in {time.time() - started:.0f} s")


def _fill_rollups(cursor: Any, now: datetime) -> None:
    """A busy day: every minute, two worker shards of starts (with lag buckets) and
    outcomes, skips by reason for a few jobs, and calls per host."""
    cursor.execute(
        """
        INSERT INTO run_rollups (minute, kind, reason, host, job_id, shard, n, lag_n, lag_sum,
                                 b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12)
        SELECT date_trunc('minute', %s::timestamptz) - m * interval '1 minute', k.kind, k.reason, '', k.job, s,
               k.n, CASE WHEN k.kind = 'started' THEN k.n ELSE 0 END, CASE WHEN k.kind = 'started' THEN k.n * 0.3 ELSE 0 END,
               0, 0, CASE WHEN k.kind = 'started' THEN k.n - 10 ELSE 0 END, 0, CASE WHEN k.kind = 'started' THEN 10 ELSE 0 END,
               0, 0, 0, 0, 0, 0, 0, 0
        FROM generate_series(0, 1439) m, generate_series(0, 1) s,
             (VALUES ('started', '', 0, 600), ('succeeded', '', 0, 590), ('dead', '', 0, 6), ('retry_scheduled', '', 0, 4),
                     ('skipped', 'misfire', 17, 2), ('skipped', 'overlap', 23, 1)) AS k(kind, reason, job, n)
        """,
        [now],
    )
    cursor.execute(
        """
        INSERT INTO run_rollups (minute, kind, reason, host, job_id, shard, n, lag_n, lag_sum,
                                 b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12)
        SELECT date_trunc('minute', %s::timestamptz) - m * interval '1 minute', k.kind, '',
               'host' || h || '.bench:8080', 0, s, k.n, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0
        FROM generate_series(0, 1439) m, generate_series(0, 1) s, generate_series(0, %s) h,
             (VALUES ('call', 12), ('call_failed', 1)) AS k(kind, n)
        """,
        [now, HOSTS - 1],
    )
    cursor.execute(
        """
        INSERT INTO run_rollups (minute, kind, reason, host, job_id, shard, n, lag_n, lag_sum,
                                 b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, b12)
        SELECT '1970-01-01T00:00:00Z', kind, reason, host, job_id, shard, sum(n), sum(lag_n), sum(lag_sum),
               sum(b0), sum(b1), sum(b2), sum(b3), sum(b4), sum(b5), sum(b6), sum(b7), sum(b8), sum(b9), sum(b10),
               sum(b11), sum(b12)
        FROM run_rollups GROUP BY kind, reason, host, job_id, shard
        ON CONFLICT (minute, kind, reason, host, job_id, shard) DO NOTHING
        """
    )
    cursor.execute(
        "INSERT INTO target_breakers (host, state, failures, opened_at, next_probe_at, probe_holder, last_error, updated_at) "
        "VALUES ('host3.bench:8080', 'open', 5, now(), now() + interval '30 seconds', '', 'HTTP 503', now()) "
        "ON CONFLICT (host) DO NOTHING"
    )
