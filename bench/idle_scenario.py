"""`idle`: what a scheduler with nothing to do costs (issue 17).

100,000 daily jobs whose runs are all due long after the measured minutes (the first
more than 10 minutes after the end), the production layout with two scanners and one
worker, and none of the scheduler's settings set (SCHEDULER_SCAN_INTERVAL included).
Over `--minutes` it measures what the scanners together send to PostgreSQL and the CPU
they use:

- statements, client side: each scanner runs under bench/counted.py, which wraps every
  Django connection it makes (the same way on any commit);
- statements, server side: the scanners' sessions alone have `log_statement=all`
  (PGOPTIONS), so PostgreSQL's log holds every statement they send, BEGIN, COMMIT and
  connection set-up included; counted when the server log is readable here;
- transactions, server side: pg_stat_database's commits and rollbacks of the bench
  database, every session in it (the worker's too; the bench reads from `postgres`);
- CPU: utime + stime of the scanner processes from /proc, over wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from bench import harness, scenarios
from bench.harness import PY, Layout, Proc, print_table, wait_for, write_result

UTC = timezone.utc
QUIET_AFTER_S = 600  # no run due within 10 minutes of the measured window's end
SETUP_ALLOWANCE_S = 300  # loading, starting and settling, before the window opens
SETTLE_S = 20  # after every partition has an owner: the first scans and the handover are over
PARTITIONS_LINE = re.compile(r"^partitions \[([\d, ]*)\] at ", re.M)


def run(args: argparse.Namespace) -> int:
    scenarios._prepare()
    from django.conf import settings
    from django.db import connections

    from bench import load

    first_due = _load_jobs(args, load)
    partitions = settings.SCHEDULER_PARTITIONS
    connections.close_all()  # the bench itself holds no session in the bench database while it measures
    stats_dir = Path(harness.tempfile.mkdtemp(prefix="sched-idle-stmts-"))
    layout = Layout(env=harness.bench_env())
    server_log = _server_log()
    try:
        scanners = [_start_scanner(layout, f"scanner-{i + 1}", stats_dir, server_log is not None)
                    for i in range(args.scanners)]
        _start_worker(layout, args, stats_dir)
        covered = _wait_partitions_covered(scanners, partitions, timeout=120)
        time.sleep(SETTLE_S)
        before = _reading(layout, stats_dir, server_log)
        time.sleep(args.minutes * 60)
        after = _reading(layout, stats_dir, server_log)
        window_end = datetime.now(UTC)
        for proc in layout.procs:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited during the measurement:\n{proc.output()[-3000:]}")
    finally:
        layout.cleanup()
        harness.stop_zookeeper()
        harness.shutil.rmtree(stats_dir, ignore_errors=True)
    summary = _summary(args, before, after, covered, first_due, window_end, server_log)
    print_table("idle", [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))])
    print("per process:", json.dumps(summary["per_process"]))
    print("written", write_result(args.out_name, summary))
    return 0


def _load_jobs(args: argparse.Namespace, load: Any) -> datetime:
    """`args.jobs` daily jobs at one time of day, spread over an hour, the first run due
    well after the window. Returns the earliest due_at."""
    earliest = datetime.now(UTC) + timedelta(seconds=SETUP_ALLOWANCE_S + args.minutes * 60 + QUIET_AFTER_S)
    at = (earliest + timedelta(minutes=1)).replace(second=0, microsecond=0)
    load.cron_jobs_with_first_runs(
        count=args.jobs, schedule_expr=f"{at.minute} {at.hour} * * *",
        target=f"http://127.0.0.1:{harness.target_port(3)}/hook",  # never called: nothing falls due
        window_seconds=3600, after=at - timedelta(seconds=1),
    )
    load.analyze()
    from runs.models import Run

    return Run.objects.order_by("due_at").values_list("due_at", flat=True).first()  # type: ignore[return-value]


def _start_scanner(layout: Layout, name: str, stats_dir: Path, log_statements: bool) -> Proc:
    env = dict(layout.env, PGAPPNAME=f"bench-{name}")
    if log_statements:
        # This process's sessions only: the server log then holds every statement a scanner sends.
        env["PGOPTIONS"] = (env.get("PGOPTIONS", "") + " -c log_statement=all").strip()
    argv = [PY, str(harness.ROOT / "bench" / "counted.py"), "--out", str(stats_dir / name),
            "manage.py", "scanner", "--identifier", name]
    return layout.start("scanner", name, argv, env)


def _start_worker(layout: Layout, args: argparse.Namespace, stats_dir: Path) -> Proc:
    env = dict(layout.env, PGAPPNAME="bench-worker-1")
    argv = [PY, str(harness.ROOT / "bench" / "counted.py"), "--out", str(stats_dir / "worker-1"),
            "-m", "celery", "-A", "scheduler_project", "worker", "-l", "WARNING", "-c", str(args.concurrency),
            "-P", args.pool, "-n", "worker-1@%h", "--without-heartbeat", "--without-gossip", "--without-mingle"]
    return layout.start("worker", "worker-1", argv, env)


def _wait_partitions_covered(scanners: list[Proc], partitions: int, timeout: float) -> bool:
    """Until the scanners' latest `partitions [...]` lines share the partitions out: each
    holds some, none twice, every one held (the first scanner up holds them all at first)."""
    def covered() -> bool:
        held = []
        for proc in scanners:
            lines = PARTITIONS_LINE.findall(proc.output())
            held.append({int(p) for p in lines[-1].split(",") if p.strip()} if lines else set())
        union = set().union(*held)
        return all(held) and sum(map(len, held)) == len(union) and union == set(range(partitions))

    try:
        wait_for(covered, timeout, "every partition to have a scanner", interval=0.5)
        return True
    except TimeoutError:
        return False


def _reading(layout: Layout, stats_dir: Path, server_log: Path | None) -> dict[str, Any]:
    """Everything the window is the difference of, read as close together as it can be."""
    return {
        "monotonic": time.monotonic(),
        "cpu": {proc.name: proc.cpu() for proc in layout.procs},
        "statements": {proc.name: _counted(stats_dir / proc.name) for proc in layout.procs},
        "server_log_bytes": server_log.stat().st_size if server_log else None,
        "database": _database_stats(),
        "sessions_by_application": _sessions_by_application(),
        "load_average": harness.load_average(),
    }


def _counted(directory: Path) -> int:
    total = 0
    for path in directory.glob("*.json"):
        try:
            total += int(json.loads(path.read_text())["statements"])
        except (ValueError, KeyError, FileNotFoundError):
            continue
    return total


def _database_stats() -> dict[str, int]:
    row = harness.psql(
        "SELECT xact_commit, xact_rollback, sessions FROM pg_stat_database "
        f"WHERE datname = '{harness.BENCH_DB}'"
    )
    commits, rollbacks, sessions = (int(x) for x in row.split("|"))
    return {"xact_commit": commits, "xact_rollback": rollbacks, "sessions": sessions}


def _sessions_by_application() -> dict[str, int]:
    rows = harness.psql(
        "SELECT coalesce(nullif(application_name, ''), '?'), count(*) FROM pg_stat_activity "
        f"WHERE datname = '{harness.BENCH_DB}' GROUP BY 1 ORDER BY 1"
    )
    return {name: int(n) for name, n in (line.split("|") for line in rows.splitlines() if line)}


def _server_log() -> Path | None:
    """PostgreSQL's log file, when this process can read it and its lines name the database."""
    if "%d" not in harness.psql("SHOW log_line_prefix"):
        return None
    candidates = [os.environ.get("BENCH_PG_LOG", ""), harness.psql("SELECT coalesce(pg_current_logfile(), '')")]
    data_dir = harness.psql("SHOW data_directory")
    major = harness.psql("SHOW server_version_num")[:-4]
    candidates.append(f"/var/log/postgresql/postgresql-{major}-main.log")  # Debian's, with no log collector
    for candidate in candidates:
        if not candidate:
            continue
        path = Path(candidate) if Path(candidate).is_absolute() else Path(data_dir) / candidate
        if path.is_file() and os.access(path, os.R_OK):
            return path
    return None


def _server_statements(server_log: Path, start: int, end: int) -> int:
    """Statements logged for the bench database between two offsets of the log."""
    marker = re.compile(rf"@{re.escape(harness.BENCH_DB)} LOG:  (statement|execute [^:]*): ")
    with open(server_log, "rb") as f:
        f.seek(start)
        text = f.read(max(0, end - start)).decode(errors="replace")
    return sum(1 for line in text.splitlines() if marker.search(line))


def _summary(args: argparse.Namespace, before: dict[str, Any], after: dict[str, Any], covered: bool,
             first_due: datetime, window_end: datetime, server_log: Path | None) -> dict[str, Any]:
    wall = after["monotonic"] - before["monotonic"]
    names = list(after["cpu"])
    per_process = {
        name: {
            "statements_per_second": round((after["statements"][name] - before["statements"][name]) / wall, 3),
            "core_fraction": round((after["cpu"][name] - before["cpu"][name]) / wall, 5),
        }
        for name in names
    }
    scanners = [name for name in names if name.startswith("scanner-")]
    client = sum(after["statements"][n] - before["statements"][n] for n in scanners)
    cpu = sum(after["cpu"][n] - before["cpu"][n] for n in scanners)
    db0, db1 = before["database"], after["database"]
    xacts = (db1["xact_commit"] - db0["xact_commit"]) + (db1["xact_rollback"] - db0["xact_rollback"])
    server = None
    if server_log and after["server_log_bytes"] >= before["server_log_bytes"]:  # not rotated in between
        server = _server_statements(server_log, before["server_log_bytes"], after["server_log_bytes"])
    return {
        "jobs": args.jobs,
        "minutes": args.minutes,
        "wall_s": round(wall, 1),
        "statements_per_second": round(client / wall, 3),
        "scanner_core_fraction": round(cpu / wall, 5),
        "server_statements_per_second": round(server / wall, 3) if server is not None else None,
        "server_transactions_per_second": round(xacts / wall, 3),
        "server_sessions_opened": db1["sessions"] - db0["sessions"],
        "per_process": per_process,
        "sessions_by_application": {"start": before["sessions_by_application"], "end": after["sessions_by_application"]},
        "partitions_covered": covered,
        "first_due_after_window_end_s": round((first_due - window_end).total_seconds(), 1),
        "load_average": {"start": before["load_average"], "end": after["load_average"]},
        "counted_by": {
            "statements_per_second": "the scanners' Django connections, every execute through a connection."
                                     "execute_wrapper added on connection_created (bench/counted.py), over wall time",
            "server_statements_per_second": (
                f"lines 'statement:'/'execute' for {harness.BENCH_DB} in {server_log}, written by the scanners' "
                "sessions alone (PGOPTIONS=-c log_statement=all): everything they sent, BEGIN/COMMIT/SET included"
                if server_log else "not counted: no readable PostgreSQL log naming the database here"),
            "server_transactions_per_second": "pg_stat_database xact_commit + xact_rollback of the bench database: "
                                              "every session in it (scanners and worker); PostgreSQL flushes these "
                                              "counters up to 10 s late, so each edge may be off by that much",
            "scanner_core_fraction": "utime + stime (+ reaped children) of the scanner process groups, /proc, over wall time",
        },
        "layout": {"scanners": args.scanners, "workers": 1, "concurrency": args.concurrency, "pool": args.pool,
                   "settings": "defaults (no SCHEDULER_* set but the bench's ZooKeeper root and log level)"},
    }
