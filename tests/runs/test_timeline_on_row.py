"""The happy path's timeline on the run row (runs.timeline): what is written, and
that every entry is shown once, in order, whatever mix of rows and row entries a
run has (runs from before migration 0012 keep their rows)."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.db import transaction
from django.utils import timezone

from jobs.services import job_create
from runs import claims, events, invariants
from runs.models import Run, RunEvent
from runs.services import run_claim_many, run_execute
from runs.timeline import timeline, timelines
from tests.factories import expire_lease
from tests.target import LoopbackTarget

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
HAPPY = ["scheduled", "queued", "claimed", "target_answered", "succeeded"]


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def _job(owner: Any, url: str) -> Any:
    return job_create(owner=owner, fields={"name": "t", "schedule": "*/5 * * * *", "target": url})


def _queued(job: Any) -> Run:
    run = Run.objects.get(job=job, status=S.SCHEDULED)
    now = claims.store_now()
    Run.objects.filter(pk=run.pk).update(due_at=now - timedelta(seconds=1))
    with transaction.atomic():
        claims.mark_queued(run_ids=[run.pk], now=now, on_row=True)
    return Run.objects.get(pk=run.pk)


def _types(run: Run) -> list[str]:
    return [e.type for e in timeline(Run.objects.get(pk=run.pk))]


@pytest.mark.embedded
def test_the_happy_path_writes_no_event_row_and_its_timeline_is_on_the_run_row(
    service: Any, target: LoopbackTarget
) -> None:
    job = _job(service.user, target.url("/ok"))
    run = _queued(job)
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    run.refresh_from_db()
    assert not RunEvent.objects.filter(run=run).exists()
    assert run.on_row == 31 and run.on_row_worker == "w1" and run.on_row_answer == 200
    found = timeline(run)
    assert [e.type for e in found] == HAPPY
    nxt = Run.objects.get(job=job, status=S.SCHEDULED)
    assert found[-1].detail == {"fence": 1, "next_run": nxt.public_id,
                                "next_scheduled_for": nxt.scheduled_for.strftime("%Y-%m-%dT%H:%M:%SZ")}
    assert found[2].detail == {"fence": 1, "worker": "w1", "attempt": 1}
    assert found[3].detail["status"] == 200 and found[3].at == found[4].at == run.finished_at
    # The next run's own `scheduled` entry is on its row too.
    assert nxt.on_row == 1 and not RunEvent.objects.filter(run=nxt).exists()
    assert [e.type for e in timeline(nxt)] == ["scheduled"]
    assert invariants.timelines([run.pk, nxt.pk]) == []


@pytest.mark.embedded
def test_a_run_s_first_event_row_turns_the_entries_on_its_row_into_rows_first(
    service: Any, target: LoopbackTarget
) -> None:
    job = _job(service.user, target.url("/ok"))
    run = _queued(job)
    before = timeline(run)
    events.record(run.pk, "held", timezone.now(), reason="a test's")
    run.refresh_from_db()
    assert run.on_row == 0
    rows = list(RunEvent.objects.filter(run=run).order_by("id"))
    assert [e.type for e in rows] == ["scheduled", "queued", "held"]
    assert [(e.type, e.at, e.detail) for e in rows[:2]] == [(e.type, e.at, e.detail) for e in before]
    assert _types(run) == ["scheduled", "queued", "held"]  # each once


def test_a_run_from_before_the_change_keeps_its_rows_and_shows_each_entry_once(
    service: Any, target: LoopbackTarget
) -> None:
    # Its scheduled and queued entries are rows (written by the code before migration
    # 0012, which left on_row at 0); its claim and outcome come after the change.
    job = _job(service.user, target.url("/ok"))
    run = Run.objects.get(job=job, status=S.SCHEDULED)
    Run.objects.filter(pk=run.pk).update(on_row=0, on_row_due_at=None)
    now = claims.store_now()
    RunEvent.objects.create(run=run, at=run.created_at, type="scheduled", detail={"due_at": "x"})
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=now, due_at=now - timedelta(seconds=1))
    RunEvent.objects.create(run=run, at=now, type="queued", detail={})
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    assert _types(run) == HAPPY
    assert RunEvent.objects.filter(run=run).count() == 2
    old = Run.objects.get(pk=run.pk)
    def said(found: list[RunEvent]) -> list[tuple[Any, ...]]:
        return [(e.type, e.at, e.detail) for e in found]

    assert said(timelines([old])[old.pk]) == said(timeline(old))


def test_a_lease_taken_over_by_a_direct_claim_keeps_the_first_claim(service: Any, target: LoopbackTarget) -> None:
    job = _job(service.user, target.url("/ok"))
    run = _queued(job)
    with transaction.atomic():
        run_claim_many(runs=[Run.objects.select_related("job").get(pk=run.pk)], worker="first",
                       lease=timedelta(seconds=60))
    expire_lease(run.pk)
    with transaction.atomic():
        [taken] = run_claim_many(runs=[Run.objects.select_related("job").get(pk=run.pk)], worker="second",
                                 lease=timedelta(seconds=60))
    assert taken.fence == 2
    claimed = [e for e in timeline(Run.objects.get(pk=run.pk)) if e.type == "claimed"]
    assert [(e.detail["worker"], e.detail["fence"], e.detail["attempt"]) for e in claimed] == [
        ("first", 1, 1), ("second", 2, 2)]
    assert invariants.timelines([run.pk]) == []

