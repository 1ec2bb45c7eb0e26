"""The run lifecycle's three job-level policies, through the real path (a scan, the
worker's `run_execute`, a real loopback target, real PostgreSQL):

- `overlap`: what happens to the times that pass while a job's run is in flight;
- `pause_after_failures`: a job whose runs keep ending dead pauses itself;
- `paused_until`: a paused job resumes by itself, within one scan of that time.

The clock is the one thing mocked: time_machine, frozen and moved by the test, with
the store's clock pointed at it (runs.claims._clock_in_the_database, the seam
tests/runs/test_stateful.py uses), so a call "lasts" minutes while the test waits
on conditions with deadlines only.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
import time_machine
from django.core import mail
from django.db import connection
from django.test import override_settings

from jobs.models import AuditEntry, Job
from jobs.services import job_create, job_pause, job_resume, job_update
from runs import claims, notices
from runs.models import Run, RunEvent
from runs.services import run_execute
from runs.signals import job_paused
from scanners.scan import scan_once
from tests.factories import make_run, utc
from tests.target import LoopbackTarget

# Also on the embedded defaults (SQLite): the claim hands back started_at in its text form there.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.embedded]
S = Run.Status
T0 = utc("2026-10-28T20:29:30Z")
EVERY_MINUTE = "* * * * *"
DEADLINE = 10.0  # seconds any wait here may take, in real time


class HeldTarget(LoopbackTarget):
    """A loopback target that holds each call until the test lets it answer."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def _answer(self, path: str) -> tuple[int, float, dict[str, str]]:
        self.entered.set()
        self.gate.wait(DEADLINE)
        return super()._answer(path)


@pytest.fixture
def target() -> Iterator[HeldTarget]:
    server = HeldTarget().start()
    server.gate.set()  # answers at once unless a test closes the gate
    yield server
    server.gate.set()
    server.stop()


@pytest.fixture
def clock() -> Iterator[Any]:
    """The frozen clock, which is also the store's (leases, due times, outcomes)."""
    with time_machine.travel(T0, tick=False) as traveller, \
            mock.patch.object(claims, "_clock_in_the_database", lambda: False):
        yield traveller


def make(owner: Any, url: str, **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "overlap", "schedule": EVERY_MINUTE, "target": url, "retry_max": 0,
                              "retry_base_seconds": 1, "timeout_seconds": 5}
    values.update(fields)
    return job_create(owner=owner, fields=values)


def scan() -> Any:
    from django.conf import settings

    return scan_once(partitions=frozenset(range(settings.SCHEDULER_PARTITIONS)), publish=False)


def waiting_run(job: Job) -> Run:
    return Run.objects.get(job=job, status__in=Run.OPEN, is_backfill=False)


def run_held_call(target: HeldTarget, clock: Any, run: Run, *, lasts: int) -> str:
    """The worker's path for `run` on a thread of its own; while the target holds the
    call, the clock moves on `lasts` seconds; then the target answers."""
    outcome: list[str] = []

    def worker() -> None:
        try:
            outcome.append(run_execute(run_id=run.pk, worker="w-held"))
        finally:
            connection.close()

    target.entered.clear()
    target.gate.clear()
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert target.entered.wait(DEADLINE), "the call never reached the target"
        clock.shift(lasts)
    finally:
        target.gate.set()
        thread.join(DEADLINE)
    assert not thread.is_alive() and len(outcome) == 1
    return outcome[0]


def first_run_due(clock: Any, job: Job) -> Run:
    """The clock to the job's first time, and a scan queues its run."""
    run = waiting_run(job)
    clock.move_to(run.due_at)
    assert run.pk in scan().queued
    return Run.objects.get(pk=run.pk)


def rows_after(job: Job, run: Run) -> list[Run]:
    return list(Run.objects.filter(job=job, scheduled_for__gt=run.scheduled_for).order_by("scheduled_for"))


def event_types(run: Run) -> list[str]:
    return list(RunEvent.objects.filter(run=run).order_by("id").values_list("type", flat=True))


# --------------------------------------------------------------------------- overlap


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_under_skip_the_times_a_long_call_spans_are_skipped_and_the_next_run_is_the_next_future_time(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    # A call of 3 min 20 s on an every-minute job: 20:31, 20:32 and 20:33 pass while it
    # is in flight (the lead adds the every-10-seconds variant once `every` is merged).
    job = make(service.user, target.url("/long"), overlap="skip")
    run = first_run_due(clock, job)
    assert run_held_call(target, clock, run, lasts=200) == "succeeded"
    rows = rows_after(job, run)
    assert [(r.scheduled_for, r.status) for r in rows] == [
        (utc("2026-10-28T20:31:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:32:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:33:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:34:00Z"), S.SCHEDULED),
    ]
    for row in rows[:3]:
        [skipped] = RunEvent.objects.filter(run=row, type="skipped")
        assert skipped.detail["reason"] == "overlap"
    # The misfire path has nothing of them: the next scan misfires nothing.
    assert scan().misfired == 0
    assert not RunEvent.objects.filter(run__job=job, type="misfired").exists()
    assert len(target.calls("/long")) == 1


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_under_buffer_one_the_latest_time_a_long_call_spans_runs_as_soon_as_it_ends_and_is_not_misfired(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    job = make(service.user, target.url("/long"), overlap="buffer_one")
    run = first_run_due(clock, job)
    assert run_held_call(target, clock, run, lasts=200) == "succeeded"  # ends at 20:33:20
    rows = rows_after(job, run)
    assert [(r.scheduled_for, r.status) for r in rows] == [
        (utc("2026-10-28T20:31:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:32:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:33:00Z"), S.SCHEDULED),
    ]
    buffered = rows[-1]
    # Due now, although 20:33:00 plus the 10 s grace has passed: it runs, not misfires.
    assert buffered.due_at == utc("2026-10-28T20:33:20Z")
    result = scan()
    assert result.queued == [buffered.pk] and result.misfired == 0
    assert "misfired" not in event_types(buffered)
    assert run_execute(run_id=buffered.pk, worker="w2") == "succeeded"
    assert len(target.calls("/long")) == 2
    assert waiting_run(job).scheduled_for == utc("2026-10-28T20:34:00Z")


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_a_buffered_time_that_has_a_cancelled_row_reopens_it_due_now(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    job = make(service.user, target.url("/long"), overlap="buffer_one")
    cancelled = make_run(job, utc("2026-10-28T20:33:00Z"), status=S.CANCELLED)  # an earlier edit's
    run = first_run_due(clock, job)
    assert run_held_call(target, clock, run, lasts=200) == "succeeded"  # ends at 20:33:20
    cancelled.refresh_from_db()
    assert cancelled.status == S.SCHEDULED and cancelled.due_at == utc("2026-10-28T20:33:20Z")
    result = scan()
    assert result.queued == [cancelled.pk] and result.misfired == 0


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_before_overlap_policies_a_long_calls_times_would_have_gone_to_the_misfire_path(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    """What the policies change (docs/architecture.md): a call that ends before its
    job's next time passes leaves that time alone, whatever the policy."""
    job = make(service.user, target.url("/short"), overlap="skip")
    run = first_run_due(clock, job)
    assert run_held_call(target, clock, run, lasts=50) == "succeeded"  # ends at 20:30:50
    assert [(r.scheduled_for, r.status) for r in rows_after(job, run)] == [
        (utc("2026-10-28T20:31:00Z"), S.SCHEDULED)
    ]


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_a_time_that_passed_before_the_claim_stays_the_misfire_policys(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    """The job was behind before its run started (claimed at 20:31:30, after 20:31
    had passed): that time is not the overlap policy's; the next run is 20:31 and the
    scanner's misfire policy (run_once) decides what happens to it."""
    job = make(service.user, target.url("/late"), overlap="skip", misfire="run_once")
    run = waiting_run(job)
    clock.move_to(utc("2026-10-28T20:30:05Z"))
    assert run.pk in scan().queued
    clock.move_to(utc("2026-10-28T20:31:30Z"))  # the worker picks it up late
    assert run_held_call(target, clock, run, lasts=60) == "succeeded"  # ends at 20:32:30
    rows = rows_after(job, run)
    assert [(r.scheduled_for, r.status) for r in rows] == [(utc("2026-10-28T20:31:00Z"), S.SCHEDULED)]
    result = scan()
    assert result.misfired == 1  # 20:31 is late: run_once runs it and skips 20:32
    [late] = RunEvent.objects.filter(run=rows[0], type="misfired")
    assert late.detail["policy"] == "run_once"


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_a_retry_wait_is_part_of_the_flight(service: Any, target: HeldTarget, clock: Any) -> None:
    """In flight runs from the first claim to the outcome: times that pass while the
    run waits for its retry are the overlap policy's too."""
    job = make(service.user, target.url("/flaky"), overlap="skip", retry_max=1, retry_base_seconds=240,
               retry_cap_seconds=240)
    target.script("/flaky", [500, 200])
    run = first_run_due(clock, job)
    assert run_execute(run_id=run.pk, worker="w1") == "retry_scheduled"
    run.refresh_from_db()
    clock.move_to(run.due_at + timedelta(seconds=1))  # 2 to 4 minutes later (equal jitter)
    assert run.pk in scan().queued
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    run.refresh_from_db()
    rows = rows_after(job, run)
    passed = [utc("2026-10-28T20:30:00Z") + timedelta(minutes=m) for m in range(1, 6)]
    passed = [t for t in passed if t <= run.finished_at]
    assert len(passed) >= 2
    assert [(r.scheduled_for, r.status) for r in rows[:-1]] == [(t, S.SKIPPED) for t in passed]
    assert rows[-1].status == S.SCHEDULED and rows[-1].scheduled_for == passed[-1] + timedelta(minutes=1)
    assert all(r.last_error.startswith("passed while the job's run was in flight") for r in rows[:-1])


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_MAX_SKIPPED=2)
def test_overlap_skipped_rows_are_bounded_like_the_misfire_paths(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    job = make(service.user, target.url("/long"), overlap="skip")
    run = first_run_due(clock, job)
    assert run_held_call(target, clock, run, lasts=600) == "succeeded"  # 20:40:00: ten times pass
    rows = rows_after(job, run)
    assert [(r.scheduled_for, r.status) for r in rows] == [
        (utc("2026-10-28T20:39:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:40:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:41:00Z"), S.SCHEDULED),
    ]
    [skipped] = RunEvent.objects.filter(run=rows[0], type="skipped")
    assert skipped.detail["passed_in_flight"] == 10


# --------------------------------------------------------------------------- pause_after_failures


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_a_job_whose_last_three_runs_end_dead_pauses_itself_and_its_owner_is_told(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    told: list[tuple[int, str]] = []

    def listener(sender: Any, job: Job, reason: str, **kwargs: Any) -> None:
        told.append((job.pk, reason))

    job_paused.connect(listener)
    try:
        job = make(service.user, target.url("/down"), pause_after_failures=3)
        target.script("/down", [500])  # retry max 0: every run ends dead
        outcomes = []
        for _ in range(3):
            assert not Job.objects.get(pk=job.pk).paused
            run = first_run_due(clock, job)
            outcomes.append(run_execute(run_id=run.pk, worker="w1"))
    finally:
        job_paused.disconnect(listener)
    assert outcomes == ["dead", "dead", "dead"]
    job.refresh_from_db()
    assert job.paused and job.state == Job.State.PAUSED
    waiting = waiting_run(job)
    assert waiting.held  # the next run was made, and is held
    assert told == [(job.pk, "its last 3 runs ended dead (pause_after_failures=3)")]
    with override_settings(SCHEDULER_EMAIL_ENABLED=True):
        notices.notices_send()  # the owner is told through the outbox (runs.notices), digested
    paused_mail = [m for m in mail.outbox if "paused itself" in m.subject]
    assert len(paused_mail) == 1 and paused_mail[0].to == ["reports@example.test"]
    [entry] = AuditEntry.objects.filter(object_id=job.public_id, action="paused")
    assert entry.actor == "scheduler" and entry.detail == {"reason": "pause_after_failures", "failures": 3}
    # Held: the next scan does not queue it.
    clock.move_to(waiting.due_at + timedelta(seconds=1))
    assert scan().queued == []


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_a_success_between_failures_starts_the_count_again(service: Any, target: HeldTarget, clock: Any) -> None:
    job = make(service.user, target.url("/patchy"), pause_after_failures=2)
    target.script("/patchy", [500, 200, 500, 500])
    outcomes = []
    for _ in range(3):
        run = first_run_due(clock, job)
        outcomes.append(run_execute(run_id=run.pk, worker="w1"))
    assert outcomes == ["dead", "succeeded", "dead"]
    assert not Job.objects.get(pk=job.pk).paused
    run = first_run_due(clock, job)
    assert run_execute(run_id=run.pk, worker="w1") == "dead"
    assert Job.objects.get(pk=job.pk).paused


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_pause_after_failures_zero_never_pauses(service: Any, target: HeldTarget, clock: Any) -> None:
    job = make(service.user, target.url("/down"))
    target.script("/down", [404])
    for _ in range(3):
        run = first_run_due(clock, job)
        assert run_execute(run_id=run.pk, worker="w1") == "dead"
    assert not Job.objects.get(pk=job.pk).paused
    assert not AuditEntry.objects.filter(action="paused").exists()


# --------------------------------------------------------------------------- paused_until


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_a_paused_job_resumes_within_one_scan_of_its_paused_until(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    job = make(service.user, target.url("/ok"))
    job = job_update(job=job, fields={"paused": True, "paused_until": utc("2026-10-28T20:40:00Z")})
    assert job.paused and job.paused_until == utc("2026-10-28T20:40:00Z")
    clock.move_to(utc("2026-10-28T20:39:59Z"))
    assert scan().resumed == []
    assert Job.objects.get(pk=job.pk).paused
    clock.move_to(utc("2026-10-28T20:40:00Z"))
    result = scan()
    assert result.resumed == [job.pk]
    job.refresh_from_db()
    assert not job.paused and job.paused_until is None and job.state == Job.State.ACTIVE
    [entry] = AuditEntry.objects.filter(object_id=job.public_id, action="resumed")
    assert entry.actor == "scheduler" and entry.detail["paused_until"] == "2026-10-28T20:40:00Z"
    # Resumed under its misfire policy (run_once): the 20:30 run, late, runs now.
    [late] = Run.objects.filter(job=job, scheduled_for=utc("2026-10-28T20:30:00Z"))
    assert not late.held and late.pk in result.queued
    assert RunEvent.objects.filter(run=late, type="misfired").exists()


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_resuming_by_hand_clears_paused_until(service: Any, target: HeldTarget, clock: Any) -> None:
    job = make(service.user, target.url("/ok"))
    job_update(job=job, fields={"paused": True, "paused_until": utc("2026-10-28T20:40:00Z")})
    job_resume(job=job)
    job.refresh_from_db()
    assert not job.paused and job.paused_until is None
    job_pause(job=job)
    clock.move_to(utc("2026-10-28T20:41:00Z"))
    assert scan().resumed == []  # paused again by hand, with no time: stays paused
    assert Job.objects.get(pk=job.pk).paused


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_one_job_that_cannot_be_resumed_costs_only_that_job(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    first = make(service.user, target.url("/a"))
    second = make(service.user, target.url("/b"))
    for job in (first, second):
        job_update(job=job, fields={"paused": True, "paused_until": utc("2026-10-28T20:40:00Z")})
    # The first job's stored schedule no longer parses and its waiting run is gone:
    # resuming it (which makes it a next run) fails, on that job only.
    Run.objects.filter(job=first).delete()
    Job.objects.filter(pk=first.pk).update(schedule="not a cron")
    clock.move_to(utc("2026-10-28T20:41:00Z"))
    result = scan()
    assert result.resumed == [second.pk]
    assert Job.objects.get(pk=first.pk).paused and not Job.objects.get(pk=second.pk).paused
    Job.objects.filter(pk=first.pk).update(schedule=EVERY_MINUTE)  # mended
    assert scan().resumed == [first.pk]  # the next scan tries it again
