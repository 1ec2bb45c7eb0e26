"""Workers' heartbeats: each Celery worker writes its own row every few seconds
(SCHEDULER_WORKER_HEARTBEAT, default 5 s) from a thread of its main process, with
the runs it holds a live lease on. The system page reads the rows (one query);
nothing is broadcast, so a dead or hung worker cannot hang the page: it just stops
beating, and shows as gone after three missed beats.

Started by Celery's `worker_ready` signal (any pool: prefork, threads, solo) and
marked stopped by `worker_shutdown` (scheduler_project/celery.py connects them).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from runs import storegate
from runs.models import Run, WorkerHeartbeat

logger = logging.getLogger(__name__)
_stop = threading.Event()


def interval() -> float:
    return float(getattr(settings, "SCHEDULER_WORKER_HEARTBEAT", 5))


def worker_beat(*, name: str, host: str, started_at: datetime, now: datetime | None = None) -> WorkerHeartbeat:
    """One heartbeat: the row made or brought up to date, with the runs in flight."""
    now = now or timezone.now()
    in_flight = Run.objects.filter(
        status=Run.Status.RUNNING, lease_owner__startswith=f"{name}/", lease_expires_at__gt=now
    ).count()
    beat, _ = WorkerHeartbeat.objects.update_or_create(
        name=name,
        defaults={"host": host, "pid": os.getpid(), "started_at": started_at, "beat_at": now,
                  "in_flight": in_flight, "stopped_at": None},
    )
    return beat


def worker_stopped(*, name: str, now: datetime | None = None) -> None:
    WorkerHeartbeat.objects.filter(name=name).update(stopped_at=now or timezone.now(), in_flight=0)


def start(name: str, consumer: object = None) -> threading.Thread:
    """The heartbeat thread of this worker process (a daemon: it dies with the process).
    Its beats also tell the store gate (runs.storegate) whether the store is in reach:
    while it is not, the worker takes no run messages (`consumer`: Celery's), and it
    beats every second, to open the gate again soon after the store is back."""
    started_at = timezone.now()
    host = socket.gethostname()
    _stop.clear()
    gate = storegate.Gate(*storegate.consumer_switches(consumer))

    def loop() -> None:
        while not _stop.is_set():
            gate.beat_started()
            try:
                close_old_connections()
                worker_beat(name=name, host=host, started_at=started_at)
                gate.beat_ended(ok=True)
            except Exception:  # noqa: BLE001 - a missed beat shows on the page; the worker goes on
                gate.beat_ended(ok=False)
                logger.warning("worker heartbeat of %s not written", name, exc_info=True)
                try:
                    connection.close()
                except Exception:  # noqa: BLE001 - a broken link: the next beat connects again
                    pass
            _stop.wait(min(1.0, interval()) if storegate.is_closed() else interval())
        connection.close()

    thread = threading.Thread(target=loop, name="scheduler-heartbeat", daemon=True)
    thread.start()
    return thread


def stop(name: str) -> None:
    _stop.set()
    try:
        worker_stopped(name=name)
    except Exception:  # noqa: BLE001 - shutting down: the beats stop either way
        logger.warning("could not mark worker %s stopped", name, exc_info=True)


@dataclass(frozen=True)
class WorkerFigures:
    name: str
    host: str
    pid: int
    started_at: datetime
    beat_at: datetime
    in_flight: int
    alive: bool
    stopped: bool
    seconds_since_beat: float


def worker_figures(now: datetime | None = None, limit: int = 200) -> list[WorkerFigures]:
    """Every worker that beat in the last day, alive first: one query."""
    now = now or timezone.now()
    missed = timedelta(seconds=3 * interval())
    rows = WorkerHeartbeat.objects.filter(beat_at__gte=now - timedelta(days=1)).order_by("name")[:limit]
    found = [
        WorkerFigures(
            name=w.name,
            host=w.host,
            pid=w.pid,
            started_at=w.started_at,
            beat_at=w.beat_at,
            in_flight=w.in_flight,
            alive=w.stopped_at is None and now - w.beat_at <= missed,
            stopped=w.stopped_at is not None,
            seconds_since_beat=max((now - w.beat_at).total_seconds(), 0.0),
        )
        for w in rows
    ]
    return sorted(found, key=lambda w: (not w.alive, w.name))
