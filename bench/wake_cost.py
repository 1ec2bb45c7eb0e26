"""What the scanner wake-up costs, ad hoc (not a test, not a scenario): the notify
triggers' cost on a bulk insert of runs, and the probe's plan at 10^5 rows.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/<a scratch database> \\
      .venv/bin/python bench/wake_cost.py [--rows 100000] [--rounds 9] [--idle-seconds 120 [--idle-code DIR]]

The database is emptied of jobs and runs first (TRUNCATE ... CASCADE): never point
it at one whose rows matter. Each comparison runs with the trigger enabled and
disabled in turn, --rounds times: an INSERT of --rows runs due in 5 s (every
partition notified, the statement-level trigger's whole cost) and due next week
(nothing to notify), an UPDATE of as many held runs to not held (every row passes
the row trigger's WHEN) and one of their leases (a heartbeat's shape: WHEN false),
each timed in the server (EXPLAIN ANALYZE, rolled back; the minimum, the least
disturbed by a shared machine), and the insert once more as the client sees it,
committed. Then the probe's plan with every index it reads holding rows, and with
--idle-seconds an idle scanner's transactions and CPU (--idle-code: another
tree's scanner, e.g. an export of main, for the figure beside it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from bench import load  # noqa: E402
from runs.claims import store_now  # noqa: E402
from runs.models import Notice  # noqa: E402
from scanners.probe import NEXT_WORK_SQL, next_work_params  # noqa: E402

INSERT_TRIGGER, UPDATE_TRIGGER = "runs_wake_scanner_insert", "runs_wake_scanner_update"


def triggers(on: bool, *names: str) -> None:
    with connection.cursor() as cursor:
        for name in names:
            cursor.execute(f"ALTER TABLE runs {'ENABLE' if on else 'DISABLE'} TRIGGER {name}")


def server_ms(sql: str, params: list[object]) -> float:
    """The statement's execution time in the server (EXPLAIN ANALYZE, triggers included),
    rolled back: what the trigger adds, less the noise of a shared machine's client side."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, TIMING OFF) " + sql, params)
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    return float(plan.rsplit("Execution Time: ", 1)[1].split(" ms")[0])


def committed_insert_s(job_ids: list[int], due_in: timedelta) -> float:
    """The bulk insert as a client sees it: 10^5 rows sent, inserted, committed."""
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs CASCADE")
    due = store_now() + due_in
    started = time.perf_counter()
    with transaction.atomic():
        load.insert_runs([(j, due, due) for j in job_ids])
    return time.perf_counter() - started


def compare(label: str, measure: Any, names: tuple[str, ...], rounds: int, unit: str) -> None:
    on: list[float] = []
    off: list[float] = []
    for _ in range(rounds):
        triggers(False, *names)
        off.append(measure())
        triggers(True, *names)
        on.append(measure())
    print(f"{label}: trigger on {min(on):.1f} / off {min(off):.1f} {unit} (min of {rounds}; on/off {min(on) / min(off):.3f}), "
          f"medians {statistics.median(on):.1f} / {statistics.median(off):.1f} {unit}")


def trigger_cost(job_ids: list[int], rounds: int) -> None:
    from runs.models import Run

    columns, values = load.defaults_sql(Run, {
        "job_id": "j.id", "scheduled_for": "%s::timestamptz", "due_at": "%s::timestamptz",
        "partition": f"j.id %% {settings.SCHEDULER_PARTITIONS}", "status": "'scheduled'", "created_at": "now()"})
    insert = f"INSERT INTO runs ({columns}) SELECT {values} FROM jobs j"
    n = len(job_ids)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs CASCADE")
    for label, due_in in (("due in 5 s: every partition notified", timedelta(seconds=5)),
                          ("due in 7 days: none", timedelta(days=7))):
        compare(f"INSERT of {n} runs, {label}, server time",
                lambda d=due_in: server_ms(insert, [store_now() + d] * 2), (INSERT_TRIGGER,), rounds, "ms")
    soon = store_now() + timedelta(seconds=30)
    triggers(False, INSERT_TRIGGER)
    with connection.cursor() as cursor:
        cursor.execute(insert, [soon, soon])
        cursor.execute("UPDATE runs SET held = true")
    triggers(True, INSERT_TRIGGER)
    compare(f"UPDATE of {n} held runs to not held (every row passes the WHEN), server time",
            lambda: server_ms("UPDATE runs SET held = false", []), (UPDATE_TRIGGER,), rounds, "ms")
    compare(f"UPDATE of {n} runs' lease (a heartbeat's shape: the WHEN false), server time",
            lambda: server_ms("UPDATE runs SET lease_expires_at = now()", []), (UPDATE_TRIGGER,), rounds, "ms")
    compare(f"INSERT of {n} runs due in 5 s, sent and committed by the client, wall time",
            lambda: committed_insert_s(job_ids, timedelta(seconds=5)) * 1000, (INSERT_TRIGGER,), rounds, "ms")
    triggers(True, INSERT_TRIGGER, UPDATE_TRIGGER)


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
    # Extra runs (backfills: a job has one open run of its own).
    load.insert_runs([(j, now - timedelta(days=1), now - timedelta(days=1)) for j in tenth], status="queued",
                     backfill=True)
    load.insert_runs([(j, now - timedelta(days=2), now - timedelta(days=2)) for j in tenth], status="running",
                     backfill=True)
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
            params = next_work_params(parts, in_flight=True, notices=True)
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


def commits() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def idle_scanner(job_ids: list[int], seconds: float, code: Path) -> None:
    """One `manage.py scanner` from `code` (this tree, or an export of another commit)
    over the jobs, each with a run due in 10 minutes or more, on the single-node
    coordinator with the default settings: its transactions (pg_stat_database's
    commits, less this script's own reads) and its CPU, over `seconds`."""
    import signal
    import subprocess
    import tempfile

    from bench.harness import cpu_of, group_pids

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE runs CASCADE")
        cursor.execute("UPDATE jobs SET paused = false, paused_until = NULL")
    later = store_now() + timedelta(minutes=10)
    load.insert_runs([(j, later + timedelta(seconds=i % 600), later + timedelta(seconds=i % 600))
                      for i, j in enumerate(job_ids)])
    load.analyze()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "ZOOKEEPER"))}
    data = Path(tempfile.mkdtemp(prefix="wake-cost-"))
    env.update(SCHEDULER_DATA_DIR=str(data), PYTHONDONTWRITEBYTECODE="1", SCHEDULER_COUNT_STATEMENTS_DIR=str(data))

    def statements() -> int:  # scheduler_project.statement_counter's file, written once a second
        path = data / f"{proc.pid}.json"
        return json.loads(path.read_text())["statements"] if path.exists() else 0
    log = open(data / "scanner.log", "wb")
    proc = subprocess.Popen([sys.executable, "manage.py", "scanner", "--identifier", "idle"], cwd=code, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(10)  # started, its first full scan done
        alive = proc.poll() is None
        c0, s0, cpu0, t0 = commits(), statements(), cpu_of(group_pids(proc.pid)), time.monotonic()
        time.sleep(seconds)
        c1, s1, cpu1, t1 = commits(), statements(), cpu_of(group_pids(proc.pid)), time.monotonic()
        alive = alive and proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        log.close()
    took = t1 - t0
    print(f"idle scanner ({code}): {(s1 - s0) / took:.2f} statements/s, {(c1 - c0 - 2) / took:.2f} transactions/s, "
          f"{(cpu1 - cpu0) / took * 100:.2f}% of a core, over {took:.0f} s; alive throughout: {alive}; "
          f"log {log.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--idle-seconds", type=float, default=0, help="also an idle scanner, this long")
    parser.add_argument("--idle-code", type=Path, default=None,
                        help="the scanner's tree for --idle-seconds (default: this one)")
    parser.add_argument("--only-idle", action="store_true")
    args = parser.parse_args()
    assert connection.vendor == "postgresql", "PostgreSQL only (DATABASE_URL)"
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE jobs, runs CASCADE")
    job_ids = load.insert_jobs(count=args.rows, schedule_expr="* * * * *", target="http://127.0.0.1:9/h",
                               window_seconds=0)
    print(f"load average before: {os.getloadavg()}")
    if not args.only_idle:
        trigger_cost(job_ids, args.rounds)
        probe_plan(job_ids)
    if args.idle_seconds:
        idle_scanner(job_ids, args.idle_seconds, args.idle_code or Path(__file__).resolve().parents[1])
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
