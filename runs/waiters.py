"""A run message that must wait for its due times waits on a thread, not in a worker child.

The scanner publishes runs up to SCHEDULER_LOOKAHEAD ahead of their due time, and
the batch waits for each (runs.services._Batch.run). Held in a prefork child, that
wait occupied the child: at a steady rate each message held one for the look-ahead
plus the span of its due times, so two children fell behind a stream they had the
CPU for (docs/performance.md, "What a run does"). Now the
child reads the message's runs, and when the first is not due yet it gives the rest
of the batch (the waits, the claims, the calls, the outcomes) to one of this
process's waiter threads and takes its next message. A message already due (a
backlog) is worked in the child as before, and so is one that finds every waiter
busy: the children's prefetch stays the back-pressure. That is also what spreads
the work over a worker's children: Celery's prefork parent gives each message to
the first child that is not busy, and a child that handed its message off is not,
so with several waiters a process one child took nearly every message and ran most
batches under its one GIL. With one (the default on PostgreSQL), a child whose
waiter is busy works its next message itself, and the parent gives the one after
to another child (tests/integration/test_lookahead.py).

Nothing about a run changes hands: the claim, its fence and its lease are the same
statements from whichever thread makes them. A child that dies loses what its
waiters hold as it loses what it holds itself (messages are acknowledged when the
child takes them, settings.CELERY_TASK_ACKS_LATE): the runs stay `queued` and are
published again (claims.touch_unclaimed), or their leases run out. A child that
stops by its own choice (a warm shutdown, max tasks per child) first lets its
waiters finish (`drain`, from Celery's worker_process_shutdown signal).

Each waiter thread has its own database connection (Django's are per thread),
kept by CONN_MAX_AGE as the child's is. SCHEDULER_WORKER_WAITERS threads at most a
process, made as messages need them and ended after a minute idle; 0 turns this
off (the default on SQLite, whose one writer gains nothing from more threads).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

from django.conf import settings
from django.db import close_old_connections, connections
from django.db.backends.base.base import BaseDatabaseWrapper

from runs.delivery import CallPool, _PerProcess

logger = logging.getLogger("scheduler.runs")

IDLE_WAITER_SECONDS = 60.0


def _close_own_connection() -> None:
    connections["default"].close()  # a waiter thread that ends: its connection with it


_pool = _PerProcess(lambda: CallPool(settings.SCHEDULER_WORKER_WAITERS, idle_seconds=IDLE_WAITER_SECONDS,
                                     name="waiter", at_end=_close_own_connection))
_held: set[Future[None]] = set()  # batches on waiter threads, for drain
_held_lock = threading.Lock()
_connections: weakref.WeakSet[BaseDatabaseWrapper] = weakref.WeakSet()  # the waiters' own, for close_connections


def enabled() -> bool:
    return settings.SCHEDULER_WORKER_WAITERS > 0


def hand_off(work: Callable[[], None]) -> bool:
    """Give `work` (the rest of a batch) to a free waiter thread: False when none is
    free and none may be made (the caller does it itself)."""
    if not enabled():
        return False
    pool = _pool.get()
    pool.limit = settings.SCHEDULER_WORKER_WAITERS  # the setting as it is now (tests override it)
    future = pool.offer(_on_waiter, work)
    if future is None:
        return False
    with _held_lock:
        _held.add(future)
    future.add_done_callback(_done)
    return True


def _on_waiter(work: Callable[[], None]) -> None:
    # Django's rule for a connection kept between units of work, as the child applies
    # it at each task's start and end (scheduler_project/celery.py).
    close_old_connections()
    _connections.add(connections["default"])
    try:
        work()
    except Exception:
        logger.exception("a batch on a waiter thread failed; its runs are recovered from the store")
    finally:
        close_old_connections()


def _done(future: Future[None]) -> None:
    with _held_lock:
        _held.discard(future)


def held() -> int:
    """Batches on this process's waiter threads now (tests, drain)."""
    with _held_lock:
        return len(_held)


def drain(timeout: float) -> bool:
    """Wait, up to `timeout` seconds, for this process's waiters to finish what they
    hold. True when they did."""
    deadline = time.monotonic() + timeout
    while held():
        if time.monotonic() >= deadline:
            logger.warning("stopping with %d batches still on waiter threads; their runs are recovered "
                           "from the store", held())
            return False
        time.sleep(0.05)
    return True


def close_connections() -> None:
    """Close the waiter threads' database connections, from any thread, once they hold
    nothing (after `drain`): a worker child about to exit, a test about to drop its
    database. A waiter that works again connects again."""
    if held():
        return
    for found in list(_connections):
        found.inc_thread_sharing()
        try:
            found.close()
        finally:
            found.dec_thread_sharing()
