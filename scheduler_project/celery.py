"""The Celery app: `celery -A scheduler_project worker`."""
from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")

# Before the pool forks: the store gate's flag is memory the children share (runs.storegate).
import runs.storegate  # noqa: E402,F401

app = Celery("scheduler_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["runs"])


# A worker child keeps its database connection from task to task (settings:
# CELERY_DB_REUSE_MAX), under Django's rule, as a request would: too old
# (CONN_MAX_AGE) or broken by an error, it is closed, and the next use connects again
# (CONN_HEALTH_CHECKS: one that broke while idle, a database restart, is found before
# the task's first statement, not by it).
from celery.signals import task_postrun, task_prerun  # noqa: E402


@task_prerun.connect
@task_postrun.connect
def _database_connections_by_djangos_rule(task: object = None, **_: object) -> None:
    # Not for a task run eagerly, in its caller's process and transaction (the fix-up
    # leaves those alone too).
    if getattr(getattr(task, "request", None), "is_eager", False):
        return
    from django.db import close_old_connections

    close_old_connections()


# Each worker writes its own heartbeat row (runs.workers): the system page lists workers
# from those rows, never from a broadcast that a hung worker could leave unanswered.
from celery.signals import worker_ready, worker_shutdown  # noqa: E402


@worker_ready.connect
def _start_heartbeat(sender: object = None, **_: object) -> None:
    from runs import workers

    # The sender is the worker's consumer: the store gate stops and resumes its run queue.
    workers.start(getattr(sender, "hostname", None) or "worker", consumer=sender)


@worker_shutdown.connect
def _stop_heartbeat(sender: object = None, **_: object) -> None:
    from runs import workers

    workers.stop(getattr(sender, "hostname", None) or "worker")


# A worker child that stops by its own choice (a warm shutdown, max tasks per child)
# lets the batches on its waiter threads finish first (runs.waiters): each waits at
# most its longest wait for its due times, then claims, calls and writes.
from celery.signals import worker_process_shutdown  # noqa: E402


@worker_process_shutdown.connect
def _let_waiters_finish(**_: object) -> None:
    from runs import waiters
    from runs.services import longest_wait, process_flights

    if waiters.drain(timeout=longest_wait() + 60):
        waiters.close_connections()
    # Then the calls still in flight land (runs.flights): each within its own timeout.
    process_flights().drain(timeout=60)


# A worker child is one interpreter running many threads: waiter threads that must
# claim and call at a due time, call threads, and batches writing their outcomes
# (tens of milliseconds of Python each). Two interpreter settings decide how long a
# thread that is due waits behind the others (docs/performance.md, "Settings that
# tune throughput"):
# - CPython hands the GIL to a waiting thread only every switch interval (5 ms by
#   default), and a wave waits for it at each of its steps (the bulkhead, the claim,
#   the call): SCHEDULER_WORKER_SWITCH_INTERVAL.
# - A full collection of the cyclic garbage collector stops every thread while it
#   walks every object tracked: 14 to 100 ms in a child that has loaded Django and
#   Celery. What the child has loaded by now lives as long as it does: frozen, it is
#   left out of every collection (gc.freeze), and copy-on-write pages stay shared.
from celery.signals import worker_process_init  # noqa: E402


@worker_process_init.connect
def _tune_interpreter(**_: object) -> None:
    import gc
    import sys

    from django.conf import settings

    if settings.SCHEDULER_WORKER_SWITCH_INTERVAL > 0:
        sys.setswitchinterval(settings.SCHEDULER_WORKER_SWITCH_INTERVAL)
    gc.freeze()
