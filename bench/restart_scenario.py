"""`restarts`: PostgreSQL and Redis restarted under a steady offered load, each kind
several times (bench/restarts.py says the kinds and what is measured).

Everything is private and on loopback: a PostgreSQL initdb'd under /tmp
(tests/pgpair.PgServer), a redis-server without persistence
(bench/soak_stack.PrivateRedis), a ZooKeeper (scripts/zookeeper.sh), the counting
target of the reliability tests (tests/counting_target.py, in this process), two
scanners and two prefork workers. The machine's PostgreSQL and Redis are never
touched. Writes bench/results/restarts.json: each fault's times, p50 and max per
kind, and the verdict (tests/reliability/outages.py: missed, applied twice by
either count, queued twice, the invariants).
"""
from __future__ import annotations

import argparse
import os
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from bench import harness, restarts
from bench.harness import PY, ROOT, Layout, free_port, print_table, wait_for, write_result
from bench.soak_stack import PrivateRedis, ZooKeeper

DB = "sched_restarts"
WARMUP_S, TAIL_S = 20, 15


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rate", type=int, default=300, help="offered runs per second")
    parser.add_argument("--rounds", type=int, default=3, help="each restart kind this many times")
    parser.add_argument("--kinds", default=",".join(restarts.KINDS))
    parser.add_argument("--gap", type=float, default=12, help="seconds from one restart to the next")
    parser.add_argument("--hold", type=float, default=0,
                        help="seconds each server stays down before it is started again (a slower restart)")
    parser.add_argument("--lease", type=int, default=5)
    parser.add_argument("--requeue-after", type=int, default=5)
    parser.add_argument("--scan-interval", default="0.5")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=2, help="each worker's prefork children")
    parser.add_argument("--out-name", default="restarts", help="writes bench/results/<OUT_NAME>.json")


def run(args: argparse.Namespace) -> int:
    from tests.pgpair import PgServer

    kinds = restarts.plan(args.rounds, tuple(k for k in args.kinds.split(",") if k))
    workdir = Path(harness.tempfile.mkdtemp(prefix="sched-restarts-"))
    pg, zk = PgServer(), ZooKeeper(free_port())
    redis: PrivateRedis | None = None
    target: Any = None  # tests/counting_target.CountingTarget, once Django is set up
    layout: Layout | None = None
    load = LoadAverage()
    try:
        pg.start()
        pg.psql(pg.port, f"create database {DB}")
        redis = PrivateRedis(workdir)
        zk.start()
        extra = {
            "DATABASE_URL": pg.url(DB), "CELERY_BROKER_URL": redis.url, "SCHEDULER_BULKHEAD_REDIS_URL": redis.url,
            "ZOOKEEPER_HOSTS": zk.hosts, "SCHEDULER_ZK_ROOT": "/scheduler-restarts",
            "SCHEDULER_RUN_QUEUE": "runs-restarts", "SCHEDULER_DATA_DIR": str(workdir / "var"),
            "SCHEDULER_LEASE_SECONDS": str(args.lease), "SCHEDULER_REQUEUE_AFTER": str(args.requeue_after),
            "SCHEDULER_SCAN_INTERVAL": args.scan_interval, "SCHEDULER_ZK_SESSION_TIMEOUT": "4",
            "SCHEDULER_TARGET_CONCURRENCY": "100000",  # one target host: the bulkhead must not be the limit
        }
        env = harness.bench_env(**extra)
        env.pop("SCHEDULER_TASK_BROKER_URL", None)
        harness.sh(PY, "manage.py", "migrate", "-v", "0", cwd=ROOT, env=env)
        harness.setup_django(**extra)
        from tests.counting_target import CountingTarget

        target = CountingTarget(free_port()).start()
        layout = Layout(env=env, workdir=workdir)
        scanners = [layout.scanner(f"scanner-{i}") for i in (1, 2)]
        for i in range(args.workers):
            layout.worker(f"worker-{i + 1}", concurrency=args.concurrency)
        wait_for(lambda: all(_owns_some(s) for s in scanners), 60, "the scanners to split the partitions")
        load.start()
        seconds = int(WARMUP_S + len(kinds) * (args.gap + args.hold + 4) + TAIL_S)
        first_at = (datetime.now(timezone.utc) + timedelta(seconds=10)).replace(microsecond=0)
        runs = restarts.offered_load(target.url(), rate=args.rate, seconds=seconds, first_at=first_at)
        print(f"{len(runs)} runs due over {seconds} s at {args.rate}/s; faults: {', '.join(kinds)}", flush=True)
        faults = restarts.inject(kinds, pg, redis, target, rate=args.rate, gap=args.gap, warmup=WARMUP_S,
                                 hold=args.hold)
        time.sleep(max(0.0, first_at.timestamp() + seconds + 5 - time.time()))
        open_left = _wait_settled(runs, 120)
        load.stop()
        died = [p.name for p in layout.procs if not p.alive()]
        records, calls = restarts.run_records(runs), target.received()
        keys = {r.run_id: r.key for r in records}
        flows = restarts.time_to_flow(faults, records, calls, rate=args.rate,
                                      events=restarts.events_after(runs, ("requeued", "lease_expired")))
        from tests.reliability.outages import problems, verdict

        found = verdict(runs, target, once_per_key=False)
        summary: dict[str, Any] = {
            "offered_rate": args.rate, "runs": len(runs), "rounds": args.rounds, "gap_s": args.gap,
            "hold_s": args.hold,
            "settings": {"lease_s": args.lease, "requeue_after_s": args.requeue_after,
                         "scan_interval_s": float(args.scan_interval), "zk_session_s": 4},
            "layout": {"scanners": 2, "workers": args.workers, "concurrency": args.concurrency, "pool": "prefork",
                       "redis": "private, no persistence", "postgresql": "private, fsync off"},
            "faults": restarts.faults_as_dicts(faults), **flows,
            "verdict": {"missed": len(found["missed"]), "applied_twice": len(found["applied_twice"]),
                        "recorded_applied_twice": len(found["recorded_applied_twice"]),
                        "queued_twice": len(found["queued_twice"]),
                        "invariant_violations": len(found["invariant_violations"]),
                        "problems": {k: v[:20] for k, v in problems(found).items()}},
            "open_at_end": open_left, "processes_that_died": died,
            "scan_failures_logged": sum(s.output().count("scan failed") for s in scanners),
            "load_average": load.summary(),
            "per_second": restarts.per_second(records, calls),
            "latest_runs": [{"run": run_id, "late_s": None if late == float("inf") else round(late, 2),
                             "due": next(r.due for r in records if r.run_id == run_id),
                             "first_calls": sorted(at for key, _, at in calls if key == keys[run_id])[:3],
                             "events": events}
                            for run_id, late in restarts.latest(records, calls)
                            for events in [restarts.timelines([run_id]).get(run_id, [])]],
            "ok": not problems(found) and not died and all(f["first_call_s"] is not None for f in flows["faults"]),
        }
        rows = [(f"{kind} {measure}", f"p50 {v['p50']}  max {v['max']}" + (f"  never {v['never']}" if "never" in v else ""))
                for kind, measures in flows["by_kind"].items() for measure, v in measures.items() if measure != "n"]
        print_table("restarts", [(k, v) for k, v in summary.items() if not isinstance(v, (dict, list))] + rows)
        print("verdict:", summary["verdict"])
        print("written", write_result(args.out_name, summary))
        return 0 if summary["ok"] else 1
    finally:
        load.stop()
        if layout is not None:
            layout.stop_all()
        if target is not None:
            target.stop()
        if redis is not None:
            redis.stop()
        zk.stop()
        from django.db import connections

        connections.close_all()
        pg.stop()
        print("logs in", workdir)


def _owns_some(proc: harness.Proc) -> bool:
    from tests.reliability.outages import owned

    return bool(owned(proc))


def _wait_settled(run_ids: list[int], timeout: float) -> int:
    """Until none of the runs is open (or the timeout): how many are left open."""
    from runs.models import Run

    deadline = time.monotonic() + timeout
    while True:
        left = sum(Run.objects.filter(pk__in=run_ids[i: i + 20_000], status__in=Run.OPEN).count()
                   for i in range(0, len(run_ids), 20_000))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


class LoadAverage:
    """The machine's 1-minute load average every 5 s while the load runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(5):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"n": 0}
        return {"n": len(self.samples), "min": min(self.samples), "max": max(self.samples),
                "mean": round(sum(self.samples) / len(self.samples), 2), "cores": os.cpu_count()}
