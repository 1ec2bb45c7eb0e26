"""The look-ahead with real processes: a scanner queues a run ahead of its due time,
a Celery worker waits for it and calls it then, not before; a worker killed while
waiting loses nothing (the run stays queued and the scanner publishes it again).

Both processes run on this machine, so the target's arrival times and the store's
due times are read on one clock."""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any

import pytest

from jobs.services import job_create, service_account_ensure
from runs.models import Run
from tests.integration.conftest import PrivateRedis, Stack, wait_for
from tests.target import LoopbackTarget
from tests.factories import timeline_of

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status
LOOKAHEAD = "2"
# How late the call may reach the target after its due time: a busy two-core box
# (the bench measures the real figure: docs/performance.md).
LATE_BOUND = 1.0


def one_off(target: LoopbackTarget, path: str, in_seconds: int) -> Run:
    owner, _ = service_account_ensure(name="lookahead")
    at = (datetime.now(dt_timezone.utc) + timedelta(seconds=in_seconds)).replace(microsecond=0)
    job = job_create(owner=owner, fields={"name": "ahead", "run_at": at, "target": target.url(path)})
    return Run.objects.get(job=job)


def events_of(run: Run) -> dict[str, Any]:
    return {e.type: e for e in timeline_of(run)}


def scanning(proc: Any) -> bool:
    return "partitions [" in proc.output()


def test_a_run_queued_ahead_is_called_at_its_due_time_by_a_worker_process(
    stack: Stack, target: LoopbackTarget
) -> None:
    scanner = stack.scanner("scanner-a", SCHEDULER_LOOKAHEAD=LOOKAHEAD)
    stack.worker("worker-a", SCHEDULER_LOOKAHEAD=LOOKAHEAD)
    wait_for(lambda: scanning(scanner), 30, what="the scanner to own its partitions")
    run = one_off(target, "/at", 6)

    [call] = wait_for(lambda: target.calls("/at"), 30, what="the call")
    wait_for(lambda: Run.objects.get(pk=run.pk).status == S.SUCCEEDED, 30, what="the run to succeed")

    run.refresh_from_db()
    found = events_of(run)
    assert found["queued"].at <= run.due_at - timedelta(seconds=1)  # queued well ahead (scans every 0.5 s)
    assert run.due_at <= run.started_at  # claimed at its due time by the store's clock
    assert run.due_at.timestamp() <= call.at <= run.due_at.timestamp() + LATE_BOUND


def test_a_worker_killed_while_waiting_loses_nothing(
    stack: Stack, target: LoopbackTarget, private_redis: PrivateRedis
) -> None:
    stack.env["CELERY_BROKER_URL"] = private_redis.url
    stack.env["SCHEDULER_REQUEUE_AFTER"] = "2"
    scanner = stack.scanner("scanner-a", SCHEDULER_LOOKAHEAD="4")
    # Its longest wait is 8 s (twice the look-ahead): it holds the message until the kill.
    doomed = stack.worker("doomed", SCHEDULER_LOOKAHEAD="4")
    wait_for(lambda: scanning(scanner), 30, what="the scanner to own its partitions")
    wait_for(lambda: "ready" in doomed.output(), 30, what="the worker to be ready")
    run = one_off(target, "/waited", 7)
    queue = stack.env["SCHEDULER_RUN_QUEUE"]

    wait_for(lambda: Run.objects.get(pk=run.pk).status == S.QUEUED, 30, what="the run to be queued ahead")
    # Published (after the scan's commit) and taken: the worker logs it at INFO.
    wait_for(lambda: "runs.execute_runs" in doomed.output() and "received" in doomed.output(), 10,
             what="the worker to receive the message")
    assert private_redis.llen(queue) == 0
    assert datetime.now(dt_timezone.utc) < run.due_at - timedelta(seconds=1), "the test was too slow to kill in time"
    doomed.kill()  # kill -9 while it waits for the due time

    run.refresh_from_db()
    assert run.status == S.QUEUED and run.fence == 0 and "claimed" not in events_of(run)
    stack.worker("rescuer", SCHEDULER_LOOKAHEAD="4")
    [call] = wait_for(lambda: target.calls("/waited"), 30, what="the run to be called after the kill")
    wait_for(lambda: Run.objects.get(pk=run.pk).status == S.SUCCEEDED, 30, what="the run to succeed")

    run.refresh_from_db()
    found = events_of(run)
    # Published again only once SCHEDULER_REQUEUE_AFTER had passed since its due time,
    # not since it was queued (4 s earlier).
    assert found["requeued"].at >= run.due_at + timedelta(seconds=2)
    assert run.fence == 1 and call.headers["X-Fence-Token"] == "1" and len(target.calls()) == 1
    assert call.at >= run.due_at.timestamp()
    time.sleep(0.5)
    assert len(target.calls()) == 1
