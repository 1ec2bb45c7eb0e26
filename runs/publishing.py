"""Celery task targets: a task job's run publishes its task to the tasks broker.

After the fenced claim (runs.services), a run whose job names a `task` is not an
HTTP call: it is one Celery message, in Celery's own protocol 2, published with a
dedicated producer app on `SCHEDULER_TASK_BROKER_URL`, so the target team's
ordinary Celery worker runs it. The message headers carry what a URL target gets
as HTTP headers (runs.delivery.run_identity: the same values, worked out in one
place): `idempotency_key`, `fence_token`, `run_id`, `attempt`, `scheduled_for`.
Celery puts a message's custom headers on the task's request, so a bound task
reads them as `self.request.idempotency_key` (or `self.request.get("fence_token")`).

The run succeeds when the broker has accepted the message: on AMQP a publisher
confirm (`confirm_publish`), on Redis the push returned. A broker error or a
timeout is a failed call, retried under the job's retry policy like a refused
connection. The publish is bounded by the job's `timeout` (the connection's
connect and socket timeouts, and the confirm wait). Each publish is a task id of
its own (a new uuid: Celery expects one per message); the idempotency key is the
run's, the same on every attempt.

A task's name is checked against its owner's grants at call time too (grants may
be revoked after the job was made): a run whose task is no longer granted ends
dead with the reason, and nothing is published.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from celery import Celery
from django.conf import settings
from kombu.utils.url import maybe_sanitize_url

from jobs import selectors
from jobs.models import Job
from jobs.validators import DEFAULT_QUEUE, stored_queue_refusal
from runs.claims import Claim
from runs.delivery import CallResult, PreparationError, run_identity
from runs.models import Run

logger = logging.getLogger("scheduler.publishing")
PRODUCER_NAME = "scheduler-task-producer"


@dataclass(frozen=True)
class TaskMessage:
    """One task publish, made after the claim (prepare) and sent by publish()."""

    name: str
    args: list[Any] = field(repr=False)
    kwargs: dict[str, Any] = field(repr=False)
    queue: str
    task_id: str
    headers: dict[str, Any]


def broker_shown() -> str:
    """The tasks broker's URL without its password, for the timeline and the logs."""
    return maybe_sanitize_url(settings.SCHEDULER_TASK_BROKER_URL)


def prepare(*, run: Run, job: Job, claim: Claim, grants: dict[tuple[int, str], str | None]) -> TaskMessage:
    """The message a task job's run publishes, or a PreparationError (the run ends
    dead with its reason) when the job's owner may no longer name its task.
    `grants` keeps each (owner, task)'s answer for one batch."""
    key = (job.owner_id, job.task)
    if key not in grants:
        grants[key] = selectors.task_refusal(job.owner, job.task)
    refusal = grants[key]
    if refusal is not None:
        raise PreparationError(f"task refused: {refusal}")
    queue = job.queue or DEFAULT_QUEUE
    refusal = stored_queue_refusal(queue)
    if refusal is not None:
        raise PreparationError(f"queue refused: {refusal}")
    return TaskMessage(
        name=job.task,
        args=list(job.args or []),
        kwargs=dict(job.kwargs or {}),
        queue=queue,
        task_id=str(uuid.uuid4()),
        headers=run_identity(run, claim).message_headers(),
    )


# --------------------------------------------------------------------------- the producer

_apps: dict[tuple[int, str], Celery] = {}
_apps_lock = threading.Lock()


def producer_app() -> Celery:
    """This process's producer for SCHEDULER_TASK_BROKER_URL: a Celery app of its own
    (not the scheduler's, whose routes and queues are for runs), made once per
    process and broker URL (a forked worker child makes its own)."""
    url = settings.SCHEDULER_TASK_BROKER_URL
    key = (os.getpid(), url)
    with _apps_lock:
        app = _apps.get(key)
        if app is None:
            app = Celery(PRODUCER_NAME, set_as_current=False)
            app.conf.update(
                broker_url=url,
                broker_write_url=url,  # else Celery prefers the environment's CELERY_BROKER_URL
                broker_transport_options=dict(settings.SCHEDULER_TASK_BROKER_TRANSPORT_OPTIONS),
                broker_connection_retry=False,
                task_serializer="json",
                accept_content=["json"],
                task_create_missing_queues=True,
                task_default_queue=DEFAULT_QUEUE,
                enable_utc=True,
            )
            app.amqp  # noqa: B018 - made here, under the lock, not by two call threads at once
            _apps[key] = app
    return app


def _transport_options(url: str, timeout: float) -> dict[str, Any]:
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("amqp", "pyamqp", "amqps"):
        # The broker's publisher confirm is what "accepted" means on AMQP.
        return {"confirm_publish": True, "connect_timeout": timeout, "read_timeout": timeout,
                "write_timeout": timeout}
    if scheme in ("redis", "rediss"):
        return {"socket_connect_timeout": timeout, "socket_timeout": timeout, "max_retries": 0}
    return {}


def publish(message: TaskMessage, *, timeout_seconds: float) -> CallResult:
    """Publish one task message; never raises. Accepted: a CallResult whose
    `published` is the `published` event's detail (broker, queue, task_id). Refused,
    failed or timed out: a failed call (retried under the job's policy)."""
    started = time.monotonic()
    broker = broker_shown()
    try:
        app = producer_app()
        url = settings.SCHEDULER_TASK_BROKER_URL
        options = _transport_options(url, timeout_seconds)
        with _broker_connection(app, url, timeout_seconds, options) as conn:
            left = max(0.1, timeout_seconds - (time.monotonic() - started))
            with app.amqp.Producer(conn) as producer:
                app.send_task(
                    message.name,
                    args=message.args,
                    kwargs=message.kwargs,
                    queue=message.queue,
                    task_id=message.task_id,
                    headers=message.headers,
                    producer=producer,
                    retry=False,
                    timeout=left,
                    confirm_timeout=left,
                    add_to_parent=False,
                )
    except Exception as exc:  # a broker error of any kind: fixed words (no library text, no password)
        took = _ms(started)
        words = _failure_words(exc, took >= timeout_seconds * 1000)
        logger.warning("publishing %s to %s: %s", message.name, broker, words)
        return CallResult(error=f"publish to {broker} {words}", duration_ms=took)
    _after_publish_seam()
    return CallResult(
        duration_ms=_ms(started),
        published={"broker": broker, "queue": message.queue, "task_id": message.task_id, "task": message.name},
    )


# Connections to the tasks broker, kept per process, broker URL and timeout (the
# timeout is the connection's: connect, socket and confirm): a new connection per
# publish costs about ten times the publish itself (4 ms against 0.4 ms on Redis,
# docs/performance.md, "Against celery beat"). A connection that failed is closed and
# replaced, never handed out again; the worker's call threads each take their own from
# the pool.
_pools: dict[tuple[int, str, float], Any] = {}
POOL_LIMIT = 64


@contextmanager
def _broker_connection(app: Celery, url: str, timeout: float, options: dict[str, Any]) -> Iterator[Any]:
    key = (os.getpid(), url, float(timeout))
    with _apps_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = app.connection_for_write(url, connect_timeout=timeout, transport_options=options).Pool(POOL_LIMIT)
            _pools[key] = pool
    conn = pool.acquire(block=True, timeout=timeout)
    try:
        conn.ensure_connection(max_retries=0, timeout=timeout)  # one try: retries are rows
        yield conn
    except BaseException:
        conn.collect()  # drop its sockets: the next user of this slot connects afresh
        pool.replace(conn)
        raise
    else:
        conn.release()


def _failure_words(exc: BaseException, out_of_time: bool) -> str:
    """What a failed publish is reported as: the cause's kind, never its text."""
    seen: BaseException | None = exc
    for _ in range(10):  # kombu and redis-py wrap the socket's error
        if seen is None:
            break
        if isinstance(seen, ConnectionRefusedError):
            return "failed: connection refused"
        if isinstance(seen, (TimeoutError, socket.timeout)) or "timeout" in type(seen).__name__.lower():
            return "timed out"
        seen = seen.__cause__ or seen.__context__
    return "timed out" if out_of_time else f"failed ({type(exc).__name__})"


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _after_publish_seam() -> None:
    """A test-only pause between the broker's acceptance and the outcome's write, so a
    test can kill -9 the worker there (tests/integration/test_task_targets.py). Like
    runs.claims' deliberate bug, both variables must be set, and only the tests set
    SCHEDULER_TESTING; a deployment's settings have no say in it."""
    if os.environ.get("SCHEDULER_TESTING") != "1":
        return
    raw = os.environ.get("SCHEDULER_TEST_HANG_AFTER_PUBLISH", "")
    if raw:
        logger.warning("test seam: published; hanging %ss before recording the outcome", raw)
        time.sleep(float(raw))
