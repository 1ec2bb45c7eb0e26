"""The bench scenarios. Each takes argparse args, prints a table, writes a JSON summary."""
from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import Layout, percentile, print_table, write_result

TARGET_PORT = harness.target_port(0)  # BENCH_TARGET_PORT (18081)
# Loading 100,000 jobs (and spreading them over the window) and starting the
# processes must be over before the due time, or the first seconds measure a late start.
SPIKE_LEAD_S = 120
UTC = timezone.utc


def add_layout_options(parser: argparse.ArgumentParser) -> None:
    # Chosen by measurement (docs/performance.md): one prefork worker with two children.
    parser.add_argument("--workers", type=int, default=1, help="worker processes (celery worker commands)")
    parser.add_argument("--concurrency", type=int, default=2, help="per worker (children for prefork)")
    parser.add_argument("--pool", default="prefork", choices=["prefork", "threads", "solo"])
    parser.add_argument("--scanners", type=int, default=1)
    parser.add_argument("--scan-interval", default=None,
                        help="SCHEDULER_SCAN_INTERVAL for the processes; not set (the default, 1 s) unless given")
    parser.add_argument("--batch", type=int, default=200, help="runs per run-queue message (SCHEDULER_DISPATCH_BATCH)")
    parser.add_argument("--calls", type=int, default=200, help="calls in flight per worker process (SCHEDULER_WORKER_CALLS)")


def _layout(args: argparse.Namespace, stats_dir: Path, **extra: str) -> Layout:
    env = harness.bench_env(
        **harness.scan_interval_env(args.scan_interval),
        SCHEDULER_COUNT_STATEMENTS_DIR=str(stats_dir),
        SCHEDULER_TARGET_CONCURRENCY="100000",
        SCHEDULER_DISPATCH_BATCH=str(args.batch),
        SCHEDULER_WORKER_CALLS=str(args.calls),
        **extra,
    )
    return Layout(env=env)


def _start_processes(layout: Layout, args: argparse.Namespace) -> None:
    for i in range(args.scanners):
        layout.scanner(f"scanner-{i + 1}")
    for i in range(args.workers):
        layout.worker(f"worker-{i + 1}", concurrency=args.concurrency, pool=args.pool)


def _prepare(**django_env: str) -> None:
    harness.setup_django(**django_env)
    from django.db import connections

    connections.close_all()  # the database is about to be dropped (WITH FORCE)
    harness.reset_database()
    harness.reset_redis()
    harness.start_zookeeper()


def _counter_files(stats_dir: Path) -> list[dict[str, Any]]:
    """Each process's statement counts (scheduler_project/statement_counter.py)."""
    found = []
    for path in stats_dir.glob("*.json"):
        try:
            found.append(json.loads(path.read_text()))
        except ValueError:
            continue
    return found


def _statements(stats_dir: Path) -> int:
    return _statement_counts(stats_dir)[0]


def _statement_counts(stats_dir: Path) -> tuple[int, dict[str, int]]:
    """The statements of every process, and (SCHEDULER_COUNT_STATEMENTS_BY_SQL=1) the
    same by process kind and the statements' first words, from one read of the files."""
    total, by_sql = 0, {}  # type: int, dict[str, float]
    for body in _counter_files(stats_dir):
        total += int(body.get("statements", 0))
        for key, n in body.get("by_sql", {}).items():
            by_sql[key] = by_sql.get(key, 0) + n
        for key, ms in body.get("ms_by_sql", {}).items():  # the time, under the key and MS_KEY
            by_sql[key + MS_KEY] = by_sql.get(key + MS_KEY, 0.0) + ms
    return total, by_sql


MS_KEY = " [ms]"


def _by_sql_per_run(before: dict[str, int], after: dict[str, int], runs: int) -> dict[str, float]:
    diff = {k: (n - before.get(k, 0)) / max(1, runs) for k, n in after.items()}
    return {k: round(v, 4) for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v > 0}


def _due_at_by_run(run_ids: list[int]) -> dict[int, tuple[datetime, int]]:
    """(due_at, attempt) of each run, read once every call is in."""
    from runs.models import Run

    due: dict[int, tuple[datetime, int]] = {}
    for start in range(0, len(run_ids), 20_000):
        chunk = list(set(run_ids[start : start + 20_000]))
        due.update((pk, (due_at, attempt)) for pk, due_at, attempt in
                   Run.objects.filter(pk__in=chunk).values_list("pk", "due_at", "attempt"))
    return due


def _start_lags(calls: list[tuple[float, int]], due: dict[int, tuple[datetime, int]]) -> tuple[list[float], int]:
    """One lag per run: its first call's receipt minus its due_at, and how many runs were
    called more than once. Those are left out: a retry moves due_at to the retry's time,
    so the row no longer holds the due_at the first call answered to."""
    first_call: dict[int, float] = {}
    calls_per_run: dict[int, int] = {}
    for at, rid in calls:
        first_call[rid] = min(at, first_call.get(rid, at))
        calls_per_run[rid] = calls_per_run.get(rid, 0) + 1
    again = {rid for rid, n in calls_per_run.items() if n > 1 or due[rid][1] > 1}
    lags = [at - due[rid][0].timestamp() for rid, at in first_call.items() if rid not in again]
    return lags, len(again)


def _lag_by_10s(calls: list[tuple[float, int]], due: dict[int, tuple[datetime, int]], first: datetime) -> dict[str, list[float]]:
    """Each 10 s of due times from `first`: the p99 and the max start lag of its runs."""
    first_call: dict[int, float] = {}
    for at, rid in calls:
        first_call[rid] = min(at, first_call.get(rid, at))
    buckets: dict[int, list[float]] = {}
    for rid, at in first_call.items():
        if due[rid][1] > 1:
            continue
        due_ts = due[rid][0].timestamp()
        buckets.setdefault(int((due_ts - first.timestamp()) // 10), []).append(at - due_ts)
    order = sorted(buckets)
    return {"p99": [round(percentile(buckets[b], 99), 3) for b in order],
            "max": [round(max(buckets[b]), 3) for b in order]}


def _lag_parts(first: datetime, end: datetime) -> dict[str, dict[str, float]]:
    """Where the lag goes, from the run rows (the store's clock): due to queued (the scanner),
    queued to started (the queue and the claim) and due to started (the wait for the due time
    and the claim: what is left of the lag is the call's way to the target), for the runs due
    in the window."""
    from runs.models import Run

    rows = Run.objects.filter(due_at__gte=first, due_at__lt=end).values_list("due_at", "queued_at", "started_at")
    parts: dict[str, list[float]] = {"queued_after_due": [], "started_after_queued": [], "started_after_due": []}
    for due_at, queued_at, started_at in rows:
        if started_at is not None:
            parts["started_after_due"].append((started_at - due_at).total_seconds())
        if queued_at is not None:
            parts["queued_after_due"].append((queued_at - due_at).total_seconds())
            if started_at is not None:
                parts["started_after_queued"].append((started_at - queued_at).total_seconds())
    return {
        name: {"p50": round(percentile(v, 50), 4), "p99": round(percentile(v, 99), 4), "min": round(min(v), 4),
               "max": round(max(v), 4), "runs": len(v)}
        for name, v in parts.items() if v
    }


def _warn_early(lags: list[float], called_again: int) -> None:
    """Issue 17: no run starts before its due_at. Loud, at the end, where it is seen."""
    early = [lag for lag in lags if lag < 0]
    if early:
        bar = "!" * 78
        print(f"\n{bar}\nWARNING: {len(early)} of {len(lags)} runs reached the target BEFORE their due_at "
              f"(earliest {min(early) * 1000:.1f} ms early). A run must never start early.\n{bar}", flush=True)
    if called_again:
        print(f"\nWARNING: {called_again} runs were called more than once; they are left out of the lag figures.",
              flush=True)


def _stop_target(target: harness.Proc) -> None:
    target.signal(signal.SIGTERM)
    target.popen.wait(timeout=30)


def _analyze_once_flowing(at: datetime) -> threading.Thread:
    """ANALYZE runs at `at`, once runs are being queued and claimed, from a thread of
    its own. The loaders' ANALYZE comes before any run is queued or running, and this
    box's PostgreSQL has autovacuum (and so autoanalyze) off: left with those
    statistics, the planner takes a status of `queued` or `running` for one row and
    reads the scanners' probe off runs_status_idx instead of the partial indexes, 29 ms
    a probe at 2,000 runs/s (docs/performance.md). Autoanalyze would have refreshed
    them in production; here it is done once, the same for every commit measured."""
    def run() -> None:
        _sleep_until(at)
        harness.psql("ANALYZE runs", db=harness.BENCH_DB)

    thread = threading.Thread(target=run, name="analyze-once", daemon=True)
    thread.start()
    return thread


def sustained(args: argparse.Namespace) -> int:
    """`rate * 60` every-minute jobs, each run spread over a 59 s window: a steady offered rate."""
    _prepare()
    from bench import load

    stats_dir = Path(harness.tempfile.mkdtemp(prefix="sched-stmts-"))
    layout = _layout(args, stats_dir)
    try:
        target = layout.target(TARGET_PORT, args.delay_ms)
        now = datetime.now(UTC)
        first = (now + timedelta(seconds=75)).replace(second=0, microsecond=0)  # at least 15 s to warm up
        count = args.rate * 60
        load.cron_jobs_with_first_runs(
            count=count, schedule_expr="* * * * *", target=f"http://127.0.0.1:{TARGET_PORT}/hook",
            window_seconds=59, after=first - timedelta(seconds=1),
        )
        load.analyze()
        _start_processes(layout, args)
        end = first + timedelta(minutes=args.minutes)
        _analyze_once_flowing(first + timedelta(seconds=3))
        _sleep_until(first)
        cpu0, (stmts0, by_sql0) = layout.cpu_by_kind(), _statement_counts(stats_dir)
        _sleep_until(end + timedelta(seconds=2))
        cpu1, (stmts1, by_sql1) = layout.cpu_by_kind(), _statement_counts(stats_dir)
        drain_deadline = time.time() + 60
        _stop_processes_after_drain(layout, drain_deadline, lambda: _count_open_due(end))
        _stop_target(target)
        arrivals = [(at, rid) for at, rid in layout.arrivals(TARGET_PORT)]
        due = _due_at_by_run([rid for _, rid in arrivals])
        in_window = [(at, rid) for at, rid in arrivals if rid in due and first <= due[rid][0] < end]
        lags, called_again = _start_lags(in_window, due)
        by_10s = _lag_by_10s(in_window, due, first)
        started_in_time = sum(1 for at, _ in in_window if at < end.timestamp() + 2)
        seconds = (end - first).total_seconds()
        done = len(in_window)
        summary: dict[str, Any] = {
            "offered_rate": args.rate,
            "minutes": args.minutes,
            "target_delay_ms": args.delay_ms,
            "runs_due": args.rate * 60 * args.minutes,
            "runs_called": done,
            "runs_per_second": round(started_in_time / seconds, 1),
            "lag_p50_s": round(percentile(lags, 50), 3),
            "lag_p95_s": round(percentile(lags, 95), 3),
            "lag_p99_s": round(percentile(lags, 99), 3),
            "lag_max_s": round(max(lags), 3) if lags else None,
            # Below 0 a run started before its due_at: the bench shouts (_warn_early).
            "lag_min_s": round(min(lags), 4) if lags else None,
            "lag_runs": len(lags),
            "runs_started_early": sum(1 for lag in lags if lag < 0),
            "runs_called_again": called_again,
            "lag_measured": "per run: its first call's receipt at the target (time.time() in bench/noop_target.py) "
                            "minus the run's due_at in the database, over every run due in the measured minutes",
            "lag_parts_s": _lag_parts(first, end),
            # Where in the measured minutes the lag was: p99 and max of the runs due in each
            # 10 s from `first` (a warm-up, a stall, or the whole run).
            "lag_by_10s": by_10s,
            "cpu_s_per_run": {k: round((cpu1[k] - cpu0.get(k, 0.0)) / max(1, started_in_time), 6) for k in cpu1},
            "statements_per_run": round((stmts1 - stmts0) / max(1, started_in_time), 2),
            "layout": _layout_summary(args),
        }
        if by_sql1:
            per_run = _by_sql_per_run(by_sql0, by_sql1, started_in_time)
            summary["statements_per_run_by_sql"] = {k: v for k, v in per_run.items() if not k.endswith(MS_KEY)}
            summary["statement_ms_per_run_by_sql"] = {k.removesuffix(MS_KEY): v for k, v in per_run.items()
                                                      if k.endswith(MS_KEY)}
            for name in ("statements_per_run_by_sql", "statement_ms_per_run_by_sql"):
                print(name)
                for key, n in list(summary[name].items())[:25]:
                    print(f"{n:8.4f}  {key}")
        print_table("sustained", [(k, v) for k, v in summary.items() if not isinstance(v, dict) and k != "lag_measured"])
        print("cpu seconds per run:", summary["cpu_s_per_run"])
        print("written", write_result(args.out_name, summary))
        _warn_early(lags, called_again)
        return 0
    finally:
        layout.cleanup()
        harness.stop_zookeeper()
        harness.shutil.rmtree(stats_dir, ignore_errors=True)


def spike(args: argparse.Namespace) -> int:
    """100,000 runs due at one instant; then the same spread over a window."""
    results: dict[str, Any] = {"runs": args.runs, "layout": _layout_summary(args)}
    if not args.skip_instant:
        _prepare()
        from bench import load

        stats_dir = Path(harness.tempfile.mkdtemp(prefix="sched-stmts-"))
        layout = _layout(args, stats_dir)
        try:
            target = layout.target(TARGET_PORT)
            at = (datetime.now(UTC) + timedelta(seconds=SPIKE_LEAD_S)).replace(microsecond=0)
            load.one_off_jobs(times=[at] * args.runs, target=f"http://127.0.0.1:{TARGET_PORT}/hook")
            load.analyze()
            _start_processes(layout, args)
            _analyze_once_flowing(at + timedelta(seconds=2))
            _sleep_until(at)
            cpu0 = layout.cpu_by_kind()
            _wait_drained(time.time() + 900, lambda: _count_open_due(at + timedelta(seconds=1)))
            cpu1 = layout.cpu_by_kind()
            layout.stop_all()
            _stop_target(target)
            arrivals = layout.arrivals(TARGET_PORT)
            last = max(a for a, _ in arrivals)
            results["all_started_s"] = round(last - at.timestamp(), 2)
            results["started"] = len({rid for _, rid in arrivals})
            results["drain_rate_per_s"] = round(results["started"] / results["all_started_s"], 1)
            # The same measure as `sustained`'s: CPU of each process kind over the drain, per run.
            results["cpu_s_per_run"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / max(1, results["started"]), 6)
                                        for k in cpu1}
            print("instant:", {k: results[k] for k in ("all_started_s", "started", "drain_rate_per_s", "cpu_s_per_run")},
                  flush=True)
        finally:
            layout.cleanup()
            harness.stop_zookeeper()
    if args.window:
        _prepare()
        from bench import load

        stats_dir = Path(harness.tempfile.mkdtemp(prefix="sched-stmts-"))
        layout = _layout(args, stats_dir)
        try:
            target = layout.target(TARGET_PORT)
            at = (datetime.now(UTC) + timedelta(seconds=SPIKE_LEAD_S)).replace(microsecond=0)
            ids = load.one_off_jobs(times=[at] * args.runs, target=f"http://127.0.0.1:{TARGET_PORT}/hook")
            _spread_over_window(ids, at, args.window)
            load.analyze()
            _start_processes(layout, args)
            _sleep_until(at + timedelta(seconds=args.window))
            _stop_processes_after_drain(layout, time.time() + 600, lambda: _count_open_due(at + timedelta(seconds=args.window + 1)))
            _stop_target(target)
            per_second = _per_second([a for a, _ in layout.arrivals(TARGET_PORT)], at.timestamp(), args.window)
            mean = sum(per_second) / len(per_second)
            results["window_s"] = args.window
            results["window_peak_per_s"] = max(per_second)
            results["window_mean_per_s"] = round(mean, 1)
            results["window_peak_to_mean"] = round(max(per_second) / mean, 3)
            results["window_plot"] = _plot(per_second, "spike-window.png", f"{args.runs} runs due at one instant, {args.window} s window")
        finally:
            layout.cleanup()
            harness.stop_zookeeper()
    print_table("spike", [(k, v) for k, v in results.items() if not isinstance(v, dict)])
    print("written", write_result("spike", results))
    return 0


def _spread_over_window(job_ids: list[int], at: datetime, window: int) -> None:
    from django.db import connection

    from jobs import schedule

    with connection.cursor() as cursor:
        cursor.execute("UPDATE jobs SET window_seconds = %s WHERE id = ANY(%s)", [window, job_ids])
        due = [schedule.spread_due_at(j, at, timedelta(seconds=window)) for j in job_ids]
        cursor.execute(
            "UPDATE runs SET due_at = s.due_at FROM unnest(%s::bigint[], %s::timestamptz[]) AS s(job_id, due_at) "
            "WHERE runs.job_id = s.job_id",
            [job_ids, due],
        )


def _per_second(arrivals: list[float], start: float, seconds: int) -> list[int]:
    buckets = [0] * seconds
    for at in arrivals:
        i = int(at - start)
        if 0 <= i < seconds:
            buckets[i] += 1
    return buckets


def _plot(series: list[int], name: str, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -r bench/requirements.txt)"
    path = harness.RESULTS_DIR / name
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.plot(range(len(series)), series, linewidth=0.8)
    ax.set_xlabel("seconds after the due time")
    ax.set_ylabel("runs started per second")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path.relative_to(harness.ROOT)) if path.is_relative_to(harness.ROOT) else str(path)


def _count_open_due(before: datetime) -> int:
    from runs.models import Run

    return Run.objects.filter(due_at__lt=before, status__in=Run.OPEN).count()


def _wait_drained(deadline: float, open_count: Any) -> None:
    """Wait until no run due in the measured range is open (or the deadline)."""
    while time.time() < deadline and open_count() > 0:
        time.sleep(0.5)
    time.sleep(0.5)


def _stop_processes_after_drain(layout: Layout, deadline: float, open_count: Any) -> None:
    _wait_drained(deadline, open_count)
    layout.stop_all()


def _sleep_until(when: datetime) -> None:
    delay = when.timestamp() - time.time()
    if delay > 0:
        time.sleep(delay)


def _layout_summary(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "workers": args.workers,
        "concurrency": args.concurrency,
        "pool": args.pool,
        "scanners": args.scanners,
        # None: SCHEDULER_SCAN_INTERVAL not set, the processes run on the default.
        "scan_interval_s": float(args.scan_interval) if args.scan_interval else None,
        "dispatch_batch": args.batch,
        "calls_per_worker": args.calls,
    }


def scan(args: argparse.Namespace) -> int:
    from bench import scan_scenario

    return scan_scenario.run(args)


def ops(args: argparse.Namespace) -> int:
    from bench import ops_scenario

    return ops_scenario.run(args)


def beat(args: argparse.Namespace) -> int:
    from bench import beat_scenario

    return beat_scenario.run(args)


def prune(args: argparse.Namespace) -> int:
    from bench import prune_scenario

    return prune_scenario.run(args)


def store(args: argparse.Namespace) -> int:
    from bench import store_scenario

    return store_scenario.run(args)


def neighbours(args: argparse.Namespace) -> int:
    from bench import neighbours_scenario

    return neighbours_scenario.run(args)


def noisy_neighbour(args: argparse.Namespace) -> int:
    from bench import noisy_neighbour_scenario

    return noisy_neighbour_scenario.run(args)


def failover(args: argparse.Namespace) -> int:
    from bench import failover_scenario

    return failover_scenario.run(args)


def limits(args: argparse.Namespace) -> int:
    from bench import limits_scenario

    return limits_scenario.run(args)


def idle(args: argparse.Namespace) -> int:
    from bench import idle_scenario

    return idle_scenario.run(args)


def restarts(args: argparse.Namespace) -> int:
    from bench import restart_scenario

    return restart_scenario.run(args)
