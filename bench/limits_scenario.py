"""`limits`: the ceilings of the parts on this box, for the ratios in docs/performance.md.

pgbench simple-update TPS, redis-benchmark, a Celery no-op task round trip rate,
and the no-op target's requests per second (wrk when installed, else a Python client).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import time
from typing import Any

from bench import harness
from bench.harness import Layout, print_table, write_result

PGBENCH_DB = "sched_pgbench"


def run(args: argparse.Namespace) -> int:
    summary: dict[str, Any] = {}
    summary["pgbench_simple_update_tps"] = _pgbench()
    summary.update(_redis_benchmark())
    summary["celery_noop_round_trips_per_s"] = _celery_round_trips()
    summary["noop_target_requests_per_s"] = _target_rps()
    print_table("limits", list(summary.items()))
    print("written", write_result("limits", summary))
    return 0


def _pgbench() -> float:
    harness.psql(f"DROP DATABASE IF EXISTS {PGBENCH_DB} WITH (FORCE)")
    harness.psql(f"CREATE DATABASE {PGBENCH_DB}")
    url = f"{harness.PG}/{PGBENCH_DB}"
    harness.sh("pgbench", "-i", "-q", "-s", "10", url)
    out = harness.sh("pgbench", "-N", "-c", "8", "-j", "2", "-T", "20", url).stdout
    harness.psql(f"DROP DATABASE IF EXISTS {PGBENCH_DB} WITH (FORCE)")
    return float(re.search(r"tps = ([\d.]+)", out).group(1))  # type: ignore[union-attr]


def _redis_benchmark() -> dict[str, float]:
    out = harness.sh("redis-benchmark", "-q", "-n", "100000", "-t", "set,lpush,rpop", "--csv").stdout
    figures = {}
    for line in out.splitlines():
        parts = [p.strip('"') for p in line.split(",")]
        if len(parts) >= 2 and parts[0] in ("SET", "LPUSH", "RPOP"):
            figures[f"redis_{parts[0].lower()}_per_s"] = float(parts[1])
    return figures


def _celery_round_trips(count: int = 5000) -> float:
    """Publish `count` no-op tasks through Redis and time until a worker has run them all."""
    env = harness.bench_env(CELERY_BROKER_URL=f"redis://127.0.0.1:6379/{harness.REDIS_DB}")
    harness.reset_redis()
    layout = Layout(env=env)
    try:
        layout.start("worker", "noop-worker", [harness.PY, "-m", "celery", "-A", "bench.celery_noop", "worker", "-l",
                                               "WARNING", "-c", "2", "-P", "prefork", "--without-heartbeat",
                                               "--without-gossip", "--without-mingle"])
        code = (
            "import sys, time; sys.path.insert(0, '.');\n"
            "from bench.celery_noop import app, noop, done_count, reset\n"
            "reset(); time.sleep(3)\n"
            f"started = time.time()\n"
            f"with app.producer_or_acquire() as p:\n"
            f"    [noop.apply_async(producer=p) for _ in range({count})]\n"
            f"while done_count() < {count} and time.time() - started < 120: time.sleep(0.05)\n"
            f"print('ELAPSED', time.time() - started, done_count())\n"
        )
        out = subprocess.run([harness.PY, "-c", code], cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=180).stdout
        elapsed = float(re.search(r"ELAPSED ([\d.]+)", out).group(1))  # type: ignore[union-attr]
        return round(count / elapsed, 1)
    finally:
        layout.cleanup()


def _target_rps() -> float:
    layout = Layout(env=harness.bench_env())
    port = harness.target_port(8)  # BENCH_TARGET_PORT + 8 (18089)
    try:
        layout.target(port)
        if shutil.which("wrk"):
            out = harness.sh("wrk", "-t2", "-c32", "-d10s", f"http://127.0.0.1:{port}/").stdout
            return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
        import urllib3  # the worker's own HTTP client (runs.delivery)

        pool, count, started = urllib3.HTTPConnectionPool("127.0.0.1", port, maxsize=1), 0, time.time()
        while time.time() - started < 5:
            pool.request("GET", "/")
            count += 1
        return round(count / (time.time() - started), 1)
    finally:
        layout.cleanup()
