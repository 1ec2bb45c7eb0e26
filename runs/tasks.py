"""Celery tasks: thin, ids in, a service call."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from datetime import datetime

from celery import Task, shared_task
from django.conf import settings
from django.db import InterfaceError, OperationalError, close_old_connections, connection, connections

from runs import storegate, waiters
from runs.delivery import CallPool, _PerProcess
from runs.services import run_execute_many

logger = logging.getLogger("scheduler.runs")


def _worker(task: Task) -> str:
    # The worker's name in the run's timeline: Celery node, process, thread.
    return f"{task.request.hostname or 'worker'}/{os.getpid()}/{threading.get_ident() % 100000}"


@shared_task(bind=True, name="runs.execute_runs", ignore_result=True)
def execute_runs(self: Task, run_ids: list[int], handbacks: int = 0, sent_at: str | None = None) -> dict[int, str]:
    """A batch of due runs, as the scanner published them (runs to one target host).
    While this worker cannot reach the store, handed back at once (runs.storegate).
    `sent_at`: when the scanner published it (ISO 8601, the store's clock); a message
    handed back, or from before it was sent, has none."""
    ids = [int(i) for i in run_ids]
    sent = _sent_at(sent_at)
    queue = (self.request.delivery_info or {}).get("routing_key")  # back where it came from
    if storegate.is_closed():
        handed = storegate.hand_back(ids, handbacks=handbacks, queue=queue, why="this worker cannot reach the store")
        return dict.fromkeys(ids, "handed_back" if handed else "not_claimed")

    def store_trouble() -> None:
        storegate.hand_back(ids, handbacks=handbacks, queue=queue, why="the store's own trouble")

    def hand_off(work: Callable[[], None]) -> bool:
        # The rest of a batch that must wait for its due times, on a waiter thread
        # (runs.waiters), with the same hand-back on the store's trouble as here.
        def guarded() -> None:
            try:
                work()
            except (OperationalError, InterfaceError):
                store_trouble()
                raise

        return waiters.hand_off(guarded)

    try:
        return run_execute_many(run_ids=ids, worker=_worker(self), sent_at=sent,
                                hand_off=None if self.request.is_eager else hand_off,
                                detach=_detached(self))
    except (OperationalError, InterfaceError):
        store_trouble()
        raise


def _threaded(task: Task) -> bool:
    """A worker on PostgreSQL (not an eager call, nor the embedded SQLite file's one
    writer) may hand work to threads of its process."""
    return not task.request.is_eager and connection.vendor == "postgresql"


def _detached(task: Task) -> bool:
    """With SCHEDULER_WORKER_DETACH, a worker on PostgreSQL hands a batch's calls still in
    flight after a moment to its process's writer and goes back for its next message
    (runs.flights); otherwise the child writes each outcome as its call ends, to the last."""
    return bool(getattr(settings, "SCHEDULER_WORKER_DETACH", False)) and _threaded(task)


def _sent_at(value: str | None) -> datetime | None:
    # Hostile until read: a message anyone could have put on the queue. Not a time: none.
    if not isinstance(value, str):
        return None
    try:
        found = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return found if found.tzinfo is not None else None


@shared_task(bind=True, name="runs.execute_run", ignore_result=True)
def execute_run(self: Task, run_id: int) -> str:
    """One run: messages published before batches existed still run."""
    return run_execute_many(run_ids=[int(run_id)], worker=_worker(self), detach=_detached(self))[int(run_id)]


def _close_own_connection() -> None:
    connections["default"].close()  # the notices thread that ends: its connection with it


# Each worker process sends notices from one thread of its own, never from the child
# that takes run messages: a webhook that hangs holds that thread, not another
# service's runs. One at a time: a send already going on makes the next publish a no-op
# (the scanner publishes again within seconds while notices are due).
_notice_sender = _PerProcess(lambda: CallPool(1, idle_seconds=60.0, name="notices", at_end=_close_own_connection))


@shared_task(bind=True, name="runs.send_notices", ignore_result=True)
def send_notices(self: Task) -> int:
    """Notices that are due (runs.notices): the scanner holding partition 0 publishes this.
    A worker on PostgreSQL hands the sending to its notices thread and returns at once;
    an eager call, or the embedded SQLite file's, sends here. Returns the jobs told here."""
    from runs.notices import notices_send

    if not _threaded(self):
        return len(notices_send().sent)
    if _notice_sender.get().offer(_send_notices_on_thread) is None:
        logger.debug("notices: a send is already going on in this worker process")
    return 0


def _send_notices_on_thread() -> None:
    from runs.notices import notices_send

    close_old_connections()
    try:
        notices_send()
    except Exception:  # noqa: BLE001 - the rows stay pending: the next send tries again
        logger.exception("sending notices failed; they stay pending")
    finally:
        close_old_connections()


@shared_task(name="runs.keep_run_partitions", ignore_result=True)
def keep_run_partitions() -> dict[str, int]:
    """The history's upkeep (runs.retention.keep): the scanner holding partition 0
    publishes this every runs.retention.every() seconds."""
    from runs.retention import keep

    kept = keep()
    return {"made": len(kept.made), "missing": len(kept.missing), "pruned_runs": kept.pruned_runs}
