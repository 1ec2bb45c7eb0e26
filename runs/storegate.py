"""A worker that cannot reach the store takes no run messages until it can.

Cut off from PostgreSQL but not from the broker, a worker would go on taking run
messages, and each would wait in its claim (until SCHEDULER_DB_TCP_TIMEOUT ends the
statement, then the connect's own timeout, message after message) while its runs
stay `queued`: they come back only through SCHEDULER_REQUEUE_AFTER, and may be
published to the same worker again. So:

- The worker's main process judges the store by its heartbeats (runs.workers: one
  beat every SCHEDULER_WORKER_HEARTBEAT seconds, no statement of its own): a beat
  that fails, or has not come back within `unreachable_after()`, closes the gate;
  the next beat that succeeds opens it. While it is closed the worker stops
  consuming the run queue (Celery's consumer, on its own event loop), so the broker
  hands new messages to the workers that can reach the store.
- The gate is one byte of memory shared with the prefork children (made before they
  fork). A run message that reaches a child while the gate is closed (it had
  been prefetched), or whose work fails on the store's own trouble, is handed back:
  published again at once, for another worker, instead of waiting here.

Nothing is lost either way: a message is acknowledged when a child takes it, and its
runs stay `queued` in the store, the truth, until a claim succeeds; a hand-back that
cannot be published leaves them to the scanner's requeue, as before. A run claimed
before the cut and handed back is refused by the next worker's claim while its lease
lives (runs.claims.may_claim), and recovered when it runs out, as ever.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from collections.abc import Callable

from django.conf import settings

logger = logging.getLogger("scheduler.runs")

# 1: this worker's store link is down (as its main process last found it).
_closed = multiprocessing.RawValue("b", 0)
# A message handed back this many times is left to the scanner's requeue: every
# worker may be cut off (the store itself is down), and bouncing gains nothing then.
MAX_HANDBACKS = 3


def disabled() -> bool:
    """The gate turned off, for the partition test's "before" figure only: both
    variables must be set, and only the tests set SCHEDULER_TESTING."""
    return os.environ.get("SCHEDULER_TESTING") == "1" and os.environ.get("SCHEDULER_TEST_NO_STORE_GATE") == "1"


def is_closed() -> bool:
    return bool(_closed.value) and not disabled()


def unreachable_after() -> float:
    """A heartbeat (two short statements) that takes longer than this means the store
    is out of reach: the worker's heartbeat interval, at least 2 s."""
    return max(2.0, float(getattr(settings, "SCHEDULER_WORKER_HEARTBEAT", 5)))


class Gate:
    """The main process's side: told each beat's start and end by runs.workers, it
    closes and opens the run queue's consumption (`stop`, `resume`: the consumer's)."""

    def __init__(self, stop: Callable[[], None], resume: Callable[[], None]) -> None:
        self._stop, self._resume = stop, resume
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def beat_started(self) -> None:
        timer = threading.Timer(unreachable_after(), self.close, kwargs={"why": "a heartbeat did not come back"})
        timer.daemon = True
        with self._lock:
            self._timer = timer
        timer.start()

    def beat_ended(self, ok: bool) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if ok:
            self.open()
        else:
            self.close(why="a heartbeat failed")

    def close(self, why: str) -> None:
        if disabled() or _closed.value:
            return
        _closed.value = 1
        logger.warning("store out of reach (%s): taking no run messages until it is back", why)
        self._stop()

    def open(self) -> None:
        if not _closed.value:
            return
        _closed.value = 0
        logger.warning("store reached again: taking run messages")
        self._resume()


def consumer_switches(consumer: object) -> tuple[Callable[[], None], Callable[[], None]]:
    """Stop and resume consuming every queue this worker consumes (the run queue, and
    any other it was started with: every task of ours needs the store), on the
    consumer's own event loop (kombu is not thread-safe; hub.call_soon is). Without
    an event loop (the threads and solo pools) nothing is switched: the children's
    hand-back alone keeps the runs moving."""
    hub = getattr(consumer, "hub", None)
    if consumer is None or hub is None or not hasattr(consumer, "cancel_task_queue"):
        return (lambda: None), (lambda: None)
    stopped: list[str] = []

    def stop_now() -> None:
        tasks = getattr(consumer, "task_consumer", None)
        for queue in [q.name for q in getattr(tasks, "queues", [])]:
            consumer.cancel_task_queue(queue)  # type: ignore[attr-defined]
            stopped.append(queue)

    def resume_now() -> None:
        while stopped:
            consumer.add_task_queue(stopped.pop())  # type: ignore[attr-defined]

    return (lambda: hub.call_soon(stop_now)), (lambda: hub.call_soon(resume_now))


def hand_back(run_ids: list[int], *, handbacks: int, queue: str | None, why: str) -> bool:
    """Publish the message's runs again at once, to the queue it came from, for another
    worker. False when it was not (handed back too often, or the broker refused): the
    scanner's requeue then."""
    if handbacks >= MAX_HANDBACKS:
        return False
    from runs.tasks import execute_runs

    try:
        execute_runs.apply_async((run_ids,), kwargs={"handbacks": handbacks + 1}, queue=queue)
    except Exception:  # noqa: BLE001 - the runs stay queued in the store: the requeue brings them
        logger.warning("could not hand back %d runs (%s)", len(run_ids), why, exc_info=True)
        return False
    logger.info("handed back %d runs (%s)", len(run_ids), why)
    return True
