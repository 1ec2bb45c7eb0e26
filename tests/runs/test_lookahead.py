"""The look-ahead (SCHEDULER_LOOKAHEAD): a scan queues and publishes runs a little
ahead of their due time, and the worker waits for it, then claims. The claim refuses
a run not yet due by the store's clock, so nothing starts early whatever a worker's
own clock says; and everything that stops a run before its claim still stops it
while the worker waits.

Real PostgreSQL and a real loopback target; the clock is mocked only where the test
is about the clock (a worker's clock that runs ahead, an estimate of the store's
clock that is wrong).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
import time
from datetime import datetime, timedelta, timezone
from typing import Any
from unittest import mock

import pytest
import time_machine
from django.db import connection, transaction
from django.db.models import Sum
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from jobs.models import Job
from jobs.services import job_create, job_delete, job_pause
from runs import claims, rollups
from runs import services as run_services
from runs.models import Run, RunRollup
from runs.ops import target_pause
from runs.services import run_execute, run_execute_many
from scanners.messages import due_slice, run_messages
from scanners.scan import scan_once
from tests.factories import make_job, make_run, timeline_types, entries, entry
from tests.target import LoopbackTarget

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
ALL = frozenset(range(16))
LEASE = timedelta(seconds=60)
# How late a call may reach the target after its due time, in-process, on a busy
# two-core box (the bench measures the real figure: docs/performance.md).
LATE_BOUND = 0.5


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def job_for(service: Any, target: LoopbackTarget, path: str = "/hook") -> Job:
    return job_create(owner=service.user, fields={"name": "ahead", "schedule": "0 0 1 1 *", "target": target.url(path),
                                                  "retry_max": 0})


def queued_ahead(job: Job, seconds: float, now: datetime | None = None) -> Run:
    """The job's run, due `seconds` from now (or from `now`) by the store's clock,
    queued already, as a scan with the look-ahead leaves it."""
    run = Run.objects.get(job=job, status=S.SCHEDULED)
    now = now or claims.store_now()
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=now, due_at=now + timedelta(seconds=seconds))
    run.refresh_from_db()
    return run


def types(run: Run) -> list[str]:
    return timeline_types(run)


# --------------------------------------------------------------------------- the scan


@pytest.mark.embedded
@override_settings(SCHEDULER_LOOKAHEAD=0.05)
def test_a_run_due_within_the_lookahead_is_queued_ahead_and_one_beyond_it_is_not() -> None:
    job = make_job()
    now = claims.store_now()
    soon = make_run(job, now.replace(microsecond=0) + timedelta(days=1))
    Run.objects.filter(pk=soon.pk).update(due_at=now + timedelta(seconds=0.04))
    later = make_run(job, now.replace(microsecond=0) + timedelta(days=2), is_backfill=True)
    Run.objects.filter(pk=later.pk).update(due_at=now + timedelta(seconds=0.06))

    result = scan_once(partitions=ALL, now=now, publish=False)

    assert result.queued == [soon.pk] and result.misfired == 0
    soon.refresh_from_db()
    later.refresh_from_db()
    assert (soon.status, later.status) == (S.QUEUED, S.SCHEDULED)
    assert soon.queued_at == now < soon.due_at  # queued before it is due, at the scan's time


@override_settings(SCHEDULER_DISPATCH_BATCH=3, SCHEDULER_TARGET_CONCURRENCY=100, SCHEDULER_LOOKAHEAD=0.05)
def test_messages_carry_runs_due_close_together_and_go_out_earliest_first() -> None:
    now = datetime(2026, 10, 28, 20, 30, tzinfo=timezone.utc)
    ms = lambda n: now + timedelta(milliseconds=n)  # noqa: E731
    slice_ms = int(due_slice() * 1000)
    # Runs 1-4 due already (one host: a full batch, then the rest); 5-7 ahead on host a,
    # 8 ahead on host b; given in due order, as the scan reads them.
    due = {1: ms(-900), 2: ms(-500), 3: ms(-1), 4: ms(0), 8: ms(2), 5: ms(5), 6: ms(5 + slice_ms), 7: ms(6 + slice_ms)}
    hosts = {i: ("b" if i == 8 else "a") for i in due}

    messages = run_messages(list(due), hosts=hosts, due=due, now=now)

    assert messages == [[1, 2, 3], [4], [8], [5, 6], [7]]


@override_settings(SCHEDULER_DISPATCH_BATCH=200, SCHEDULER_TARGET_CONCURRENCY=200)
def test_a_backlog_already_due_still_goes_in_full_batches() -> None:
    now = datetime(2026, 10, 28, 20, 30, tzinfo=timezone.utc)
    due = {i: now - timedelta(milliseconds=1000 - i) for i in range(1, 501)}

    messages = run_messages(list(due), hosts={i: "a" for i in due}, due=due, now=now)

    assert [len(m) for m in messages] == [200, 200, 100]


def test_a_run_queued_ahead_is_republished_only_past_its_due_time_plus_the_wait() -> None:
    """SCHEDULER_REQUEUE_AFTER counts from when the run could first be claimed: the
    later of its queued_at and its due_at."""
    job = make_job()
    now = claims.store_now()
    run = make_run(job, now.replace(microsecond=0) + timedelta(days=1))
    Run.objects.filter(pk=run.pk).update(due_at=now + timedelta(seconds=10))
    with override_settings(SCHEDULER_LOOKAHEAD=10, SCHEDULER_REQUEUE_AFTER=30):
        assert scan_once(partitions=ALL, now=now, publish=False).queued == [run.pk]
        # 31 s after it was queued, 21 s after it was due: not yet.
        assert scan_once(partitions=ALL, now=now + timedelta(seconds=31), publish=False).republished == []
        assert scan_once(partitions=ALL, now=now + timedelta(seconds=41), publish=False).republished == [run.pk]


# --------------------------------------------------------------------------- the claim


def test_a_queued_run_not_yet_due_by_the_stores_clock_cannot_be_claimed_whatever_the_workers_clock() -> None:
    job = make_job()
    run = make_run(job, claims.store_now().replace(microsecond=0) + timedelta(days=1), status=S.QUEUED)
    Run.objects.filter(pk=run.pk).update(due_at=claims.store_now() + timedelta(minutes=5))
    # This process's clock an hour ahead: the claim reads the store's clock, not it.
    with time_machine.travel(claims.store_now() + timedelta(hours=1), tick=True):
        assert claims.claim(run_id=run.pk, worker="w1", lease=LEASE) is None
        assert claims.claim_many(run_ids=[run.pk], worker="w1", lease=LEASE) == []
    run.refresh_from_db()
    assert (run.status, run.fence, run.attempt) == (S.QUEUED, 0, 0)


# --------------------------------------------------------------------------- the worker


@pytest.mark.embedded
def test_a_run_queued_ahead_is_called_at_its_due_time_not_before(service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), 0.3)

    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"

    run.refresh_from_db()
    [call] = target.calls("/hook")
    assert run.due_at <= run.started_at  # the claim, in the store's clock
    assert run.due_at <= entry(run, "claimed").at  # and so says its timeline
    assert run.due_at.timestamp() <= call.at <= run.due_at.timestamp() + LATE_BOUND  # one machine: one clock
    assert types(run) == ["scheduled", "claimed", "target_answered", "succeeded"]


def test_a_worker_whose_clock_runs_ahead_waits_by_the_stores_clock(service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), 0.5)
    # This worker's clock 30 s ahead: unless it corrects by the store's clock it
    # would try at once (and be refused by the claim).
    with time_machine.travel(claims.store_now() + timedelta(seconds=30), tick=True):
        assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    run.refresh_from_db()
    [call] = target.calls("/hook")
    assert run.due_at <= run.started_at and run.due_at.timestamp() <= call.at
    assert len(entries(run, "claimed")) == 1


def _estimate_off_by(seconds: float, times: int) -> Callable[[], tuple[datetime, float]]:
    """The worker's estimate of the store's clock, `seconds` ahead of the truth the
    first `times` times it is read: what a wrong clock estimate looks like."""
    real = claims.store_clock_offset
    count = {"n": 0}

    def estimate() -> tuple[datetime, float]:
        now, offset = real()
        count["n"] += 1
        return (now, offset + seconds) if count["n"] <= times else (now, offset)

    return estimate


@pytest.mark.parametrize(("ahead", "times"), [(0.3, 1), (5.0, 100)], ids=["once", "every time"])
def test_a_claim_refused_as_not_yet_due_is_tried_again_at_the_due_time(
    service: Any, target: LoopbackTarget, ahead: float, times: int
) -> None:
    """The worker's estimate says the store's clock is `ahead` seconds further on than
    it is (the first time, or every time): it tries early, the claim refuses, and it
    tries again once the store's own reading (which came with the estimate) says due."""
    run = queued_ahead(job_for(service, target), 0.4)
    with mock.patch.object(claims, "store_clock_offset", _estimate_off_by(ahead, times=times)), \
            counting_claims() as waves:
        assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    run.refresh_from_db()
    [call] = target.calls("/hook")
    assert run.due_at <= run.started_at and run.due_at.timestamp() <= call.at
    assert (run.fence, run.attempt) == (1, 1) and len(waves) == 2  # refused once, then claimed


def test_a_run_due_past_the_longest_wait_is_given_back_without_waiting(service: Any, target: LoopbackTarget) -> None:
    run = queued_ahead(job_for(service, target), run_services.longest_wait() + 60)
    assert run_execute(run_id=run.pk, worker="w1") == "not_yet_due"
    run.refresh_from_db()
    assert run.status == S.SCHEDULED and target.calls() == []


@contextmanager
def counting_claims() -> Iterator[list[set[int]]]:
    """The runs of each claim statement the worker makes (the real one), in order."""
    waves: list[set[int]] = []
    real = run_services._claim_wave

    def claim_wave(wave: list[Run], worker: str, lease: timedelta, *rest: Any) -> Any:
        waves.append({r.pk for r in wave})
        return real(wave, worker, lease, *rest)

    with mock.patch.object(run_services, "_claim_wave", claim_wave):
        yield waves


def _during_the_wait(action: Callable[[], object]) -> Any:
    """The worker's wait for a due time, with `action` done at its start: what other
    processes do while a worker holds a message for a run not yet due."""
    real = run_services._Batch.sleep_until

    def sleep_until(self: Any, when: datetime) -> None:
        with transaction.atomic():
            action()
        real(self, when)

    return mock.patch.object(run_services._Batch, "sleep_until", sleep_until)


@pytest.mark.parametrize(("stop", "left"), [
    ("job paused", (S.SCHEDULED, True)),
    ("job deleted", (S.CANCELLED, False)),
    ("target paused", (S.SCHEDULED, True)),
])
def test_a_run_stopped_while_it_is_waited_for_is_refused_by_the_claim(
    service: Any, target: LoopbackTarget, stop: str, left: tuple[str, bool]
) -> None:
    job = job_for(service, target)
    run = queued_ahead(job, 0.3)
    stops: dict[str, Callable[[], object]] = {
        "job paused": lambda: job_pause(job=Job.objects.get(pk=job.pk)),
        "job deleted": lambda: job_delete(job=Job.objects.get(pk=job.pk)),
        "target paused": lambda: target_pause(host=f"127.0.0.1:{target.port}"),
    }
    with _during_the_wait(stops[stop]):
        assert run_execute(run_id=run.pk, worker="w1") == "not_claimed"
    run.refresh_from_db()
    assert target.calls() == [] and (run.status, run.held) == left and (run.fence, run.attempt) == (0, 0)


def test_a_run_another_worker_claims_at_its_due_time_is_not_claimed_twice(service: Any, target: LoopbackTarget) -> None:
    job = job_for(service, target)
    run = queued_ahead(job, 0.3)

    def other_worker_first() -> None:
        # The other worker's own wait, then its claim, before this one's.
        for _ in range(200):
            if claims.store_now() >= run.due_at:
                break
            time.sleep(0.005)
        assert claims.claim(run_id=run.pk, worker="w2", lease=LEASE) is not None

    with _during_the_wait(other_worker_first):
        assert run_execute(run_id=run.pk, worker="w1") == "not_claimed"
    run.refresh_from_db()
    assert target.calls() == [] and (run.lease_owner, run.fence) == ("w2", 1)


def test_a_batch_claims_its_runs_in_waves_as_they_come_due(service: Any, target: LoopbackTarget) -> None:
    """Runs due now, and runs due 0.2 s and 0.4 s ahead, in one message: each called
    at its own time, one claim statement per wave, one outcome write for all."""
    jobs = [job_for(service, target, f"/r{i}") for i in range(5)]
    now = claims.store_now()
    runs = [queued_ahead(job, ahead, now) for job, ahead in zip(jobs, [-1.0, -0.5, 0.2, 0.2, 0.4])]
    with counting_claims() as waves:
        outcomes = run_execute_many(run_ids=[r.pk for r in reversed(runs)], worker="w1")

    assert set(outcomes.values()) == {"succeeded"}
    ids = [r.pk for r in runs]
    assert waves == [set(ids[:2]), set(ids[2:4]), set(ids[4:])]
    for i, run in enumerate(runs):
        run.refresh_from_db()
        [call] = target.calls(f"/r{i}")
        assert run.due_at <= run.started_at and run.due_at.timestamp() <= call.at


def test_a_batch_of_waves_reads_the_breakers_once_and_counts_its_claims_in_one_write(
    service: Any, target: LoopbackTarget, monkeypatch: Any
) -> None:
    """The statements a wave costs: its claim and nothing more. The batch reads its
    hosts' breakers once, the claim reads the store's clock itself, the claims of
    every wave are counted in one rollup write, and calls that all succeed to a host
    with nothing counted on its breaker write nothing there."""
    jobs = [job_for(service, target, f"/r{i}") for i in range(5)]
    now = claims.store_now()
    runs = [queued_ahead(job, ahead, now) for job, ahead in zip(jobs, [-1.0, -0.5, 0.2, 0.2, 0.4])]
    # The waves span 0.4 s here; how old a read may get is the next test's.
    monkeypatch.setattr(run_services, "BREAKER_READ_FOR", 5.0)
    with counting_claims() as waves, CaptureQueriesContext(connection) as captured:
        outcomes = run_execute_many(run_ids=[r.pk for r in runs], worker="w1")

    assert set(outcomes.values()) == {"succeeded"} and len(waves) == 3
    sql = [" ".join(q["sql"].split()) for q in captured.captured_queries]
    assert sum('FROM "target_breakers"' in s for s in sql) == 1
    assert not any(s.startswith('UPDATE "target_breakers"') for s in sql)
    assert sum(s.startswith("WITH c AS (UPDATE runs") for s in sql) == 3  # the claims, clock and all
    # Each outcome lands as its call ends (runs.flights), with those that ended by then:
    # a transaction for each group, and nothing else in a transaction. Here each wave's
    # calls had ended before the next wave was due, so a group a wave at most.
    writes = sum(s == "BEGIN" for s in sql)
    assert 1 <= writes <= len(waves)
    # One read for the batch's clock offset, one for each group's outcome time: none a wave's claim.
    assert sum(s == "SELECT clock_timestamp()" for s in sql) == 1 + writes
    # The claims' counts in one upsert, each group's outcomes' in another.
    assert sum(s.startswith("INSERT INTO run_rollups") for s in sql) == 1 + writes
    # The outcome write locks the jobs without what their calls sent.
    locks = [s for s in sql if s.endswith("FOR NO KEY UPDATE")]
    assert len(locks) == writes
    assert all('"jobs"."schedule"' in lock and '"jobs"."payload"' not in lock and '"jobs"."headers"' not in lock
               for lock in locks)
    started = RunRollup.objects.filter(minute=rollups.TOTAL_MINUTE, kind="started")
    assert started.aggregate(n=Sum("n"), lag_n=Sum("lag_n")) == {"n": 5, "lag_n": 5}


def test_a_workers_batches_share_one_read_of_the_breakers_until_a_call_fails(
    service: Any, target: LoopbackTarget, monkeypatch: Any
) -> None:
    """The read of the breakers is the worker process's, not a message's: the next
    message within BREAKER_READ_FOR reads nothing, and a failed call makes the next
    one read them again."""
    monkeypatch.setattr(run_services, "BREAKER_READ_FOR", 5.0)
    jobs = [job_for(service, target, f"/r{i}") for i in range(3)]
    target.script("/r1", [500])

    def breaker_reads(job: Job) -> tuple[str, int]:
        run = queued_ahead(job, -0.1)
        with CaptureQueriesContext(connection) as captured:
            [outcome] = run_execute_many(run_ids=[run.pk], worker="w1").values()
        return outcome, sum('FROM "target_breakers"' in q["sql"] for q in captured.captured_queries)

    assert breaker_reads(jobs[0]) == ("succeeded", 1)
    assert breaker_reads(jobs[1]) == ("dead", 0)  # the read is fresh; the failure is counted...
    assert breaker_reads(jobs[2]) == ("succeeded", 1)  # ...so the next message reads again, and resets it
    from runs.models import TargetBreaker

    assert TargetBreaker.objects.get().failures == 0


def test_a_claim_that_takes_nothing_still_says_its_clock() -> None:
    job = make_job()
    run = make_run(job, claims.store_now().replace(microsecond=0) + timedelta(days=1), status=S.QUEUED)
    before = claims.store_now()
    taken, clock = claims.claim_many_clocked(run_ids=[run.pk], worker="w1", lease=LEASE)
    assert taken == [] and before <= clock <= claims.store_now()
    Run.objects.filter(pk=run.pk).update(due_at=before)
    [claim], clock = claims.claim_many_clocked(run_ids=[run.pk], worker="w1", lease=LEASE)
    assert claim.run_id == run.pk and claim.claimed_at == clock


def test_a_batchs_read_of_the_breakers_is_taken_again_when_old_or_when_a_host_is_not_closed(
    monkeypatch: Any,
) -> None:
    from runs import breakers
    from runs.models import TargetBreaker

    B = TargetBreaker.State
    TargetBreaker.objects.create(host="open.example:443", state=B.OPEN, failures=5)
    TargetBreaker.objects.create(host="counting.example:443", state=B.CLOSED, failures=2)
    clock = [100.0]
    monkeypatch.setattr(run_services.time, "monotonic", lambda: clock[0])
    view = run_services._BreakerView()
    everyone = ["open.example:443", "counting.example:443", "fine.example:443"]

    def reads(hosts: list[str]) -> tuple[set[str], int]:
        with CaptureQueriesContext(connection) as captured:
            found = view.not_closed(hosts, everyone)
        return found, len(captured.captured_queries)

    assert reads(["fine.example:443"]) == (set(), 1)  # the first read covers the batch's hosts
    assert reads(["fine.example:443", "counting.example:443"]) == (set(), 0)
    assert view.nothing_to_reset("fine.example:443") and not view.nothing_to_reset("counting.example:443")
    assert reads(["open.example:443"]) == ({"open.example:443"}, 1)  # not closed: read each time
    assert reads(["open.example:443"]) == ({"open.example:443"}, 1)
    assert reads(["fine.example:443"]) == (set(), 0)
    TargetBreaker.objects.create(host="fine.example:443", state=B.OPEN, failures=5)  # another worker's doing
    assert reads(["fine.example:443"]) == (set(), 0)  # not seen while the read is fresh...
    clock[0] += run_services.BREAKER_READ_FOR + 0.01
    assert reads(["fine.example:443"]) == ({"fine.example:443"}, 1)  # ...and seen once it is old
    assert breakers.not_closed(everyone) == {"open.example:443", "fine.example:443"}
