"""The WAL of each step of a run's happy path, record by record (ad hoc, issue 18).

Runs the real code in this process against a scratch PostgreSQL database: N jobs, each
with a run due now and an HTTP target on loopback (yearly jobs, so that no minute
boundary makes a second run due mid-step: every outcome makes one next run, a year on); then the scanner's queueing
(`scanners.scan.scan_once`, nothing published), then the worker's batch
(`runs.services.run_execute_many`: the claim, the calls, the outcomes and the next runs).
Around each step it reads the WAL back with `pg_walinspect` and prints the records per
run, by kind and by relation, so a record can be traced to the step that wrote it.

    .venv/bin/python bench/wal_steps.py --runs 200 [--json bench/results/wal-steps.json]

Needs PostgreSQL on 127.0.0.1:5432 (trust auth, user postgres, for `pg_walinspect`).
Makes the database `--db` (`scheduler_walsteps`) afresh. Full-page images are left out
of every figure (a CHECKPOINT comes before the steps, so they are first touches).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections import defaultdict
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PG = "postgres://postgres@127.0.0.1:5432"

RECORDS_SQL = r"""
WITH r AS (
    SELECT resource_manager || '/' || record_type AS kind, record_length - fpi_length AS len,
           regexp_match(block_ref, '^blkref #\d+: rel \d+/(\d+)/(\d+)') AS m
      FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)
)
SELECT kind, COALESCE(pg_filenode_relation(0, m[2]::oid)::regclass::text, '-'), count(*), sum(len)
  FROM r
 WHERE m IS NULL OR m[1]::oid = (SELECT oid FROM pg_database WHERE datname = current_database())
 GROUP BY 1, 2 ORDER BY 4 DESC
"""


class _Ok(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (the stdlib's name)
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _setup(db: str) -> None:
    import psycopg

    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {db}")
    os.environ.update(DATABASE_URL=f"{PG}/{db}", SCHEDULER_LOG_LEVEL="WARNING",
                      SECRET_KEY=os.environ.get("SECRET_KEY", "bench-only-secret-key-0123456789abcdefghijklmnopqrstuvwxyz"),
                      SCHEDULER_TARGET_CONCURRENCY="100000")
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


def _lsn(connection) -> str:
    with connection.cursor() as c:
        c.execute("SELECT pg_current_wal_insert_lsn()")
        return c.fetchone()[0]


def _step(name: str, runs: int, action, by_statement: bool = False) -> dict[str, object]:
    from django.db import connection

    with connection.cursor() as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
    statements: list[tuple[str, str, str]] = []

    def wrapper(execute, sql, params, many, context):
        before = _lsn(context["connection"]) if not sql.startswith("SELECT pg_current_wal") else None
        try:
            return execute(sql, params, many, context)
        finally:
            if before is not None:
                statements.append((" ".join(sql.split())[:110], before, _lsn(context["connection"])))

    start = _lsn(connection)
    if by_statement:
        with connection.execute_wrapper(wrapper):
            action()
    else:
        action()
    end = _lsn(connection)
    with connection.cursor() as c:
        c.execute("SELECT pg_switch_wal()")  # pg_walinspect reads flushed WAL only
        c.execute(RECORDS_SQL, [start, end])
        rows = c.fetchall()
        for sql, a, b in statements:
            if a == b:
                continue
            c.execute(RECORDS_SQL, [a, b])
            found = c.fetchall()
            print(f"   [{sum(r[3] for r in found) / runs:7.1f} B/run] {sql}")
            for kind, rel, count, size in found:
                if size / runs >= 5:
                    print(f"        {kind:24s} {rel:36s} {count / runs:6.2f} records {size / runs:7.1f} bytes")
    total = sum(r[3] for r in rows)
    print(f"\n== {name}: {total / runs:.0f} bytes a run")
    for kind, rel, count, size in rows:
        if size / runs >= 2:
            print(f"   {kind:24s} {rel:40s} {count / runs:6.2f} records {size / runs:7.1f} bytes")
    locks: dict[str, float] = defaultdict(float)
    for kind, rel, count, _ in rows:
        if kind == "Heap/LOCK":
            locks[rel] += count / runs
    return {"bytes_per_run": round(total / runs, 1), "row_locks_per_run": {k: round(v, 3) for k, v in locks.items()},
            "by_relation": [{"kind": k, "relation": r, "records_per_run": round(n / runs, 3),
                             "bytes_per_run": round(s / runs, 1)} for k, r, n, s in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--db", default="scheduler_walsteps")
    args = parser.parse_args()
    _setup(args.db)

    from django.conf import settings
    from django.utils import timezone

    from runs import claims
    from runs.models import Run
    from runs.services import run_execute_many
    from scanners.scan import scan_once
    from tests.factories import make_job, make_run

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = f"http://127.0.0.1:{server.server_address[1]}/hook"

    now = claims.store_now()
    minute = now.replace(second=0, microsecond=0)
    ids = []
    for i in range(args.runs):
        job = make_job(name=f"wal-{i}", target=target, schedule="0 0 1 1 *")
        ids.append(make_run(job, minute, due_at=now - timedelta(seconds=1)).pk)
    parts = sorted(set(Run.objects.filter(pk__in=ids).values_list("partition", flat=True)))
    from django.db import connection

    with connection.cursor() as c:
        c.execute("CHECKPOINT")  # full-page images only for first touches after it
        c.execute("VACUUM ANALYZE runs")
    steps = {}
    steps["queue"] = _step("the scanner's queueing (scan_once)", args.runs,
                           lambda: scan_once(partitions=parts, publish=False), by_statement=True)
    queued = Run.objects.filter(pk__in=ids, status="queued").count()
    steps["execute"] = _step("the worker's batch (run_execute_many)", args.runs,
                             lambda: run_execute_many(run_ids=ids, worker="wal-steps"), by_statement=True)
    done = Run.objects.filter(pk__in=ids, status="succeeded").count()
    next_runs = Run.objects.filter(job__name__startswith="wal-", status="scheduled").count()
    print(f"\n{queued} of {args.runs} queued, {done} succeeded; {next_runs} next runs")
    server.shutdown()
    if args.json:
        args.json.write_text(json.dumps({"runs": args.runs, "queued": queued, "succeeded": done, "next_runs": next_runs,
                                         "steps": steps, "timezone": str(timezone.get_current_timezone()),
                                         "partitions": settings.SCHEDULER_PARTITIONS}, indent=1) + "\n")


if __name__ == "__main__":
    main()
