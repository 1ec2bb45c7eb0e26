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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from unittest import mock

import pytest
import time_machine
from django.core import mail
from django.db import connection
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from jobs.models import AuditEntry, Job
from jobs.public_ids import parse_id
from jobs.services import job_create, job_pause, job_resume, job_update
from runs import claims, notices
from runs.invariants import one_open_run_per_job
from runs.models import JOBS_OPEN_RUN, Run, RunEvent
from runs.services import run_execute
from runs.signals import job_paused
from scanners.scan import scan_once
from tests.factories import make_run, utc, timeline_types, entries
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
    """The job's own open run (under overlap allow: the one not yet in flight)."""
    return Run.objects.get(JOBS_OPEN_RUN, job=job)


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
    return timeline_types(run)


# --------------------------------------------------------------------------- overlap


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6)
def test_under_skip_the_times_a_long_call_spans_are_skipped_and_the_next_run_is_the_next_future_time(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    # A call of 3 min 20 s on an every-minute job: 20:31, 20:32 and 20:33 pass while it
    # is in flight (the every-10-seconds variants, one per policy, are further down).
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


@pytest.mark.parametrize("policy", ["skip", "buffer_one"])
@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_MISFIRE_MAX_SKIPPED=2)
def test_past_the_overlap_cap_the_times_not_looked_at_are_the_misfire_policys(
    service: Any, target: HeldTarget, clock: Any, monkeypatch: Any, policy: str
) -> None:
    """A run in flight for more than MAX_OVERLAP_TIMES of its job's times (20,000; 5
    here). On 1418bea the job went on from now: the times from the cap to now had no
    row and no count (the stateful test found it, a run in flight for a month of an
    every-two-minutes job). Now the next run is the first time past the cap, already
    passed, and the scanner's misfire policy writes or counts the rest."""
    from runs import nextrun
    from scanners.scan import scan_once

    monkeypatch.setattr(nextrun, "MAX_OVERLAP_TIMES", 5)
    job = make(service.user, target.url("/long"), overlap=policy)
    run = first_run_due(clock, job)
    assert run_held_call(target, clock, run, lasts=600) == "succeeded"  # 20:40:00: ten times passed
    rows = rows_after(job, run)
    assert [(r.scheduled_for, r.status) for r in rows] == [
        (utc("2026-10-28T20:34:00Z"), S.SKIPPED),  # the latest 2 of the 5 looked at
        (utc("2026-10-28T20:35:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:36:00Z"), S.SCHEDULED),  # the first not looked at: passed
    ]
    [skipped] = RunEvent.objects.filter(run=rows[0], type="skipped")
    assert skipped.detail["passed_in_flight"] == 5 and skipped.detail["rest_to_misfire_policy"] is True
    scan_once(partitions=frozenset(range(settings.SCHEDULER_PARTITIONS)), now=timezone.now(), publish=False)
    late = Run.objects.get(pk=rows[-1].pk)
    misfired = RunEvent.objects.filter(run=late, type="misfired").first()
    assert misfired is not None, "the passed run was not put to the misfire policy"
    # run_once: the late run (20:36) runs now; 20:37 to 20:39 were missed after it: the
    # latest 2 get rows, and all 3 are counted on its misfired event. Nothing is lost.
    assert misfired.detail["policy"] == "run_once" and misfired.detail["other_missed_times"] == 3
    assert [(r.scheduled_for, r.status) for r in rows_after(job, run)][2:] == [
        (utc("2026-10-28T20:36:00Z"), S.QUEUED),
        (utc("2026-10-28T20:38:00Z"), S.SKIPPED),
        (utc("2026-10-28T20:39:00Z"), S.SKIPPED),
    ]


# --------------------------------------------------------------------------- one long call, each policy
#
# Issue 20's done-when: "a 30 s call on an every-10 s job under each overlap policy
# gives the runs and skipped rows the policy says", with the scanner scanning and the
# workers claiming all along. The job is made through the API (`"every": "10s"`).

STEP = 10  # seconds between the job's times


def make_every_10s(service: Any, url: str, overlap: str) -> Job:
    with override_settings(SCHEDULER_MIN_INTERVAL="10s"):
        response = service.post("/api/jobs/", {"name": "every-10s", "every": "10s", "target": url,
                                               "overlap": overlap, "retry": {"max": 0}, "timeout": "5s"})
    assert response.status_code == 201, response.content
    assert response.json()["overlap"] == overlap
    return Job.objects.get(pk=parse_id("job", response.json()["id"]))


class OneByOneTarget(LoopbackTarget):
    """A loopback target that holds every call until the test lets that call answer."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: list[threading.Event] = []
        self.gates_lock = threading.Lock()

    def _answer(self, path: str) -> tuple[int, float, dict[str, str]]:
        gate = threading.Event()
        with self.gates_lock:
            self.gates.append(gate)
        gate.wait(DEADLINE)
        return super()._answer(path)

    def held(self) -> int:
        with self.gates_lock:
            return len(self.gates)

    def release_all(self) -> None:
        with self.gates_lock:
            for gate in self.gates:
                gate.set()


@pytest.fixture
def held_target() -> Iterator[OneByOneTarget]:
    server = OneByOneTarget().start()
    yield server
    server.release_all()
    server.stop()


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Workers:
    """The worker's path (run_execute), each run on a thread of its own, its call held
    by a OneByOneTarget until the test lets it answer."""

    def __init__(self, target: OneByOneTarget) -> None:
        self.target = target
        self.threads: list[threading.Thread] = []
        self.outcomes: dict[int, str] = {}

    def start(self, run_id: int) -> int:
        """A worker for the run, once its call has reached the target; returns its number
        (the number of its call: one call at a time reaches the target here)."""
        n = len(self.threads)

        def work() -> None:
            try:
                self.outcomes[n] = run_execute(run_id=run_id, worker=f"w-{n}")
            finally:
                connection.close()

        calls = self.target.held()
        self.threads.append(threading.Thread(target=work))
        self.threads[n].start()
        wait_for(lambda: self.target.held() > calls or n in self.outcomes,
                 f"run_{run_id}'s call to reach the target")
        assert n not in self.outcomes, f"run_{run_id} ended before its call: {self.outcomes[n]}"
        return n

    def finish(self, n: int) -> str:
        """Worker n's call answers; its outcome once it is written."""
        self.target.gates[n].set()
        self.threads[n].join(DEADLINE)
        assert not self.threads[n].is_alive()
        return self.outcomes[n]


@dataclass
class LongCall:
    first: Run  # the run whose call lasts 3 * STEP
    outcome: str
    started: list[int]  # the runs claimed while it was in flight, the first included
    in_flight: list[int]  # how many of the job's runs were running, after each scan
    waiting: list[int]  # how many waiting runs the job had, after each scan


def long_call(job: Job, target: OneByOneTarget, clock: Any) -> LongCall:
    """The job's first run is claimed and its call held; the clock moves on STEP at a
    time, each step a scan, and every run the scan queues goes to a worker of its own
    (held too). At 3 * STEP the first call answers, then the others, in turn."""
    workers = Workers(target)
    first = first_run_due(clock, job)
    workers.start(first.pk)
    started, in_flight, waiting = [first.pk], [], []
    for _ in range(3):
        clock.shift(STEP)
        for run_id in scan().queued:
            workers.start(run_id)
            started.append(run_id)
        in_flight.append(Run.objects.filter(job=job, status=S.RUNNING).count())
        waiting.append(Run.objects.filter(JOBS_OPEN_RUN, job=job).exclude(status=S.RUNNING).count())
        assert one_open_run_per_job() == []
    outcome = workers.finish(0)
    for n in range(1, len(started)):
        assert workers.finish(n) == "succeeded"
    return LongCall(Run.objects.get(pk=first.pk), outcome, started, in_flight, waiting)


def times_after(job: Job, run: Run) -> list[tuple[datetime, str]]:
    return [(r.scheduled_for, r.status) for r in rows_after(job, run)]


def overlap_rows(job: Job) -> int:
    return Run.objects.filter(job=job, status=S.SKIPPED, last_error__startswith="passed while").count()


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_a_30s_call_on_an_every_10s_job_under_skip_skips_the_three_times_it_spans(
    service: Any, held_target: OneByOneTarget, clock: Any
) -> None:
    job = make_every_10s(service, held_target.url("/long"), "skip")
    found = long_call(job, held_target, clock)
    t = found.first.scheduled_for
    assert found.outcome == "succeeded" and found.started == [found.first.pk]
    assert found.in_flight == [1, 1, 1] and found.waiting == [0, 0, 0]  # nothing waits while it is in flight
    step = timedelta(seconds=STEP)
    assert times_after(job, found.first) == [
        (t + step, S.SKIPPED), (t + 2 * step, S.SKIPPED), (t + 3 * step, S.SKIPPED), (t + 4 * step, S.SCHEDULED),
    ]
    assert overlap_rows(job) == 3
    assert len(held_target.calls("/long")) == 1


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_a_30s_call_on_an_every_10s_job_under_buffer_one_runs_the_latest_time_it_spans_at_its_end(
    service: Any, held_target: OneByOneTarget, clock: Any
) -> None:
    job = make_every_10s(service, held_target.url("/long"), "buffer_one")
    found = long_call(job, held_target, clock)
    t = found.first.scheduled_for
    step = timedelta(seconds=STEP)
    assert found.outcome == "succeeded" and found.started == [found.first.pk]
    assert found.in_flight == [1, 1, 1] and found.waiting == [0, 0, 0]
    assert times_after(job, found.first) == [
        (t + step, S.SKIPPED), (t + 2 * step, S.SKIPPED), (t + 3 * step, S.SCHEDULED),
    ]
    assert overlap_rows(job) == 2
    buffered = waiting_run(job)
    assert buffered.due_at == found.first.finished_at  # due at once, at the end of the call
    assert scan().queued == [buffered.pk]


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_a_30s_call_on_an_every_10s_job_under_allow_runs_every_time_beside_it_with_one_waiting_run(
    service: Any, held_target: OneByOneTarget, clock: Any
) -> None:
    job = make_every_10s(service, held_target.url("/long"), "allow")
    found = long_call(job, held_target, clock)
    t = found.first.scheduled_for
    step = timedelta(seconds=STEP)
    assert found.outcome == "succeeded"
    # Each time's run started at its time, beside the long call: four in flight at the end.
    assert len(found.started) == 4
    assert found.in_flight == [2, 3, 4] and found.waiting == [1, 1, 1]
    assert times_after(job, found.first) == [
        (t + step, S.SUCCEEDED), (t + 2 * step, S.SUCCEEDED), (t + 3 * step, S.SUCCEEDED),
        (t + 4 * step, S.SCHEDULED),
    ]
    assert overlap_rows(job) == 0 and not Run.objects.filter(job=job, status=S.SKIPPED).exists()
    assert len(held_target.calls("/long")) == 4
    # Each claim made the next run (its `detached` event names it); no outcome made one.
    runs = list(Run.objects.filter(job=job).order_by("scheduled_for"))
    for ran, nxt in zip(runs, runs[1:]):
        [detached] = RunEvent.objects.filter(run=ran, type="detached")
        assert ran.detached and detached.detail["next_run"] == nxt.public_id
        [done] = entries(ran, "succeeded")
        assert "next_run" not in done.detail
    assert not runs[-1].detached
    assert scan().misfired == 0


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_under_allow_the_api_next_run_is_the_waiting_run_not_one_in_flight(
    service: Any, held_target: OneByOneTarget, clock: Any
) -> None:
    job = make(service.user, held_target.url("/long"), overlap="allow")
    workers = Workers(held_target)
    first = first_run_due(clock, job)
    workers.start(first.pk)
    body = service.client.get(f"/api/jobs/{job.public_id}/").json()
    nxt = waiting_run(job)
    assert nxt.scheduled_for == first.scheduled_for + timedelta(minutes=1)
    assert body["next_run"]["id"] == nxt.public_id and body["next_run"]["status"] == "scheduled"
    assert workers.finish(0) == "succeeded"


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_under_allow_a_detached_runs_retry_stays_detached_and_makes_no_second_waiting_run(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    job = make(service.user, target.url("/flaky"), overlap="allow", retry_max=1, retry_base_seconds=1,
               retry_cap_seconds=1)
    target.script("/flaky", [500, 200])
    run = first_run_due(clock, job)
    assert run_execute(run_id=run.pk, worker="w1") == "retry_scheduled"
    nxt = waiting_run(job)
    assert nxt.scheduled_for == run.scheduled_for + timedelta(minutes=1)
    run.refresh_from_db()
    assert run.detached and run.status == S.SCHEDULED
    clock.move_to(run.due_at + timedelta(seconds=1))
    assert run.pk in scan().queued
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    assert waiting_run(job).pk == nxt.pk  # still the one the first claim made
    assert RunEvent.objects.filter(run=run, type="detached").count() == 1
    assert one_open_run_per_job() == []


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_under_allow_a_detached_run_whose_lease_ran_out_is_recovered_and_claimed_again(
    service: Any, held_target: OneByOneTarget, clock: Any
) -> None:
    job = make(service.user, held_target.url("/lost"), overlap="allow", retry_max=1)
    run = first_run_due(clock, job)
    with override_settings(SCHEDULER_LEASE_SECONDS=30):
        workers = Workers(held_target)
        workers.start(run.pk)
        nxt_before = waiting_run(job)
        clock.shift(40)  # the lease ran out (the worker is as good as dead)
        result = scan()
        assert run.pk in result.lease_expired
        assert Run.objects.get(pk=run.pk).detached  # recovered, and still not the waiting run
        workers.start(run.pk)  # claimed again: still detached, no second next run
        assert workers.finish(1) == "succeeded"
        assert workers.finish(0) == "stale_write_rejected"
    assert waiting_run(job).pk == nxt_before.pk
    assert Run.objects.filter(job=job).count() == 2
    assert one_open_run_per_job() == []


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_under_allow_deleting_the_job_cancels_its_waiting_run_and_the_run_in_flight_finishes(
    service: Any, held_target: OneByOneTarget, clock: Any
) -> None:
    from jobs.services import job_delete

    job = make(service.user, held_target.url("/long"), overlap="allow")
    workers = Workers(held_target)
    run = first_run_due(clock, job)
    workers.start(run.pk)
    nxt = waiting_run(job)
    job_delete(job=job)
    assert workers.finish(0) == "succeeded"
    assert Run.objects.get(pk=nxt.pk).status == S.CANCELLED
    assert not Run.objects.filter(JOBS_OPEN_RUN, job=job).exists()


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_under_allow_dead_detached_runs_still_pause_the_job_after_failures(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    job = make(service.user, target.url("/down"), overlap="allow", pause_after_failures=2)
    target.script("/down", [500])
    for _ in range(2):
        run = first_run_due(clock, job)
        assert run_execute(run_id=run.pk, worker="w1") == "dead"
    job.refresh_from_db()
    assert job.paused
    assert waiting_run(job).held


@override_settings(SCHEDULER_MISFIRE_GRACE=10, SCHEDULER_BREAKER_FAILURES=10**6, SCHEDULER_LEASE_SECONDS=600)
def test_under_allow_a_claim_whose_next_run_cannot_be_made_costs_that_run_only(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    from runs.services import run_execute_many

    broken = make(service.user, target.url("/a"), overlap="allow")
    fine = make(service.user, target.url("/b"), overlap="allow")
    runs = [waiting_run(broken), waiting_run(fine)]
    clock.move_to(max(r.due_at for r in runs))
    assert set(scan().queued) == {r.pk for r in runs}
    Job.objects.filter(pk=broken.pk).update(schedule="not a cron")  # its next time cannot be worked out
    outcomes = run_execute_many(run_ids=[r.pk for r in runs], worker="w1")
    assert outcomes[runs[1].pk] == "succeeded"
    assert Run.objects.get(pk=runs[1].pk).detached and waiting_run(fine).scheduled_for > runs[1].scheduled_for
    # The broken job's run was called all the same, stays its job's own run, and says why.
    stuck = Run.objects.get(pk=runs[0].pk)
    assert not stuck.detached and len(target.calls("/a")) == 1
    [failed] = RunEvent.objects.filter(run=stuck, type="detach_failed")
    assert failed.detail["reason"]  # the exception, in words
    assert one_open_run_per_job() == []


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


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_BREAKER_FAILURES=10**6)
def test_under_allow_the_detached_event_is_not_stamped_before_its_claim(
    service: Any, target: HeldTarget, clock: Any
) -> None:
    """The wave reads the store's clock, then locks the allow-jobs (which can wait
    seconds behind a scan or an edit), then claims: the claim's entry carries the
    claim statement's own time. The soak under load (2026-12-01, 135 runs/s) found
    `detached` events stamped with the wave's earlier reading, 2.3 s before the
    `claimed` they follow, which runs.invariants counts as a timeline going back."""
    import runs.services as services

    job = make(service.user, target.url("/a"), overlap="allow")
    run = first_run_due(clock, job)
    real_lock = services.jobs_lock

    def lock_after_a_wait(*args: Any, **kwargs: Any) -> Any:
        clock.shift(3)  # the wait for the job's row lock
        return real_lock(*args, **kwargs)

    with mock.patch.object(services, "jobs_lock", lock_after_a_wait):
        assert services.run_execute_many(run_ids=[run.pk], worker="w1")[run.pk] == "succeeded"
    [claimed], [detached] = entries(run, "claimed"), entries(run, "detached")
    assert claimed.at == run.due_at + timedelta(seconds=3) and detached.at >= claimed.at
    from runs.invariants import timeline_violations
    from tests.factories import timeline_of

    run.refresh_from_db()
    assert timeline_violations(run.status, timeline_of(run)) == []
