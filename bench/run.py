"""Benches on the production layout: `python bench/run.py SCENARIO [options]`.

Scenarios: sustained, spike, scan, beat, neighbours, noisy-neighbour, failover, limits, ops, idle, restarts, store, prune. Each prints a table
and writes bench/results/<scenario>.json (with the machine it ran on).
PostgreSQL and Redis must be up (scripts/test.sh leaves them so); the bench
starts its own ZooKeeper on BENCH_ZK_PORT (21812) and its own target on
BENCH_TARGET_PORT (18081, and the next few ports for other scenarios); `restarts`
runs a PostgreSQL, a Redis and a ZooKeeper of its own, on free ports or, with
BENCH_PORTS=LO-HI, ports of that range.
To run a scenario on an older commit's code: bench/baseline.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import scenarios  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="scenario", required=True)

    p = sub.add_parser("sustained", help="runs due at a steady offered rate")
    p.add_argument("--rate", type=int, default=650, help="offered runs per second")
    p.add_argument("--minutes", type=int, default=2)
    p.add_argument("--delay-ms", type=float, default=0.0, help="target latency")
    p.add_argument("--out-name", default="sustained", help="writes bench/results/<OUT_NAME>.json")
    scenarios.add_layout_options(p)

    p = sub.add_parser("spike", help="100,000 runs due at one instant, then spread over a window")
    p.add_argument("--runs", type=int, default=100_000)
    p.add_argument("--window", type=int, default=300, help="seconds; 0 skips the window part")
    p.add_argument("--skip-instant", action="store_true")
    scenarios.add_layout_options(p)

    p = sub.add_parser("scan", help="the due query at 1e4..1e7 rows")
    p.add_argument("--max-exp", type=int, default=7)

    p = sub.add_parser("beat", help="side by side with celery beat + django-celery-beat")
    p.add_argument("--schedules", type=int, default=10_000)
    p.add_argument("--legs", default="beat,ours,tasks",
                   help="legs to run (tasks always); a leg left out keeps its figures from bench/results/beat.json")
    p.add_argument("--import-lead", type=int, default=1200, help="seconds allowed for import_beat before the due minute")
    scenarios.add_layout_options(p)

    p = sub.add_parser("neighbours", help="a fast job beside a 65 s one on one host, minute by minute")
    p.add_argument("--minutes", type=int, default=10, help="the measured minutes")

    p = sub.add_parser("noisy-neighbour", help="one service's hanging targets, dying runs and burst beside another's")
    p.add_argument("--minutes", type=int, default=10, help="each phase's length: the quiet service alone, then both")
    p.add_argument("--burst", type=int, default=50_000, help="the noisy service's runs due at one instant")
    p.add_argument("--out-name", default="noisy-neighbour", help="writes bench/results/<OUT_NAME>.json")

    p = sub.add_parser("failover", help="scanner and worker kill -9 to recovery")
    p.add_argument("--lease", type=int, default=10)

    sub.add_parser("limits", help="the parts' ceilings on this box")

    p = sub.add_parser("idle", help="100,000 jobs, none due soon: what two scanners cost doing nothing")
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--minutes", type=float, default=5, help="the measured window")
    p.add_argument("--scanners", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=2, help="the worker's children")
    p.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    p.add_argument("--out-name", default="idle", help="writes bench/results/<OUT_NAME>.json")

    p = sub.add_parser("restarts", help="PostgreSQL and Redis restarted under a steady load: time until runs flow")
    from bench import restart_scenario

    restart_scenario.add_options(p)

    p = sub.add_parser("ops", help="the dashboard, the system page and /metrics with 10^7 runs")
    p.add_argument("--runs", type=int, default=10_000_000, help="finished runs in the table")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--reuse", action="store_true", help="keep the bench database if it holds the rows already")

    p = sub.add_parser("prune", help="prune_runs dropping a day of 10^7 finished runs in day partitions")
    p.add_argument("--runs", type=int, default=10_000_000, help="finished runs in the history")
    p.add_argument("--days", type=int, default=10, help="day partitions they fill")
    p.add_argument("--events-every", type=int, default=100, help="one run in this many has an event row")
    p.add_argument("--repeat", type=int, default=30, help="due queries timed at each point")
    p.add_argument("--out-name", default="prune", help="writes bench/results/<OUT_NAME>.json")

    p = sub.add_parser("store", help="bytes, WAL and row writes per finished run in PostgreSQL, under a sustained load")
    p.add_argument("--rate", type=int, default=500, help="offered runs per second")
    p.add_argument("--minutes", type=int, default=2, help="the measured part (the issue's long run: 30)")
    p.add_argument("--sample-seconds", type=float, default=10.0, help="the time series' step")
    p.add_argument("--baseline-into", default="", metavar="PATH",
                   help="write this run's figures under `baseline` in PATH (a run from an older commit's tree)")
    p.add_argument("--vacuum-every", type=float, default=60.0,
                   help="seconds; on a server with autovacuum off, apply autovacuum's rule this often (0: never)")
    p.add_argument("--out-name", default="store", help="writes bench/results/<OUT_NAME>.json and <OUT_NAME>-growth.png")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    p.add_argument("--partition-width", default="", metavar="DURATION",
                   help="SCHEDULER_RUN_PARTITION_WIDTH for the processes (e.g. 2m); default: the setting's")
    p.add_argument("--retention", default="", metavar="DURATION",
                   help="SCHEDULER_RUN_RETENTION for the processes (e.g. 10m): the history pruned during the run")
    p.add_argument("--skip-wal-detail", action="store_true",
                   help="WAL per run from the LSN difference alone (cluster-wide), not read back record by record")
    scenarios.add_layout_options(p)

    args = parser.parse_args()
    return int(getattr(scenarios, args.scenario.replace("-", "_"))(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
