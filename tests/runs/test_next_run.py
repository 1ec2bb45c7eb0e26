"""A job's next run, decided in one place (runs.nextrun.job_next_run) from the job as
it is inside the writing transaction: after edits, pauses and deletes that land while
a run is in flight, and when the next time already has a run (issue 12, defects 1, 2,
3 and 5). Real PostgreSQL, a real loopback target, the worker's own path
(`run_execute_many`)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from jobs import schedule
from jobs.models import Job
from jobs.services import job_backfill, job_create, job_delete, job_pause, job_resume, job_update
from jobs.ops import job_trigger
from runs.models import Run
from runs.ops import target_pause
from runs.services import run_execute, run_execute_many
from scanners.scan import scan_once
from tests.target import LoopbackTarget
from tests.factories import entry, timeline_types

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
EVERY_5 = "*/5 * * * *"
DEADLINE = 10.0  # seconds any wait in these tests may take


class GatedTarget(LoopbackTarget):
    """A loopback target whose answers wait at a gate: the test acts while a call is in flight."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.gate = threading.Event()

    def _answer(self, path: str) -> tuple[int, float, dict[str, str]]:
        self.entered.set()
        self.gate.wait(DEADLINE)
        return super()._answer(path)


@pytest.fixture
def target() -> Iterator[GatedTarget]:
    server = GatedTarget().start()
    server.gate.set()  # open unless a test closes it
    yield server
    server.gate.set()
    server.stop()


def create(owner: Any, target_url: str, **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "t", "schedule": EVERY_5, "target": target_url, "retry_base_seconds": 1}
    values.update(fields)
    return job_create(owner=owner, fields=values)


def queue_now(job: Job) -> Run:
    """The job's waiting run, made due and queued now (as a scan would)."""
    run = Run.objects.get(job=job, status=S.SCHEDULED, is_backfill=False)
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=timezone.now(), due_at=timezone.now())
    run.refresh_from_db()
    return run


def open_normal_runs(job: Job) -> list[Run]:
    return list(Run.objects.filter(job=job, status__in=Run.OPEN, is_backfill=False))


def during_the_call(target: GatedTarget, run: Run, action: Callable[[], object]) -> str:
    """Runs the worker's path for `run` on a thread of its own; once the target has the
    call, does `action` (its own connection, committed), then lets the target answer."""
    outcome: list[str] = []

    def worker() -> None:
        try:
            outcome.append(run_execute(run_id=run.pk, worker="w-gated"))
        finally:
            connection.close()

    target.gate.clear()
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert target.entered.wait(DEADLINE), "the call never reached the target"
        action()
    finally:
        target.gate.set()
        thread.join(DEADLINE)
    assert not thread.is_alive() and len(outcome) == 1
    return outcome[0]


def next_cron(expr: str, after: datetime) -> datetime:
    return schedule.next_cron_time(expr, "UTC", after)


# ----------------------------------------------------------------- defect 1


def test_after_a_schedule_edit_the_next_run_follows_the_new_schedule(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"), schedule="0 0 1 1 *")
    job_update(job=job, fields={"schedule": EVERY_5})  # the 1 January run is cancelled
    run = queue_now(job)
    assert run_execute(run_id=run.pk) == "succeeded"
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == run.scheduled_for + timedelta(minutes=5)  # not next 1 January


def test_a_cancelled_run_never_sets_where_the_schedule_goes_on(service: Any, target: GatedTarget) -> None:
    # Every 5 minutes -> yearly -> every 5 minutes: the first edit cancels the 5-minute
    # run, the second the yearly one and opens the 5-minute run's row again.
    job = create(service.user, target.url("/ok"))
    first = Run.objects.get(job=job)
    job_update(job=job, fields={"schedule": "0 0 1 1 *"})
    job_update(job=job, fields={"schedule": EVERY_5})
    run = queue_now(job)
    assert run.pk == first.pk
    assert run_execute(run_id=run.pk) == "succeeded"
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == next_cron(EVERY_5, run.scheduled_for)


# ----------------------------------------------------------------- defect 2


def test_a_next_run_time_taken_by_a_backfill_costs_only_that_job(service: Any, target: GatedTarget) -> None:
    clashing = create(service.user, target.url("/a"))
    other = create(service.user, target.url("/b"))
    first = queue_now(clashing)
    taken = first.scheduled_for + timedelta(minutes=5)
    [extra] = job_backfill(job=clashing, times=[taken])  # the time the next run would have
    second = queue_now(other)
    outcomes = run_execute_many(run_ids=[first.pk, second.pk], worker="w1")
    assert outcomes == {first.pk: "succeeded", second.pk: "succeeded"}
    assert Run.objects.get(pk=first.pk).status == S.SUCCEEDED
    assert Run.objects.get(pk=second.pk).status == S.SUCCEEDED
    # The extra run covers the taken time; the job's own timetable goes on after it.
    [nxt] = open_normal_runs(clashing)
    assert nxt.scheduled_for == taken + timedelta(minutes=5)
    assert Run.objects.get(pk=extra.pk).status == S.SCHEDULED
    first_done = entry(first, "succeeded")
    assert first_done.detail["next_run"] == nxt.public_id
    [other_next] = open_normal_runs(other)
    assert other_next.scheduled_for == second.scheduled_for + timedelta(minutes=5)


def test_a_dead_run_whose_next_time_has_a_run_still_ends_dead(service: Any, target: GatedTarget) -> None:
    target.script("/bad", [400])
    job = create(service.user, target.url("/bad"))
    run = queue_now(job)
    taken = run.scheduled_for + timedelta(minutes=5)
    job_backfill(job=job, times=[taken])
    assert run_execute(run_id=run.pk) == "dead"
    assert Run.objects.get(pk=run.pk).status == S.DEAD
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == taken + timedelta(minutes=5)


def test_a_run_out_of_tries_whose_next_time_has_a_run_still_ends_dead(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"), retry_max=0)
    run = queue_now(job)
    # Two claims whose leases were lost: the third claim finds no tries left.
    Run.objects.filter(pk=run.pk).update(attempt=1)
    taken = run.scheduled_for + timedelta(minutes=5)
    job_backfill(job=job, times=[taken])
    assert run_execute(run_id=run.pk) == "dead"
    done = Run.objects.get(pk=run.pk)
    assert done.status == S.DEAD and "out of tries" in done.last_error
    assert target.calls("/ok") == []
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == taken + timedelta(minutes=5)


def test_a_next_run_time_with_a_cancelled_run_opens_that_run_again(service: Any, target: GatedTarget) -> None:
    # A -> B while A's run is in flight; the next A time has a run cancelled by an earlier edit.
    job = create(service.user, target.url("/ok"))
    run = queue_now(job)
    later = run.scheduled_for + timedelta(minutes=5)
    cancelled = Run.objects.create(job=job, scheduled_for=later, due_at=later, partition=job.partition,
                                   status=S.CANCELLED, finished_at=timezone.now())
    assert run_execute(run_id=run.pk) == "succeeded"
    [nxt] = open_normal_runs(job)
    assert nxt.pk == cancelled.pk and nxt.scheduled_for == later and not nxt.held


# ----------------------------------------------------------------- defect 3


def test_a_job_paused_during_the_call_gets_its_next_run_held(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    run = queue_now(job)
    assert during_the_call(target, run, lambda: job_pause(job=job)) == "succeeded"
    [nxt] = open_normal_runs(job)
    assert nxt.held and nxt.status == S.SCHEDULED
    # Nothing of the job is queued while it is paused, however late the run is.
    far = nxt.due_at + timedelta(hours=2)
    assert nxt.pk not in scan_once(partitions=frozenset({job.partition}), now=far, publish=False).queued


def test_a_job_deleted_during_the_call_gets_no_next_run(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    run = queue_now(job)
    assert during_the_call(target, run, lambda: job_delete(job=job)) == "succeeded"
    assert open_normal_runs(job) == []
    assert Run.objects.filter(job=job).exclude(pk=run.pk).exclude(status=S.CANCELLED).count() == 0
    assert "next_run" not in entry(run, "succeeded").detail


def test_a_job_deleted_during_a_failing_call_gets_no_retry(service: Any, target: GatedTarget) -> None:
    target.script("/down", [503])
    job = create(service.user, target.url("/down"))
    run = queue_now(job)
    assert during_the_call(target, run, lambda: job_delete(job=job)) == "cancelled"
    done = Run.objects.get(pk=run.pk)
    assert done.status == S.CANCELLED and "HTTP 503" in done.last_error
    assert open_normal_runs(job) == []


def test_a_cron_job_made_one_off_during_the_call_gets_no_run_on_the_old_cron(
    service: Any, target: GatedTarget
) -> None:
    job = create(service.user, target.url("/ok"))
    run = queue_now(job)
    at = (timezone.now() + timedelta(hours=3)).replace(microsecond=0)
    assert during_the_call(target, run, lambda: job_update(job=job, fields={"run_at": at})) == "succeeded"
    job.refresh_from_db()
    assert job.state == Job.State.ACTIVE and not job.is_recurring
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == at  # the one-off's own run, not the old cron's next time


def test_a_schedule_edited_during_the_call_gives_the_next_run_on_the_new_schedule(
    service: Any, target: GatedTarget
) -> None:
    job = create(service.user, target.url("/ok"))
    run = queue_now(job)
    edit = lambda: job_update(job=job, fields={"schedule": "0 0 1 1 *"})  # noqa: E731
    assert during_the_call(target, run, edit) == "succeeded"
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == next_cron("0 0 1 1 *", run.scheduled_for)  # not five minutes on


def test_a_schedule_edited_during_the_call_goes_on_from_the_edit_not_from_the_run_in_flight(
    service: Any, target: GatedTarget
) -> None:
    job = create(service.user, target.url("/ok"), schedule="0 * * * *")
    run = queue_now(job)
    edited_at = run.scheduled_for + timedelta(minutes=7)
    edit = lambda: job_update(job=job, fields={"schedule": EVERY_5}, now=edited_at)  # noqa: E731
    assert during_the_call(target, run, edit) == "succeeded"
    [nxt] = open_normal_runs(job)
    # The new schedule starts at the edit: its :05 time came before the schedule existed.
    assert nxt.scheduled_for == run.scheduled_for + timedelta(minutes=10)


def test_a_one_off_made_cron_during_the_call_is_not_completed(service: Any, target: GatedTarget) -> None:
    at = (timezone.now() + timedelta(seconds=30)).replace(microsecond=0)
    job = create(service.user, target.url("/ok"), schedule="", run_at=at)
    run = queue_now(job)
    edit = lambda: job_update(job=job, fields={"schedule": EVERY_5})  # noqa: E731
    assert during_the_call(target, run, edit) == "succeeded"
    job.refresh_from_db()
    assert job.state == Job.State.ACTIVE and job.is_recurring
    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == next_cron(EVERY_5, at)


def test_a_retry_written_for_a_job_paused_during_the_call_is_held(service: Any, target: GatedTarget) -> None:
    target.script("/down", [503])
    job = create(service.user, target.url("/down"))
    run = queue_now(job)
    assert during_the_call(target, run, lambda: job_pause(job=job)) == "retry_scheduled"
    retry = Run.objects.get(pk=run.pk)
    assert retry.status == S.SCHEDULED and retry.held
    far = retry.due_at + timedelta(hours=2)
    assert scan_once(partitions=frozenset({job.partition}), now=far, publish=False).queued == []
    job_resume(job=job)
    assert not Run.objects.get(pk=run.pk).held


def test_a_retry_written_while_its_target_host_is_paused_is_held(service: Any, target: GatedTarget) -> None:
    target.script("/down", [503])
    job = create(service.user, target.url("/down"))
    run = queue_now(job)
    host = f"127.0.0.1:{target.port}"
    assert during_the_call(target, run, lambda: target_pause(host=host)) == "retry_scheduled"
    retry = Run.objects.get(pk=run.pk)
    assert retry.status == S.SCHEDULED and retry.held


# ----------------------------------------------------------------- defect 5


def extra_runs(job: Job) -> tuple[Run, Run]:
    """A backfill at a past time and a "run now": the job's two extra runs, queued as a scan would."""
    past = next_cron(EVERY_5, timezone.now() - timedelta(hours=1))
    [backfill] = job_backfill(job=job, times=[past])
    triggered = job_trigger(job=job)
    Run.objects.filter(pk=triggered.pk).update(status=S.QUEUED, queued_at=timezone.now())
    return backfill, triggered


def test_a_pause_holds_the_jobs_backfills_and_triggered_runs_too(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    backfill, triggered = extra_runs(job)
    job_pause(job=job)
    for run in Run.objects.filter(job=job):
        assert run.held and run.status == S.SCHEDULED, run
    # Neither the scan nor a message already on the queue starts one of them.
    late = timezone.now() + timedelta(days=1)
    assert scan_once(partitions=frozenset({job.partition}), now=late, publish=False).queued == []
    assert run_execute_many(run_ids=[backfill.pk, triggered.pk]) == {
        backfill.pk: "not_claimed", triggered.pk: "not_claimed"
    }
    assert target.calls() == []


def test_a_resume_releases_every_run_the_pause_held(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    extra_runs(job)
    job_pause(job=job)
    job_resume(job=job)
    waiting = Run.objects.filter(job=job, status=S.SCHEDULED)
    assert waiting.count() == 3 and not waiting.filter(held=True).exists()


def test_a_backfill_made_while_paused_is_held_and_released_on_resume(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    job_pause(job=job)
    past = next_cron(EVERY_5, timezone.now() - timedelta(hours=1))
    [backfill] = job_backfill(job=job, times=[past])
    assert Run.objects.get(pk=backfill.pk).held
    job_resume(job=job)
    assert not Run.objects.get(pk=backfill.pk).held
    queued = scan_once(partitions=frozenset({job.partition}), now=timezone.now(), publish=False).queued
    assert backfill.pk in queued


def test_a_delete_cancels_the_jobs_backfills_and_triggered_runs(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    extra_runs(job)
    job_delete(job=job)
    assert not Run.objects.filter(job=job, status__in=Run.OPEN).exists()
    assert Run.objects.filter(job=job, status=S.CANCELLED).count() == 3



def test_a_pause_committing_while_the_outcome_is_written_is_seen(service: Any, target: GatedTarget) -> None:
    # The pause's transaction is open when the call ends: the outcome's transaction
    # waits for the job's row (jobs_lock) and then sees the job paused. Without the
    # lock it would create an unheld next run that the pause, having already read
    # the job's waiting runs, never holds.
    job = create(service.user, target.url("/ok"))
    run = queue_now(job)
    in_pause, commit_pause = threading.Event(), threading.Event()

    def pauser() -> None:
        from django.db import transaction

        try:
            with transaction.atomic():
                job_pause(job=job)
                in_pause.set()
                commit_pause.wait(DEADLINE)
        finally:
            connection.close()

    outcome: list[str] = []

    def worker() -> None:
        try:
            outcome.append(run_execute(run_id=run.pk, worker="w-gated"))
        finally:
            connection.close()

    target.gate.clear()
    threads = [threading.Thread(target=worker), threading.Thread(target=pauser)]
    threads[0].start()
    try:
        assert target.entered.wait(DEADLINE)
        threads[1].start()
        assert in_pause.wait(DEADLINE)
        target.gate.set()
        # The worker either waits on a lock (the job's row) or, unfixed, finishes.
        deadline = time.monotonic() + DEADLINE
        while threads[0].is_alive() and not waiting_on_a_lock() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        target.gate.set()
        commit_pause.set()
        for thread in threads:
            thread.join(DEADLINE)
    assert outcome == ["succeeded"]
    [nxt] = open_normal_runs(job)
    assert nxt.held


def waiting_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(cursor.fetchone()[0])


# ------------------------------------------- a worker dies after a delete or a pause


def _claimed_by_a_worker_that_dies(job: Job) -> tuple[Run, Callable[[int], None]]:
    from runs import claims
    from tests.factories import expire_lease

    run = queue_now(job)
    [claim] = claims.claim_many(run_ids=[run.pk], worker="w-dies", lease=timedelta(seconds=60))
    assert claim.run_id == run.pk
    return run, expire_lease


def test_a_deleted_jobs_run_whose_worker_died_is_cancelled_not_started_again(service: Any, target: GatedTarget) -> None:
    job = create(service.user, target.url("/ok"))
    run, expire_lease = _claimed_by_a_worker_that_dies(job)
    job_delete(job=job)
    expire_lease(run.pk)

    result = scan_once(partitions=list(range(16)), publish=False)

    run.refresh_from_db()
    assert run.status == S.CANCELLED and run.pk not in result.lease_expired
    assert timeline_types(run)[-2:] == ["lease_expired", "cancelled"]
    assert Run.objects.filter(job=job, status__in=Run.OPEN).count() == 0


def test_a_paused_jobs_run_whose_worker_died_waits_held_and_the_resume_releases_it(
    service: Any, target: GatedTarget
) -> None:
    job = create(service.user, target.url("/ok"))
    run, expire_lease = _claimed_by_a_worker_that_dies(job)
    job_pause(job=job)
    expire_lease(run.pk)

    result = scan_once(partitions=list(range(16)), publish=False)

    run.refresh_from_db()
    assert (run.status, run.held) == (S.SCHEDULED, True) and run.pk not in result.lease_expired
    assert run_execute(run_id=run.pk) == "not_claimed"  # no new attempt while paused
    job_resume(job=job)
    run.refresh_from_db()
    assert (run.status, run.held) == (S.SCHEDULED, False)
    scan_once(partitions=list(range(16)), publish=False)
    assert run_execute(run_id=run.pk) == "succeeded"
    assert len(target.calls("/ok")) == 1


# ----------------------------------------------------------------- timetable kinds


def test_an_every_job_edited_during_the_call_gets_its_next_run_at_the_new_interval_from_starts_at(
    service: Any, target: GatedTarget
) -> None:
    start = timezone.now().replace(microsecond=0) - timedelta(hours=1)
    job = create(service.user, target.url("/ok"), schedule="", every_seconds=600, starts_at=start)
    run = queue_now(job)

    outcome = during_the_call(target, run, lambda: job_update(job=job, fields={"every_seconds": 420}))

    assert outcome == "succeeded"
    [nxt] = open_normal_runs(job)
    # The outcome reads the job again: 7-minute steps from starts_at, after the edit.
    assert (nxt.scheduled_for - start) % timedelta(minutes=7) == timedelta(0)
    assert nxt.scheduled_for > Job.objects.get(pk=job.pk).timing_changed_at


def test_a_cron_list_job_whose_next_time_is_taken_moves_on_to_the_next_time_of_the_union(
    service: Any, target: GatedTarget
) -> None:
    job = create(service.user, target.url("/ok"), schedule="", schedule_list=["*/5 * * * *", "*/7 * * * *"])
    first = queue_now(job)
    times = schedule.timetable_times(job.timetable(), first.scheduled_for)
    taken, after = next(times), next(times)
    job_backfill(job=job, times=[taken])  # an extra run at the time the next run would have

    assert run_execute(run_id=first.pk) == "succeeded"

    [nxt] = open_normal_runs(job)
    assert nxt.scheduled_for == after


@pytest.mark.embedded
@pytest.mark.django_db
def test_which_one_offs_had_their_run_is_one_read_by_jobs_and_times_not_an_or_per_job(service: Any) -> None:
    """An OR of a (job, time) pair a one-off was planned arm by arm over every partition
    of runs: 24 ms of planning for 200 one-offs, a tenth of a millisecond of every run
    when 100,000 one-offs came due at once (docs/performance.md, "The 09:00
    spike"). Now one read by the jobs and by the times, the pairs matched in Python, so a
    run of one job at another one-off's time does not count."""
    from django.db import connection as conn
    from django.test.utils import CaptureQueriesContext

    from runs.nextrun import _one_offs_done
    from tests.factories import make_job, make_run

    at = timezone.now().replace(microsecond=0) + timedelta(days=1)
    jobs = [make_job(service.user, name=f"once{i}", schedule="", run_at=at + timedelta(minutes=i % 2)) for i in range(6)]
    make_run(jobs[0], jobs[0].run_at, status=Run.Status.SUCCEEDED)
    make_run(jobs[1], jobs[1].run_at, status=Run.Status.SCHEDULED)
    make_run(jobs[2], jobs[2].run_at, status=Run.Status.CANCELLED)  # cancelled: not had its run
    make_run(jobs[3], jobs[2].run_at)  # at the other one-offs' time, not its own
    with CaptureQueriesContext(conn) as seen:
        done = _one_offs_done(jobs)
    assert done == {jobs[0].pk, jobs[1].pk}
    assert len(seen.captured_queries) == 1
    assert " OR " not in seen.captured_queries[0]["sql"], seen.captured_queries[0]["sql"]
