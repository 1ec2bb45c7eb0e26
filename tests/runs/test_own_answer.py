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
from django.utils import timezone

from jobs.models import Job
from runs import services
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


def quick_host(target: LoopbackTarget, service: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """One call made for real names the host as the worker keys its pace
    (runs.services._recent_ms); then its pace is set to quick, as a stream of loopback
    answers makes it (a loaded test box may make one first answer slow)."""
    warm = queued_now(service.user, "warm", target.url("/warm"))
    assert run_execute_many(run_ids=[warm.pk], worker="w") == {warm.pk: "succeeded"}
    [host] = [h for h in services._recent_ms if h.endswith(f":{target.port}")]
    monkeypatch.setitem(services._recent_ms, host, 1.0)


def one_wave(runs: list[Run]) -> list[Run]:
    """The runs due at one instant: one wave of the batch (runs due within 10 ms of
    each other are claimed and called together)."""
    Run.objects.filter(pk__in=[r.pk for r in runs]).update(due_at=timezone.now())
    return runs


def test_calls_to_a_quick_host_are_made_one_after_another_on_one_connection(
    service: Any, target: LoopbackTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick_host(target, service, monkeypatch)
    runs = one_wave([queued_now(service.user, f"quick-{i}", target.url("/fast")) for i in range(6)])
    assert run_execute_many(run_ids=[r.pk for r in runs], worker="w") == {r.pk: "succeeded" for r in runs}
    calls = target.calls("/fast")
    assert len(calls) == 6
    assert len({c.client_port for c in calls}) == 1, calls  # side by side, they would take several


def test_a_slow_call_among_calls_in_turn_lets_the_ones_after_it_go_side_by_side(
    service: Any, target: LoopbackTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch looks at its calls in turn every IN_TURN_WAIT: when none has ended,
    the ones not made yet go side by side, and land while the slow one is in flight."""
    quick_host(target, service, monkeypatch)
    before = [queued_now(service.user, f"before-{i}", target.url("/fast")) for i in range(2)]
    slow = queued_now(service.user, "slow", target.url("/slow"))
    after = [queued_now(service.user, f"after-{i}", target.url("/fast")) for i in range(3)]

    thread, out = in_a_batch(one_wave(before + [slow] + after))
    try:
        for run in before + after:
            assert wait_for_status(run, {S.SUCCEEDED}, SLOW / 2).status == S.SUCCEEDED, run
        assert Run.objects.get(pk=slow.pk).status == S.RUNNING
        [slow_call] = target.calls("/slow")
        later = [c for c in target.calls("/fast") if c.at > slow_call.at]
        assert later, "no call was in turn after the slow one"
        assert all(c.at - slow_call.at < SLOW / 2 for c in later), (slow_call, later)
    finally:
        thread.join(SLOW + 20)
    assert not thread.is_alive()
    assert out == {r.pk: "succeeded" for r in before + [slow] + after}
