"""`beat`: 10,000 schedules due in the same minute, dispatched by celery beat with
django-celery-beat's DatabaseScheduler, then by this scheduler, on the same Redis
and the same Celery worker processes. Seconds from the due time to the last one
dispatched and to the last one executed, for both, and the ratio.

Two legs for this scheduler: `ours` calls the no-op HTTP target per run; `tasks`
imports the very same 10,000 periodic tasks with `import_beat` (moved to a new
minute) and publishes `bench.beat_probe` per run as a Celery task target, executed
by the same worker processes beat's probes ran on (`-Q runs,celery`).
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from bench import harness
from bench.harness import Layout, print_table, wait_for, write_result

UTC = timezone.utc
PORT = harness.target_port(2)  # BENCH_TARGET_PORT + 2
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
    load_before = _load()
    harness.reset_database()  # migrates django_celery_beat too (always installed)
    harness.reset_redis()
    harness.start_zookeeper()
    env = harness.bench_env(**harness.scan_interval_env(args.scan_interval), SCHEDULER_TARGET_CONCURRENCY="100000", **BEAT_ENV)
    layout = Layout(env=env)
    legs = set(args.legs.split(","))
    try:
        beat = _beat_side(layout, args) if "beat" in legs else _earlier("beat", args)
        ours = _our_side(layout, args) if "ours" in legs else _earlier("ours", args)
        tasks = _task_side(layout, args)
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
        "tasks_import_s": tasks["import_s"],
        "tasks_imported": tasks["imported"],
        "tasks_dispatch_s": tasks["dispatch_s"],
        "tasks_s": tasks["execute_s"],
        "tasks_dispatched": tasks["count"],
        "tasks_executed": tasks["executed"],
        "tasks_speedup": round(beat["dispatch_s"] / tasks["dispatch_s"], 1),
        "tasks_speedup_executed": round(beat["execute_s"] / tasks["execute_s"], 1),
        "legs_run": sorted(legs | {"tasks"}),
        "load_before": load_before,
        "load_after": _load(),
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
    from bench import load
    from runs.models import Run
    from bench.timelines import timelines_by_id

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
    wait_for(lambda: Run.objects.filter(status=Run.Status.SUCCEEDED).count() >= args.schedules, 900,
             "our runs to succeed", interval=0.5)
    # The `queued` entries, rows or on the run rows (runs.timeline).
    queued = [e.at for found in timelines_by_id(types=("queued",)).values() for e in found]
    dispatched = max(queued)
    target.signal(15)
    target.popen.wait(timeout=30)
    arrivals = layout.arrivals(PORT)
    layout.stop_all()
    return {
        "count": len(queued),
        "dispatch_s": round(dispatched.timestamp() - due.timestamp(), 2),
        "execute_s": round(max(a for a, _ in arrivals) - due.timestamp(), 2),
    }


def _earlier(leg: str, args: argparse.Namespace) -> dict[str, float]:
    """A leg not run this time: its figures from bench/results/beat.json (said so in
    the result's `legs_run`); the periodic tasks the task leg imports are made here."""
    import json

    from django_celery_beat.models import CrontabSchedule, PeriodicTask

    if leg == "beat" and not PeriodicTask.objects.filter(name__startswith="probe-").exists():
        crontab = CrontabSchedule.objects.create(minute="0", hour="0", timezone="UTC")
        PeriodicTask.objects.bulk_create(
            [PeriodicTask(name=f"probe-{i}", task="bench.beat_probe", crontab=crontab) for i in range(args.schedules)],
            batch_size=2000,
        )
    earlier = json.loads((harness.ROOT / "bench" / "results" / "beat.json").read_text())
    prefix = "beat" if leg == "beat" else "ours"
    return {"count": earlier[f"{prefix}_dispatched"], "dispatch_s": earlier[f"{prefix}_dispatch_s"],
            "execute_s": earlier[f"{prefix}_s"], "at": earlier["at"]}


def _task_side(layout: Layout, args: argparse.Namespace) -> dict[str, float]:
    """The beat leg's 10,000 periodic tasks, moved to a new minute, imported with
    `import_beat` (timed; not part of the dispatch figure) and run as task targets."""
    from django.db.models import Max
    from django_celery_beat.models import CrontabSchedule, PeriodicTask

    from bench import beat_tasks, load
    from jobs.models import Job
    from jobs.services import service_account_ensure, service_tasks_grant
    from runs.models import RunEvent

    beat_tasks.reset()
    owner, _ = service_account_ensure(name="beat-import")
    service_tasks_grant(name="beat-import", prefixes=["bench."])
    due = _next_minute(lead=args.import_lead)
    CrontabSchedule.objects.filter(periodictask__name__startswith="probe-").update(
        minute=str(due.minute), hour=str(due.hour), timezone="UTC"
    )
    PeriodicTask.objects.filter(name__startswith="probe-").update(enabled=True, last_run_at=None)
    started = time.time()
    harness.sh(harness.PY, "manage.py", "import_beat", "--owner", "beat-import", cwd=harness.ROOT, env=layout.env,
               timeout=args.import_lead)
    import_s = round(time.time() - started, 2)
    imported = Job.objects.filter(owner=owner, task="bench.beat_probe").count()
    if time.time() > due.timestamp() - 5:
        raise SystemExit(f"the import took {import_s}s, past the due minute: give --import-lead more than that")
    load.analyze()
    for i in range(args.scanners):
        layout.scanner(f"scanner-{i + 1}")
    for i in range(args.workers):
        layout.worker(f"worker-{i + 1}", concurrency=args.concurrency, pool=args.pool,
                      extra=["-I", "bench.beat_tasks", "-Q", "runs,celery"])
    _sleep_until(due)
    mine = RunEvent.objects.filter(run__job__owner=owner)
    published = mine.filter(type="published")
    wait_for(lambda: beat_tasks.figures()["executed"] >= args.schedules, 900, "the task runs' probes to execute", interval=0.5)
    # The `published` event is written with the run's outcome, after the broker took it.
    wait_for(lambda: published.count() >= args.schedules, 300, "every run's published event", interval=0.5)
    dispatched = published.aggregate(t=Max("at"))["t"]
    figures = beat_tasks.figures()
    layout.stop_all()
    return {
        "import_s": import_s,
        "imported": imported,
        "count": published.count(),
        "executed": figures["executed"],
        "dispatch_s": round(dispatched.timestamp() - due.timestamp(), 2),
        "execute_s": round(figures["executed_last"] - due.timestamp(), 2),
    }


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _sleep_until(when: datetime) -> None:
    delay = when.timestamp() - time.time()
    if delay > 0:
        time.sleep(delay)
