"""`failover`: seconds from `kill -9` of a scanner to its partitions being scanned
again, and from `kill -9` of a worker mid-call to its run being claimed again."""
from __future__ import annotations

import argparse
import re
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import Layout, print_table, wait_for, write_result

UTC = timezone.utc
PORT = harness.target_port(1)  # BENCH_TARGET_PORT + 1


def run(args: argparse.Namespace) -> int:
    harness.setup_django()
    harness.reset_database()
    harness.reset_redis()
    harness.start_zookeeper()
    env = harness.bench_env(
        SCHEDULER_LEASE_SECONDS=str(args.lease), SCHEDULER_SCAN_INTERVAL="1",
        SCHEDULER_ZK_SESSION_TIMEOUT="10",
    )
    layout = Layout(env=env)
    try:
        layout.target(PORT, delay_ms=30_000)  # every call hangs: the worker is mid-call when killed
        survivor, doomed = layout.scanner("scanner-1"), layout.scanner("scanner-2")
        workers = [layout.worker("worker-1", concurrency=2, pool="prefork"), layout.worker("worker-2", concurrency=2, pool="prefork")]
        wait_for(lambda: 0 < len(_owned(survivor)) < 16 and _owned(doomed), 60, "the scanners to split the partitions")
        killed = time.time()
        doomed.kill()
        taken_at = wait_for(lambda: _owned_all_at(survivor), 120, "the survivor to own every partition")
        scanner_s = taken_at - killed

        run_id = _one_run_due_now()
        holder = wait_for(lambda: _holder(run_id), 60, "a worker to claim the run")
        victim = next(w for w in workers if holder.startswith(w.name + "@"))
        time.sleep(1.0)  # in the middle of the call
        killed = time.time()
        victim.kill()
        reclaimed = wait_for(lambda: _second_claim(run_id), args.lease * 3 + 60, "the run to be claimed again")
        worker_s = reclaimed - killed
        summary: dict[str, Any] = {
            "scanner_s": round(scanner_s, 2),
            "worker_s": round(worker_s, 2),
            "zk_session_timeout_s": 10,
            "zk_tick_s": 0.2,
            "scan_interval_s": 1,
            "lease_s": args.lease,
            "scanner_bound_s": 10 + 1,  # the session timeout plus one scan
            "worker_bound_s": args.lease + 1,  # the lease plus one scan
            "scanner_within_bound": scanner_s <= 10 + 1,
            "worker_within_bound": worker_s <= args.lease + 1,
        }
        print_table("failover", list(summary.items()))
        print("written", write_result("failover", summary))
        return 0
    finally:
        layout.cleanup()
        harness.stop_zookeeper()


def _owned_lines(proc: harness.Proc) -> list[tuple[set[int], float]]:
    found = []
    for line in proc.output().splitlines():
        m = re.match(r"partitions \[(.*)\] at ([\d.]+)", line)
        if m:
            found.append(({int(p) for p in m.group(1).split(",") if p.strip()}, float(m.group(2))))
    return found


def _owned(proc: harness.Proc) -> set[int]:
    lines = _owned_lines(proc)
    return lines[-1][0] if lines else set()


def _owned_all_at(proc: harness.Proc) -> float | None:
    lines = _owned_lines(proc)
    return lines[-1][1] if lines and len(lines[-1][0]) == 16 else None


def _one_run_due_now() -> int:
    from jobs.services import job_create, service_account_ensure

    owner, _ = service_account_ensure(name="bench-failover")
    job = job_create(owner=owner, fields={
        "schedule": "", "run_at": datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1),
        "target": f"http://127.0.0.1:{PORT}/hang", "timeout_seconds": 600,
    })
    return job.runs.get().pk


def _holder(run_id: int) -> str:
    from runs.models import Run

    return Run.objects.filter(pk=run_id, status="running").values_list("lease_owner", flat=True).first() or ""


def _second_claim(run_id: int) -> float | None:
    from bench.timelines import timelines_by_id

    claims = sorted(e.at for e in timelines_by_id([run_id], types=("claimed",)).get(run_id, []))
    return claims[1].timestamp() if len(claims) >= 2 else None
