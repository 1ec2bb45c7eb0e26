"""A message that must wait for its due times waits on a waiter thread (runs.waiters),
so the worker process that took it is free for its next message; a message already
due, or one that finds every waiter busy, is worked where it was taken, as before.

Real PostgreSQL, a real loopback target and real threads, each waiter with its own
database connection; the process-level proof (one worker child, two messages) is in
tests/integration/test_lookahead.py.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import override_settings

from runs import waiters
from runs.models import Run
from runs.services import run_execute_many
from tests.runs.test_lookahead import job_for, queued_ahead, target, types  # noqa: F401 (target is a fixture)
from tests.target import LoopbackTarget

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status


@pytest.fixture(autouse=True)
def _waiters_drained() -> Iterator[None]:
    yield
    assert waiters.drain(timeout=10), "a batch was left on a waiter thread"
    waiters.close_connections()  # before the test database is flushed or dropped


def settled(run: Run, timeout: float = 10) -> Run:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run.refresh_from_db()
        if run.status not in (S.QUEUED, S.RUNNING):
            return run
        time.sleep(0.05)
    raise AssertionError(f"run {run.pk} still {run.status} after {timeout} s")


@override_settings(SCHEDULER_WORKER_WAITERS=2)
def test_a_message_not_yet_due_is_handed_to_a_waiter_and_called_at_its_due_time(
        service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), 0.4)

    assert run_execute_many(run_ids=[run.pk], worker="w1", hand_off=waiters.hand_off) == {run.pk: "waiting"}
    # Returned before the due time: nothing of the run has moved yet.
    run.refresh_from_db()
    assert run.status == S.QUEUED and run.fence == 0 and target.calls() == []
    assert waiters.held() == 1

    run = settled(run)
    [call] = target.calls("/hook")
    assert run.status == S.SUCCEEDED and (run.fence, run.attempt) == (1, 1)
    assert run.due_at <= run.started_at and run.due_at.timestamp() <= call.at  # never before its due time
    assert types(run) == ["scheduled", "claimed", "target_answered", "succeeded"]


@override_settings(SCHEDULER_WORKER_WAITERS=2)
def test_a_message_already_due_is_worked_where_it_was_taken(service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), -0.5)
    offered: list[object] = []

    def hand_off(work: Any) -> bool:
        offered.append(work)
        return waiters.hand_off(work)

    assert run_execute_many(run_ids=[run.pk], worker="w1", hand_off=hand_off) == {run.pk: "succeeded"}
    assert offered == [] and waiters.held() == 0 and len(target.calls("/hook")) == 1


@override_settings(SCHEDULER_WORKER_WAITERS=1)
def test_with_every_waiter_busy_the_taker_waits_itself(service: Any, target: LoopbackTarget) -> None:
    later = queued_ahead(job_for(service, target, "/later"), 1.0)
    sooner = queued_ahead(job_for(service, target, "/sooner"), 0.3)

    assert run_execute_many(run_ids=[later.pk], worker="w1", hand_off=waiters.hand_off) == {later.pk: "waiting"}
    # The one waiter holds `later`: `sooner` is waited for and called here.
    assert run_execute_many(run_ids=[sooner.pk], worker="w1", hand_off=waiters.hand_off) == {sooner.pk: "succeeded"}
    [call] = target.calls("/sooner")
    assert sooner.due_at.timestamp() <= call.at and target.calls("/later") == []

    assert settled(later).status == S.SUCCEEDED and len(target.calls("/later")) == 1


@override_settings(SCHEDULER_WORKER_WAITERS=0)
def test_with_no_waiters_every_message_is_worked_where_it_was_taken(service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), 0.3)
    assert run_execute_many(run_ids=[run.pk], worker="w1", hand_off=waiters.hand_off) == {run.pk: "succeeded"}
    assert waiters.held() == 0


@override_settings(SCHEDULER_WORKER_WAITERS=2)
def test_drain_lets_the_batches_on_waiters_finish(service: Any, target: LoopbackTarget) -> None:
    runs = [queued_ahead(job_for(service, target, f"/r{i}"), 0.3 + 0.2 * i) for i in range(2)]
    for run in runs:
        assert run_execute_many(run_ids=[run.pk], worker="w1", hand_off=waiters.hand_off) == {run.pk: "waiting"}
    assert waiters.held() == 2

    assert waiters.drain(timeout=10)  # what a worker child does as it stops (scheduler_project/celery.py)

    assert waiters.held() == 0
    for i, run in enumerate(runs):
        run.refresh_from_db()  # no polling: drain returned once both were written
        assert run.status == S.SUCCEEDED and len(target.calls(f"/r{i}")) == 1


@override_settings(SCHEDULER_WORKER_WAITERS=1)
def test_drain_gives_up_at_its_timeout(service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), 1.0)
    assert run_execute_many(run_ids=[run.pk], worker="w1", hand_off=waiters.hand_off) == {run.pk: "waiting"}
    assert not waiters.drain(timeout=0.1)
    assert waiters.held() == 1  # still waiting: the fixture's drain lets it finish
