"""A run's flight ends at its own answer, not at its batch's slowest call.

Up to a host's bulkhead of runs share one message whatever their endpoints: a fast
job and a slow one on one host are claimed and called together. Each outcome (and
`finished_at`, and the job's next run, and so what overlap, buffer_one and retries
read as "in flight") is written when its own call ends (runs.flights); before, every
outcome of the batch waited for the slowest call.

The worker's path for real: a loopback HTTP target, PostgreSQL (or the embedded
SQLite file), the batch on a thread of its own as a worker child runs it.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from jobs.models import Job
from runs.models import Run
from runs.services import run_execute_many
from tests.runs.calls import queued_now, wait_for_status
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]
S = Run.Status
SLOW = 3.0  # seconds the slow endpoint takes to answer


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    server.delay("/slow", SLOW)
    yield server
    server.stop()


def in_a_batch(runs: list[Run]) -> tuple[threading.Thread, dict[int, str]]:
    out: dict[int, str] = {}

    def worker() -> None:
        try:
            out.update(run_execute_many(run_ids=[r.pk for r in runs], worker="w-batch"))
        finally:
            connection.close()

    thread = threading.Thread(target=worker)
    thread.start()
    return thread, out


def test_a_fast_calls_outcome_lands_while_a_slow_call_of_its_batch_is_still_in_flight(
    service: Any, target: LoopbackTarget
) -> None:
    fast = queued_now(service.user, "fast", target.url("/fast"))
    slow = queued_now(service.user, "slow", target.url("/slow"))

    thread, out = in_a_batch([slow, fast])
    try:
        landed = wait_for_status(fast, {S.SUCCEEDED}, SLOW / 2)
        # The slow call is still in flight, and the fast run has ended, with its next run.
        assert landed.status == S.SUCCEEDED, landed.status
        assert Run.objects.get(pk=slow.pk).status == S.RUNNING
        [answer] = target.calls("/fast")
        assert landed.finished_at.timestamp() - answer.at < 1.0
        assert Run.objects.filter(job_id=fast.job_id, status=S.SCHEDULED).count() == 1
    finally:
        thread.join(SLOW + 20)
    assert not thread.is_alive()
    assert out == {fast.pk: "succeeded", slow.pk: "succeeded"}
    ended = Run.objects.get(pk=slow.pk)
    assert ended.finished_at.timestamp() - target.calls("/slow")[0].at >= SLOW - 0.1


def test_a_fast_calls_retry_is_due_from_its_own_failure_not_from_the_slow_call(
    service: Any, target: LoopbackTarget
) -> None:
    target.script("/flaky", [503, 200])
    flaky = queued_now(service.user, "flaky", target.url("/flaky"), retry_base_seconds=1, retry_backoff="fixed")
    slow = queued_now(service.user, "slow", target.url("/slow"))

    thread, _ = in_a_batch([slow, flaky])
    try:
        retried = wait_for_status(flaky, {S.SCHEDULED}, SLOW / 2)
        assert retried.status == S.SCHEDULED and retried.attempt == 1
        [failed] = target.calls("/flaky")
        # Fixed backoff of 1 s with jitter, counted from its own answer.
        assert retried.due_at.timestamp() - failed.at < 2.0
    finally:
        thread.join(SLOW + 20)
    assert not thread.is_alive()


def test_the_batch_still_waits_for_its_last_outcome_when_called_directly(
    service: Any, target: LoopbackTarget
) -> None:
    """The inline path (a direct call, an eager task) returns only once every outcome
    has landed: callers read outcomes from its answer."""
    runs = [queued_now(service.user, f"j{i}", target.url(f"/p{i}")) for i in range(4)]
    assert run_execute_many(run_ids=[r.pk for r in runs], worker="w") == {r.pk: "succeeded" for r in runs}
    assert set(Run.objects.filter(pk__in=[r.pk for r in runs]).values_list("status", flat=True)) == {S.SUCCEEDED}
    assert Job.objects.filter(pk__in=[r.job_id for r in runs]).count() == 4
