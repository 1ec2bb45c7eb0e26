"""`beat`: 10,000 schedules due in the same minute, dispatched by celery beat with
django-celery-beat's DatabaseScheduler, then by this scheduler, on the same Redis
and the same Celery worker processes. Seconds from the due time to the last one
dispatched and to the last one executed, for both, and the ratio.

Needs `pip install -r bench/requirements.txt` (django-celery-beat).
"""
from __future__ import annotations

import argparse
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import Layout, print_table, wait_for, write_result

UTC = timezone.utc
PORT = 18083
BEAT_ENV = {"SCHEDULER_BENCH_BEAT": "1"}


def _next_minute(lead: int) -> datetime:
    return (datetime.now(UTC) + timedelta(seconds=lead + 60)).replace(second=0, microsecond=0)


def run(args: argparse.Namespace) -> int:
    try:
        import django_celery_beat  # noqa: F401
    except ImportError:
        print("beat needs django-celery-beat: .venv/bin/pip install -r bench/requirements.txt")
        return 2
    harness.setup_django(**BEAT_ENV)
    harness.reset_database()  # migrates django_celery_beat too (SCHEDULER_BENCH_BEAT=1 in the env)
    harness.reset_redis()
    harness.start_zookeeper()
    env = harness.bench_env(SCHEDULER_SCAN_INTERVAL=args.scan_interval, SCHEDULER_TARGET_CONCURRENCY="100000", **BEAT_ENV)
    layout = Layout(env=env)
    try:
        beat = _beat_side(layout, args)
        ours = _our_side(layout, args)
    finally:
        layout.cleanup()
        harness.stop_zookeeper()
    summary: dict[str, Any] = {
        "schedules": args.schedules,
        "beat_dispatch_s": beat["dispatch_s"],
        "beat_s": beat["execute_s"],
        "ours_dispatch_s": ours["dispatch_s"],
        "ours_s": ours["execute_s"],
        "speedup": round(beat["dispatch_s"] / ours["dispatch_s"], 1),
        "speedup_executed": round(beat["execute_s"] / ours["execute_s"], 1),
        "beat_dispatched": beat["count"],
        "ours_dispatched": ours["count"],
        "layout": {"workers": args.workers, "concurrency": args.concurrency, "pool": args.pool},
    }
    print_table("beat", [(k, v) for k, v in summary.items() if not isinstance(v, dict)])
    print("written", write_result("beat", summary))
    return 0


def _workers(layout: Layout, args: argparse.Namespace) -> None:
    for i in range(args.workers):
        layout.worker(f"worker-{i + 1}", concurrency=args.concurrency, pool=args.pool, extra=["-I", "bench.beat_tasks"])


def _beat_side(layout: Layout, args: argparse.Namespace) -> dict[str, float]:
    from django_celery_beat.models import CrontabSchedule, PeriodicTask

    from bench import beat_tasks

    due = _next_minute(lead=30)
    crontab = CrontabSchedule.objects.create(minute=str(due.minute), hour=str(due.hour), timezone="UTC")
    PeriodicTask.objects.bulk_create(
        [PeriodicTask(name=f"probe-{i}", task="bench.beat_probe", crontab=crontab) for i in range(args.schedules)],
        batch_size=2000,
    )
    _workers(layout, args)
    beat = layout.start("beat", "beat", [harness.PY, "-m", "celery", "-A", "scheduler_project", "beat", "-l", "WARNING",
                                           "-S", "django_celery_beat.schedulers:DatabaseScheduler",
                                           "--pidfile", str(layout.workdir / "beat.pid")])
    _sleep_until(due)
    wait_for(lambda: beat_tasks.figures()["executed"] >= args.schedules, 1800, "beat's tasks to be executed", interval=1.0)
    figures = beat_tasks.figures()
    beat.stop()
    layout.stop_all()
    return {
        "count": figures["dispatched"],
        "dispatch_s": round(figures["dispatched_last"] - due.timestamp(), 2),
        "execute_s": round(figures["executed_last"] - due.timestamp(), 2),
    }


def _our_side(layout: Layout, args: argparse.Namespace) -> dict[str, float]:
    from django.db.models import Max

    from bench import load
    from runs.models import RunEvent

    target = layout.target(PORT)
    due = _next_minute(lead=30)
    load.cron_jobs_with_first_runs(
        count=args.schedules, schedule_expr=f"{due.minute} {due.hour} * * *",
        target=f"http://127.0.0.1:{PORT}/hook", window_seconds=0, after=due - timedelta(seconds=1),
    )
    load.analyze()
    for i in range(args.scanners):
        layout.scanner(f"scanner-{i + 1}")
    _workers(layout, args)
    _sleep_until(due)
    wait_for(lambda: RunEvent.objects.filter(type="succeeded").count() >= args.schedules, 900, "our runs to succeed", interval=0.5)
    dispatched = RunEvent.objects.filter(type="queued").aggregate(t=Max("at"))["t"]
    target.signal(15)
    target.popen.wait(timeout=30)
    arrivals = layout.arrivals(PORT)
    layout.stop_all()
    return {
        "count": RunEvent.objects.filter(type="queued").count(),
        "dispatch_s": round(dispatched.timestamp() - due.timestamp(), 2),
        "execute_s": round(max(a for a, _ in arrivals) - due.timestamp(), 2),
    }


def _sleep_until(when: datetime) -> None:
    delay = when.timestamp() - time.time()
    if delay > 0:
        time.sleep(delay)
