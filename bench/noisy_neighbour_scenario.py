"""One service's bad day beside another's ordinary one: `python bench/run.py noisy-neighbour [--minutes 10]`.

The production layout (PostgreSQL, Redis, ZooKeeper), two scanners and two workers of
two children each (Celery's default on this 2-core VM), the settings' defaults but for
those listed in the result's `settings_changed`.

- Service "quiet" (B): 600 jobs every minute, spread over the minute (10 runs a
  second), to a quick loopback target.
- Phase 1, `--minutes` long: B alone.
- Phase 2, `--minutes` long: service "noisy" (A) joins with 50 jobs every minute to
  50 ports that never answer (`timeout: 100s`, no retries), 50 jobs every minute whose
  target answers 500 (no retries: each run dies) with `notify` set to an https webhook
  that never answers, and, halfway through the phase, a burst of `--burst` one-off
  runs due at one instant (50,000) to a quick target of its own.

B's start lag is each run's arrival at its target less its due time (`due_at`). The
promise: outside the minute of A's burst, B's p99 over phase 2 is at most 50 ms and
at most twice phase 1's; in the burst's minute at most 1 s; none of B's runs skipped,
missing or later than its grace. Writes bench/results/noisy-neighbour.json.
"""
from __future__ import annotations

import argparse
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import PY, ROOT, Layout, percentile, print_table, write_result

UTC = timezone.utc
QUIET_JOBS = 600  # every minute, spread over it: 10 runs a second
HANGING = 50
DYING = 50
CHANGED = {
    # A worker child hands its calls still in flight after 0.25 s to its process's
    # writer: without it, each of the 50 hanging calls holds a worker child for 100 s
    # (docs/reliability.md: off by default for its cost at the highest rate).
    "SCHEDULER_WORKER_DETACH": "1",
}


def _lags(layout: Layout, port: int, due: dict[int, datetime]) -> dict[int, float]:
    """Run id: seconds from its due time to its first arrival at the target."""
    first: dict[int, float] = {}
    for at, run_id in layout.arrivals(port):
        if run_id in due and run_id not in first:
            first[run_id] = at - due[run_id].timestamp()
    return first


def _figures(lags: list[float]) -> dict[str, Any]:
    if not lags:
        return {"runs": 0}
    return {"runs": len(lags), "p50_ms": round(percentile(lags, 50) * 1000, 1),
            "p99_ms": round(percentile(lags, 99) * 1000, 1), "max_ms": round(max(lags) * 1000, 1)}


def run(args: argparse.Namespace) -> int:
    harness.setup_django(**CHANGED)
    from django.db import connections

    connections.close_all()
    harness.reset_database()
    harness.reset_redis()
    harness.start_zookeeper()
    from django.conf import settings

    from bench import load
    from jobs.services import job_create, service_account_ensure
    from runs.models import Run

    quiet_port, burst_port = harness.target_port(0), harness.target_port(3)
    hang_ports = [harness.free_port() for _ in range(HANGING + 1)]  # the last: the notify webhook
    fail_port = harness.free_port()
    layout = Layout(env=harness.bench_env(**CHANGED))
    try:
        layout.target(quiet_port)
        layout.target(burst_port)
        bad = layout.start("target", "bad-targets", [
            PY, str(ROOT / "bench" / "bad_targets.py"), "--hang", ",".join(map(str, hang_ports)),
            "--fail", str(fail_port), "--hang-seconds", "600"])
        harness.wait_for(lambda: "listening" in bad.output(), 10, "the bad targets to listen")
        start = datetime.now(UTC)
        load.cron_jobs_with_first_runs(count=QUIET_JOBS, schedule_expr="* * * * *", window_seconds=60,
                                       target=f"http://127.0.0.1:{quiet_port}/hook", after=start, owner="quiet")
        load.analyze()
        for i in range(2):
            layout.scanner(f"scanner-{i + 1}")
        for i in range(2):
            layout.worker(f"worker-{i + 1}", concurrency=2)
        # Phase 1 starts at the next whole minute past a minute of warming up.
        phase1 = (datetime.now(UTC) + timedelta(minutes=1, seconds=30)).replace(second=0, microsecond=0)
        phase2 = phase1 + timedelta(minutes=args.minutes)
        end = phase2 + timedelta(minutes=args.minutes)
        burst_at = phase2 + timedelta(minutes=args.minutes // 2, seconds=30)
        harness.wait_for(lambda: datetime.now(UTC) >= phase2 - timedelta(seconds=40), args.minutes * 60 + 200,
                         "phase 1 to pass", interval=1.0)
        noisy, _ = service_account_ensure(name="noisy")
        every = {"schedule": "* * * * *", "retry_max": 0}
        for i, port in enumerate(hang_ports[:HANGING]):
            job_create(owner=noisy, fields={**every, "name": f"hangs {i}", "target": f"http://127.0.0.1:{port}/slow",
                                            "timeout_seconds": 100})
        webhook = f"https://127.0.0.1:{hang_ports[-1]}/notice"
        for i in range(DYING):
            job_create(owner=noisy, fields={**every, "name": f"dies {i}", "target": f"http://127.0.0.1:{fail_port}/x",
                                            "notify": webhook, "notify_on": ["dead"]})
        # The burst's rows are written ahead (tens of seconds for 50,000); all due at burst_at.
        harness.wait_for(lambda: datetime.now(UTC) >= burst_at - timedelta(seconds=60), args.minutes * 60,
                         "the burst's lead", interval=1.0)
        load.one_off_jobs(times=[burst_at] * args.burst, target=f"http://127.0.0.1:{burst_port}/burst",
                          owner="noisy")
        load.analyze()
        harness.wait_for(lambda: datetime.now(UTC) >= end + timedelta(seconds=30), args.minutes * 60 + 200,
                         "phase 2 to pass", interval=1.0)
        cpu = layout.cpu_by_kind()
        layout.stop_all()

        quiet = service_account_ensure(name="quiet")[0]
        rows = list(Run.objects.filter(job__owner=quiet, scheduled_for__gte=phase1, scheduled_for__lt=end)
                    .values_list("pk", "scheduled_for", "due_at", "status"))
        due = {pk: due_at for pk, _, due_at, _ in rows}
        lags = _lags(layout, quiet_port, due)
        burst_minute = (burst_at, burst_at + timedelta(minutes=1))

        def lags_in(low: datetime, high: datetime, *, outside: tuple[datetime, datetime] | None = None) -> list[float]:
            return [lags[pk] for pk, _, due_at, _ in rows if pk in lags and low <= due_at < high
                    and not (outside and outside[0] <= due_at < outside[1])]

        one = _figures(lags_in(phase1, phase2))
        two = _figures(lags_in(phase2, end, outside=burst_minute))
        during = _figures(lags_in(*burst_minute))
        statuses: dict[str, int] = {}
        for _, _, _, status in rows:
            statuses[status] = statuses.get(status, 0) + 1
        grace = settings.SCHEDULER_MISFIRE_GRACE
        missing = [pk for pk, _, due_at, _ in rows if pk not in lags and due_at < end - timedelta(seconds=5)]
        noisy_runs = Run.objects.filter(job__owner=noisy, scheduled_for__gte=phase2, scheduled_for__lt=end)
        burst_arrivals = sorted(at for at, _ in layout.arrivals(burst_port))
        summary: dict[str, Any] = {
            "minutes_per_phase": args.minutes,
            "quiet_phase_1_alone": one,
            "quiet_phase_2_outside_burst_minute": two,
            "quiet_burst_minute": during,
            "quiet_statuses": statuses,
            "quiet_missing": len(missing),
            "quiet_later_than_grace": sum(1 for v in lags.values() if v > grace),
            "holds": {
                "outside_p99_at_most_50ms": two.get("p99_ms", 1e9) <= 50,
                "outside_p99_at_most_twice_alone": two.get("p99_ms", 1e9) <= 2 * one.get("p99_ms", 0),
                "burst_minute_p99_at_most_1s": during.get("p99_ms", 1e9) <= 1000,
                "none_skipped_missing_or_past_grace": not missing and statuses.get("skipped", 0) == 0
                and not any(v > grace for v in lags.values()),
            },
            "noisy": {
                "burst_runs": args.burst,
                "burst_started": len(burst_arrivals),
                "burst_all_started_s": round(burst_arrivals[-1] - burst_at.timestamp(), 1) if burst_arrivals else None,
                "hanging_jobs": HANGING, "dying_jobs_with_hanging_webhook": DYING,
                "runs_by_status": {s: noisy_runs.filter(status=s).count() for s in ("succeeded", "failed", "dead",
                                                                                       "skipped", "scheduled")},
            },
            "cpu_s_by_kind": {k: round(v, 1) for k, v in cpu.items()},
            "layout": {"scanners": 2, "workers": 2, "concurrency": 2, "settings_changed": CHANGED},
        }
        print_table("noisy-neighbour", [(k, v) for k, v in summary.items() if not isinstance(v, (list, dict))]
                    + [(k, v) for k, v in summary["holds"].items()]
                    + [("phase 1 p99 ms", one.get("p99_ms")), ("phase 2 p99 ms", two.get("p99_ms")),
                       ("burst minute p99 ms", during.get("p99_ms"))])
        print("written", write_result(args.out_name, summary))
        return 0
    finally:
        layout.cleanup()
        harness.stop_zookeeper()
