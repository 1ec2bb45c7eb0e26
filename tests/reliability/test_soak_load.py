"""The soak's set-based accounting (bench/soak_load.py, runs/invariants.py), on
hand-made rows: each SQL check finds what its row-by-row counterpart finds, and
a missed time, an unapplied success and a run applied under two fences are found."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection

from bench import soak_load
from bench.soak import recorded_applied_twice
from runs import invariants
from runs.invariants import Applied
from runs.models import Run, RunEvent
from tests.factories import make_job, make_run, utc

pytestmark = [pytest.mark.django_db]
T0 = utc("2026-11-30T10:00:00Z")


@pytest.fixture(autouse=True)
def postgresql_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("the soak's accounting is PostgreSQL's")


def event(run: Run, type_: str, at: datetime, **detail: Any) -> None:
    RunEvent.objects.create(run=run, type=type_, at=at, detail=detail)


def test_succeeded_runs_applied_in_sql_finds_what_the_row_by_row_check_finds() -> None:
    job = make_job()
    applied_run = make_run(job, T0, status=Run.Status.SUCCEEDED)
    unapplied = make_run(job, T0 + timedelta(minutes=1), status=Run.Status.SUCCEEDED)
    make_run(job, T0 + timedelta(minutes=2), status=Run.Status.DEAD)  # not succeeded: nothing owed
    applied = [Applied(applied_run.idempotency_key, 1)]
    found = invariants.succeeded_runs_applied(applied)
    assert found == invariants._succeeded_runs_applied_rows({a.key for a in applied}, None)
    assert found == [f"{unapplied.public_id} ({unapplied.idempotency_key}) succeeded but its target never applied it"]
    assert invariants.succeeded_runs_applied([*applied, Applied(unapplied.idempotency_key, 1)]) == []
    assert invariants.succeeded_runs_applied([], run_ids=[applied_run.pk]) == [
        f"{applied_run.public_id} ({applied_run.idempotency_key}) succeeded but its target never applied it"]


def test_the_load_accounting_counts_every_reference_time_and_finds_the_missed_one() -> None:
    a, b = make_job(name="load"), make_job(name="load")
    assert b.pk == a.pk + 1
    window = 59
    started = {"started_at": T0 + timedelta(seconds=5), "status": Run.Status.SUCCEEDED}
    for job in (a, b):
        make_run(job, T0, **started)
    make_run(a, T0 + timedelta(minutes=1), **started)
    never = make_run(b, T0 + timedelta(minutes=1), status=Run.Status.QUEUED)
    # Times whose window has closed by the cutoff: 10:00 and 10:01 (10:02's closes after it).
    cutoff = T0 + timedelta(minutes=2, seconds=window - 1)
    found = soak_load.accounting(lo=a.pk, hi=b.pk, first=T0, window_s=window, cutoff=cutoff)
    assert (found["due_times"], found["started"], found["missed"]) == (4, 3, 1)
    assert found["missed_runs"] == [f"job_{b.pk} at 10:01:00: run_{never.pk} never started (queued)"]
    # A time with no row at all is missed too.
    Run.objects.filter(pk=never.pk).delete()
    found = soak_load.accounting(lo=a.pk, hi=b.pk, first=T0, window_s=window, cutoff=cutoff)
    assert found["missed"] == 1 and found["missed_runs"] == [f"job_{b.pk} at 10:01:00: no run"]
    # A run its target's bulkhead put past the cutoff waits on purpose: not judged.
    waiting = make_run(b, T0 + timedelta(minutes=1), status=Run.Status.SCHEDULED,
                       due_at=cutoff + timedelta(seconds=30))
    event(waiting, "bulkhead_wait", T0 + timedelta(minutes=1, seconds=3))
    found = soak_load.accounting(lo=a.pk, hi=b.pk, first=T0, window_s=window, cutoff=cutoff)
    assert (found["due_times"], found["missed"], found["deferred_past_cutoff"]) == (3, 0, 1)


def test_recorded_applied_twice_in_sql_finds_what_the_timeline_check_finds() -> None:
    job = make_job()
    once, twice, superseded = (make_run(job, T0 + timedelta(minutes=i), status=Run.Status.SUCCEEDED)
                               for i in range(3))
    at = T0
    for run, steps in (
        (once, [("claimed", 1), ("lease_expired", None), ("claimed", 2), ("target_answered", 2), ("succeeded", 2)]),
        # The bug's picture: a success taken under fence 1 while fence 2 held the lease and got a 2xx.
        (twice, [("claimed", 1), ("claimed", 2), ("target_answered", 1), ("succeeded", 1), ("target_answered", 2)]),
        # A superseded holder's 2xx does not count: it is refused.
        (superseded, [("claimed", 1), ("lease_expired", None), ("claimed", 2), ("target_answered", 1),
                      ("stale_write_rejected", 1), ("target_answered", 2), ("succeeded", 2)]),
    ):
        for type_, fence in steps:
            at += timedelta(seconds=1)
            detail: dict[str, Any] = {} if fence is None else {"fence": fence}
            if type_ == "target_answered":
                detail["status"] = 200
            event(run, type_, at, **detail)
    timeline: dict[int, list[tuple[datetime, str, dict[str, Any]]]] = defaultdict(list)
    for run_id, at_, type_, detail in RunEvent.objects.order_by("id").values_list("run_id", "at", "type", "detail"):
        timeline[run_id].append((at_, type_, detail))
    assert [line.split(" recorded")[0] for line in recorded_applied_twice(timeline)] == [f"run_{twice.pk}"]
    assert soak_load.recorded_applied_twice() == [f"run_{twice.pk} recorded as applied under fences [1, 2]"]


def test_timelines_streamed_run_by_run_find_each_runs_violations() -> None:
    job = make_job()
    good, bad = make_run(job, T0, status=Run.Status.SUCCEEDED), make_run(job, T0 + timedelta(minutes=1),
                                                                         status=Run.Status.SUCCEEDED)
    # Interleaved ids: the stream must group by run, not by id.
    event(good, "claimed", T0, fence=1, attempt=1)
    event(bad, "claimed", T0, fence=1, attempt=1)
    event(bad, "claimed", T0 + timedelta(seconds=1), fence=2, attempt=2)
    event(good, "succeeded", T0 + timedelta(seconds=2), fence=1)
    event(bad, "succeeded", T0 + timedelta(seconds=2), fence=1)
    found = invariants.timelines()
    assert found and all(line.startswith(f"run_{bad.pk}: ") for line in found), found
    assert any("succeeded" in line and "fence 2 held the lease" in line for line in found), found
    assert invariants.timelines([good.pk]) == []
