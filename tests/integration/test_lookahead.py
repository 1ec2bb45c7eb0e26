"""The look-ahead with real processes: a scanner queues a run ahead of its due time,
a Celery worker waits for it and calls it then, not before; a worker killed while
waiting loses nothing (the run stays queued and the scanner publishes it again).

Both processes run on this machine, so the target's arrival times and the store's
due times are read on one clock."""
from __future__ import annotations

import os
import signal
import time
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any

import pytest

from jobs.services import job_create, service_account_ensure
from runs import claims
from runs.models import Run
from runs.tasks import execute_runs
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


def queued_ahead(target: LoopbackTarget, path: str, in_seconds: float) -> Run:
    """A run queued to be due `in_seconds` from now by the store's clock, as a scan
    with the look-ahead leaves it (its message is the test's to publish)."""
    owner, _ = service_account_ensure(name="lookahead")
    job = job_create(owner=owner, fields={"name": path.strip("/"), "schedule": "0 0 1 1 *",
                                          "target": target.url(path), "retry_max": 0})
    now = claims.store_now()
    Run.objects.filter(job=job).update(status=S.QUEUED, queued_at=now, due_at=now + timedelta(seconds=in_seconds))
    return Run.objects.get(job=job)


def test_a_worker_child_takes_its_next_message_while_an_earlier_one_waits(
    stack: Stack, target: LoopbackTarget
) -> None:
    # One child, which may wait up to 8 s (twice the look-ahead) for a message's runs.
    worker = stack.worker("one-child", concurrency=1, SCHEDULER_LOOKAHEAD="4")
    wait_for(lambda: " ready." in worker.output(), 30, what="the worker to be ready")
    queue = stack.env["SCHEDULER_RUN_QUEUE"]
    later = queued_ahead(target, "/later", 5)
    sooner = queued_ahead(target, "/sooner", 2)

    execute_runs.apply_async(([later.pk],), queue=queue)
    execute_runs.apply_async(([sooner.pk],), queue=queue)

    [soon_call] = wait_for(lambda: target.calls("/sooner"), 30, what="the sooner run's call")
    [late_call] = wait_for(lambda: target.calls("/later"), 30, what="the later run's call")
    # The child handed the first message's wait to a waiter thread (runs.waiters) and
    # took the second: the sooner run was called before the later one came due.
    assert soon_call.at < later.due_at.timestamp() and soon_call.at < late_call.at
    assert soon_call.at >= sooner.due_at.timestamp() and late_call.at >= later.due_at.timestamp()
    for run in (sooner, later):
        wait_for(lambda r=run: Run.objects.get(pk=r.pk).status == S.SUCCEEDED, 30, what="the run to succeed")
        assert Run.objects.get(pk=run.pk).fence == 1


def test_messages_that_wait_are_spread_over_the_worker_children(stack: Stack, target: LoopbackTarget) -> None:
    # Two children and the default waiters (1 a process). Celery's prefork parent gives
    # each message to the first child that is not busy, and a child that has handed its
    # message to a waiter is not: with 4 waiters a process one child took every message
    # here (and at 900 runs/s ran 77 to 88% of the worker's CPU, docs/performance.md).
    worker = stack.worker("two-children", concurrency=2, SCHEDULER_LOOKAHEAD="4")
    wait_for(lambda: " ready." in worker.output(), 30, what="the worker to be ready")
    queue = stack.env["SCHEDULER_RUN_QUEUE"]
    runs = [queued_ahead(target, f"/spread-{i}", 5) for i in range(4)]
    for run in runs:
        # One at a time, as a steady stream's scans publish them: each child has taken
        # its message (and handed it off, or not) before the next comes.
        execute_runs.apply_async(([run.pk],), queue=queue)
        time.sleep(0.5)

    for run in runs:
        wait_for(lambda r=run: Run.objects.get(pk=r.pk).status == S.SUCCEEDED, 30, what="the run to succeed")
    # The claim's worker is "node/pid/thread": one process holds two messages at most
    # (its waiter's and its own), so four messages sent before any is due take both.
    processes = [events_of(run)["claimed"].detail["worker"].split("/")[1] for run in runs]
    assert len(set(processes)) == 2, processes
    assert sorted(processes.count(p) for p in set(processes)) == [2, 2], processes
    for i, run in enumerate(runs):
        [call] = target.calls(f"/spread-{i}")
        assert call.at >= Run.objects.get(pk=run.pk).due_at.timestamp()


def test_a_worker_stopped_while_a_waiter_holds_a_message_lets_it_finish(
    stack: Stack, target: LoopbackTarget
) -> None:
    worker = stack.worker("stopping", concurrency=1, SCHEDULER_LOOKAHEAD="4")
    wait_for(lambda: " ready." in worker.output(), 30, what="the worker to be ready")
    run = queued_ahead(target, "/held", 3)
    execute_runs.apply_async(([run.pk],), queue=stack.env["SCHEDULER_RUN_QUEUE"])
    wait_for(lambda: "runs.execute_runs" in worker.output() and "succeeded" in worker.output(), 10,
             what="the child to hand the message off and return")
    assert Run.objects.get(pk=run.pk).status == S.QUEUED and target.calls() == []

    # SIGTERM to the worker's main process: Celery's warm shutdown, which ends each
    # child with a sentinel; the child lets its waiters finish as it exits.
    os.kill(worker.pid, signal.SIGTERM)
    worker.popen.wait(timeout=30)

    [call] = target.calls("/held")
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.fence == 1 and call.at >= run.due_at.timestamp()


def stop_as_systemd_does(proc: Any) -> None:
    """Stop a worker the way deploy/systemd/scheduler-worker@.service has systemd stop
    it: KillSignal to the main process alone (KillMode=mixed or process) or to every
    process of the unit (control-group, systemd's default)."""
    from tests.integration.test_deploy_guide import UNITS, parse_unit

    unit = parse_unit(UNITS / "scheduler-worker@.service")
    sig = getattr(signal, unit.get("KillSignal", "SIGTERM"))
    if unit.get("KillMode", "control-group") in ("mixed", "process"):
        os.kill(proc.pid, sig)
    else:
        os.killpg(proc.pid, sig)
    proc.popen.wait(timeout=float(unit.get("TimeoutStopSec", "90")))


def test_a_worker_stopped_as_its_unit_says_finishes_the_call_it_has_in_flight(
    stack: Stack, target: LoopbackTarget
) -> None:
    target.delay("/slow", 2)
    worker = stack.worker("stopping", concurrency=1)
    wait_for(lambda: " ready." in worker.output(), 30, what="the worker to be ready")
    run = queued_ahead(target, "/slow", 0)
    execute_runs.apply_async(([run.pk],), queue=stack.env["SCHEDULER_RUN_QUEUE"])
    wait_for(lambda: Run.objects.get(pk=run.pk).status == S.RUNNING, 10, what="the call to be in flight")

    stop_as_systemd_does(worker)

    # The child kept its call and wrote its outcome: a warm shutdown. (Under systemd's
    # default KillMode the child got SIGTERM too and died mid-call, the run left
    # running until its lease ran out and then called again.)
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.fence == 1 and len(target.calls("/slow")) == 1
    assert "WorkerLostError" not in worker.output()
