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


# A worker child's calls run on a pool of up to SCHEDULER_WORKER_CALLS threads
# (runs.delivery.call_pool), and glibc gives threads malloc arenas of their own, up to
# eight a core, each keeping what it once held: in the 30-minute soak under load
# (2026-12-02) the children's resident memory rose in steps, 8 to 14% after the first
# five minutes, children of 200 threads at 126 to 131 MiB against 105 MiB for young
# ones. Two arenas, as MALLOC_ARENA_MAX=2 would give (glibc reads that variable
# itself at start, and then this leaves it alone).
M_ARENA_MAX = -8  # glibc's mallopt parameter
MALLOC_ARENAS = 2


def cap_malloc_arenas() -> bool:
    """At most MALLOC_ARENAS glibc malloc arenas in this process, from now on. False
    where that is not glibc's malloc, or MALLOC_ARENA_MAX is set."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator's own way
        return False


from celery.signals import worker_process_init  # noqa: E402


@worker_process_init.connect
def _child_malloc_arenas(**_: object) -> None:
    cap_malloc_arenas()  # before the child makes its call threads


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
