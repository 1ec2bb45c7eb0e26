"""One scan: due runs become queued, misfires follow the job's policy, lost work is recovered."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.test import override_settings

from jobs.models import Job
from jobs.services import job_create, job_pause, job_resume
from runs import claims
from runs.models import Run
from scanners.scan import scan_once
from tests.factories import expire_lease, utc, timeline_types, entry

pytestmark = pytest.mark.django_db
S = Run.Status
ALL = frozenset(range(16))
T0 = utc("2026-10-28T20:29:30Z")


def per_minute(owner: Any, **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "m", "schedule": "* * * * *", "target": "http://127.0.0.1:9/h"}
    values.update(fields)
    return job_create(owner=owner, fields=values, now=T0)


def statuses(job: Job) -> list[tuple[str, str]]:
    return [(f"{r.scheduled_for:%H:%M}", r.status) for r in Run.objects.filter(job=job).order_by("scheduled_for")]


@pytest.mark.embedded
def test_a_due_run_is_queued_and_a_future_one_is_not(service: Any) -> None:
    job = per_minute(service.user)
    assert scan_once(partitions=ALL, now=T0 + timedelta(seconds=10), publish=False).queued == []
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31), publish=False)
    run = Run.objects.get(job=job)
    assert result.queued == [run.pk] and run.status == S.QUEUED
    assert timeline_types(run) == ["scheduled", "queued"]


def test_a_scanner_reads_only_its_own_partitions(service: Any) -> None:
    job = per_minute(service.user)
    mine = frozenset({job.partition})
    assert scan_once(partitions=ALL - mine, now=T0 + timedelta(minutes=1), publish=False).queued == []
    assert len(scan_once(partitions=mine, now=T0 + timedelta(minutes=1), publish=False).queued) == 1


def test_a_paused_job_is_skipped_and_runs_again_when_resumed(service: Any) -> None:
    job = per_minute(service.user)
    job_pause(job=job, now=T0)
    assert scan_once(partitions=ALL, now=T0 + timedelta(seconds=40), publish=False).queued == []
    job_resume(job=job, now=T0 + timedelta(seconds=45))
    assert len(scan_once(partitions=ALL, now=T0 + timedelta(seconds=50), publish=False).queued) == 1


def test_runs_spread_over_their_window_start_inside_it(service: Any) -> None:
    job = per_minute(service.user, window_seconds=300)
    run = Run.objects.get(job=job)
    assert run.scheduled_for <= run.due_at <= run.scheduled_for + timedelta(seconds=300)
    assert scan_once(partitions=ALL, now=run.due_at - timedelta(seconds=1), publish=False).queued == []
    assert scan_once(partitions=ALL, now=run.due_at, publish=False).queued == [run.pk]


@override_settings(SCHEDULER_MISFIRE_GRACE=60)
@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # The scanner was down over 20:30, 20:31, 20:32 and comes back at 20:32:30.
        # 20:32 is only 30 s old, inside the grace: it is not missed under any policy
        # (issue 12, defect 6). Under run_once it is the run after the late one.
        ("run_once", [("20:30", "queued"), ("20:31", "skipped"), ("20:32", None)]),
        ("skip", [("20:30", "skipped"), ("20:31", "skipped"), ("20:32", "scheduled")]),
        ("run_all", [("20:30", "queued")]),
    ],
)
def test_a_late_run_follows_its_jobs_misfire_policy(service: Any, policy: str, expected: list[Any]) -> None:
    job = per_minute(service.user, misfire=policy)
    back = utc("2026-10-28T20:32:30Z")
    scan_once(partitions=ALL, now=back, publish=False)
    got = statuses(job)
    assert got == [(t, s) for t, s in expected if s is not None]
    first = Run.objects.get(job=job, scheduled_for=utc("2026-10-28T20:30:00Z"))
    misfired = entry(first, "misfired")
    assert misfired.detail["policy"] == policy


def test_run_all_runs_each_missed_time_in_turn(service: Any) -> None:
    from runs.nextrun import run_next_create

    job = per_minute(service.user, misfire="run_all")
    back = utc("2026-10-28T20:32:30Z")
    order = []
    for _ in range(3):
        result = scan_once(partitions=ALL, now=back, publish=False)
        [run_id] = result.queued
        run = Run.objects.get(pk=run_id)
        order.append(f"{run.scheduled_for:%H:%M}")
        Run.objects.filter(pk=run_id).update(status=S.SUCCEEDED)  # as if a worker finished it
        run_next_create(job=job, now=back)
    assert order == ["20:30", "20:31", "20:32"]
    assert Run.objects.get(job=job, status=S.SCHEDULED).scheduled_for == utc("2026-10-28T20:33:00Z")


def test_a_late_retry_does_not_misfire(service: Any) -> None:
    job = per_minute(service.user, misfire="skip")
    Run.objects.filter(job=job).update(attempt=1)
    result = scan_once(partitions=ALL, now=utc("2026-10-28T21:30:00Z"), publish=False)
    assert len(result.queued) == 1 and result.misfired == 0


def test_a_skipped_one_off_completes_its_job(service: Any) -> None:
    job = job_create(
        owner=service.user,
        fields={"schedule": "", "run_at": utc("2026-10-28T20:30:00Z"), "target": "http://127.0.0.1:9/h", "misfire": "skip"},
        now=T0,
    )
    scan_once(partitions=ALL, now=utc("2026-10-28T21:00:00Z"), publish=False)
    job.refresh_from_db()
    assert job.state == Job.State.COMPLETED and statuses(job) == [("20:30", "skipped")]


def test_a_run_whose_lease_ran_out_is_queued_again(service: Any) -> None:
    job = per_minute(service.user)
    [run_id] = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31), publish=False).queued
    claim = claims.claim(run_id=run_id, worker="dies", lease=timedelta(seconds=60))
    assert claim is not None
    assert scan_once(partitions=ALL, now=T0 + timedelta(seconds=93), publish=False).lease_expired == []  # live
    expire_lease(run_id)  # by the store's clock, the one leases are kept in
    result = scan_once(partitions=ALL, now=T0 + timedelta(seconds=93), publish=False)
    assert result.lease_expired == [run_id]
    run = Run.objects.get(pk=run_id)
    assert run.status == S.QUEUED and "lease_expired" in timeline_types(run)


@override_settings(SCHEDULER_REQUEUE_AFTER=30)
def test_a_queued_run_nobody_claimed_is_published_again(service: Any) -> None:
    per_minute(service.user)
    [run_id] = scan_once(partitions=ALL, now=T0 + timedelta(seconds=31), publish=False).queued
    assert scan_once(partitions=ALL, now=T0 + timedelta(seconds=50), publish=False).republished == []
    assert scan_once(partitions=ALL, now=T0 + timedelta(seconds=62), publish=False).republished == [run_id]


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_MISFIRE_MAX_SKIPPED=5)
def test_a_long_outage_records_only_the_latest_missed_times_and_goes_on_from_now(service: Any) -> None:
    job = per_minute(service.user, misfire="skip")
    back = utc("2026-10-28T22:30:30Z")  # two hours down
    scan_once(partitions=ALL, now=back, publish=False)
    skipped = Run.objects.filter(job=job, status=S.SKIPPED).order_by("scheduled_for")
    # 20:31 to 22:29 are missed (119); 22:30, 30 s old, is inside its grace: the next run.
    assert [f"{r.scheduled_for:%H:%M}" for r in skipped] == ["20:30", "22:25", "22:26", "22:27", "22:28", "22:29"]
    assert Run.objects.get(job=job, status=S.SCHEDULED).scheduled_for == utc("2026-10-28T22:30:00Z")
    misfired = skipped[0].events.get(type="misfired")
    assert misfired.detail["other_missed_times"] == 119


def test_a_scanner_whose_clock_runs_ahead_queues_nothing_early(service: Any) -> None:
    # The scan's `now` is the store's clock: a fast machine neither queues a run
    # before its time nor finds it late (misfired).
    now = claims.store_now()
    fields = {"name": "soon", "run_at": (now + timedelta(seconds=60)).replace(microsecond=0),
              "target": "http://127.0.0.1:9/h"}
    job = job_create(owner=service.user, fields=fields, now=now)
    with time_machine.travel(now + timedelta(seconds=120), tick=True):
        result = scan_once(partitions=ALL, publish=False)
    assert (result.queued, result.misfired) == ([], 0)
    assert statuses(job) == [(f"{fields['run_at']:%H:%M}", S.SCHEDULED)]
