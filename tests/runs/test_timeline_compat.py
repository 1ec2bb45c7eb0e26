"""The timeline a reader sees is the one the code before `runs.timeline` showed.

Each scenario below drives a run through the real scan, claim, call and outcome
code (a loopback target, the API to read), then reads the run's `events` from
`GET /api/runs/{id}/`, and the admin's live view of it. `timelines_before.json` holds what the same scenarios gave
on main before the happy path's entries moved onto the run row (commit 8735fa4,
when every entry was a `run_events` row): written by running this file there with
`TIMELINE_FIXTURE_WRITE=<path>` (it uses only calls both sides have). Times are
compared by their order (equal times stay equal), ids relative to the scenario's
first run and job, durations as present or not (and a retry's jittered due time):
everything else field by field. The live view's times are compared by their order
(milliseconds; equal times stay equal); the admin's run page shows the same entries.
"""
from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
from django.db import connection, transaction
from django.test import override_settings
from django.utils import timezone

from jobs.services import job_create
from runs import claims
from runs.models import Run
from runs.services import run_claim_many, run_execute
from scanners.scan import scan_once
from tests.factories import expire_lease, make_run
from tests.target import LoopbackTarget

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status
FIXTURE = Path(__file__).with_name("timelines_before.json")
ALL = list(range(64))


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def _job(owner: Any, url: str, **fields: Any) -> Any:
    values: dict[str, Any] = {"name": "t", "schedule": "*/5 * * * *", "target": url, "retry_base_seconds": 1,
                              "retry_max": 2}
    values.update(fields)
    return job_create(owner=owner, fields=values)


def _waiting(job: Any) -> Run:
    return Run.objects.get(job=job, status=S.SCHEDULED, is_backfill=False)


def _due_now(run: Run) -> None:
    """The run is due now (the scan's own clock queues it), its nominal time unchanged."""
    Run.objects.filter(pk=run.pk).update(due_at=claims.store_now() - timedelta(seconds=1))


def _scan() -> None:
    with override_settings(SCHEDULER_PARTITIONS=64):
        scan_once(partitions=ALL, publish=False)


def _queue(run: Run) -> None:
    _due_now(run)
    _scan()
    assert Run.objects.get(pk=run.pk).status == S.QUEUED


def happy_path(service: Any, target: LoopbackTarget) -> Run:
    job = _job(service.user, target.url("/ok"))
    run = _waiting(job)
    _queue(run)
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    return run


def retry_then_success(service: Any, target: LoopbackTarget) -> Run:
    target.script("/flaky", [500, 200])
    job = _job(service.user, target.url("/flaky"))
    run = _waiting(job)
    _queue(run)
    assert run_execute(run_id=run.pk, worker="w1") == "retry_scheduled"
    _queue(run)
    assert run_execute(run_id=run.pk, worker="w2") == "succeeded"
    return run


def dead_after_retries(service: Any, target: LoopbackTarget) -> Run:
    target.script("/down", [503, 503, 503])
    job = _job(service.user, target.url("/down"), retry_max=2)
    run = _waiting(job)
    for worker, expected in (("w1", "retry_scheduled"), ("w2", "retry_scheduled"), ("w3", "dead")):
        _queue(run)
        assert run_execute(run_id=run.pk, worker=worker) == expected
    return run


def stale_write(service: Any, target: LoopbackTarget) -> Run:
    target.delay("/slow", 2)
    job = _job(service.user, target.url("/slow"))
    run = _waiting(job)
    _queue(run)
    outcome: list[str] = []

    def first_holder() -> None:
        try:
            with override_settings(SCHEDULER_LEASE_SECONDS=1):
                outcome.append(run_execute(run_id=run.pk, worker="frozen"))
        finally:
            connection.close()

    thread = threading.Thread(target=first_holder)
    thread.start()
    deadline = time.monotonic() + 10
    while not target.calls("/slow"):
        assert time.monotonic() < deadline, "the first holder's call never arrived"
        time.sleep(0.02)
    with transaction.atomic():  # taken over directly, no scan between: the claim's own path
        expire_lease(run.pk)
        fresh = Run.objects.select_related("job").get(pk=run.pk)
        [taken] = run_claim_many(runs=[fresh], worker="rescuer", lease=timedelta(seconds=60))
    thread.join()
    assert outcome == ["stale_write_rejected"] and taken.fence == 2
    return run


def misfire(service: Any, target: LoopbackTarget) -> Run:
    job = _job(service.user, target.url("/ok"), schedule="* * * * *", misfire="run_once")
    # The job's run is one whose time passed ten minutes ago while nothing ran (a
    # run's time never changes, so it is that row: made as a test row, no event).
    _waiting(job).delete()
    past = (timezone.now() - timedelta(minutes=10)).replace(second=0, microsecond=0)
    run = make_run(job, past)
    _scan()
    assert Run.objects.get(pk=run.pk).status == S.QUEUED
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    return run


def lease_expiry_and_requeue(service: Any, target: LoopbackTarget) -> Run:
    job = _job(service.user, target.url("/ok"))
    run = _waiting(job)
    _queue(run)
    with transaction.atomic():
        fresh = Run.objects.select_related("job").get(pk=run.pk)
        [claim] = run_claim_many(runs=[fresh], worker="lost", lease=timedelta(seconds=60))
    expire_lease(run.pk)
    _scan()  # the lease ran out: back to queued
    assert Run.objects.get(pk=run.pk).status == S.QUEUED
    long_ago = claims.store_now() - timedelta(minutes=5)
    Run.objects.filter(pk=run.pk).update(queued_at=long_ago, due_at=long_ago)
    _scan()  # not claimed in time: published again
    assert run_execute(run_id=run.pk, worker="w2") == "succeeded"
    return run


def cancelled_by_delete(service: Any, target: LoopbackTarget) -> Run:
    job = _job(service.user, target.url("/ok"))
    run = _waiting(job)
    _queue(run)
    assert service.delete(f"/api/jobs/{job.public_id}/").status_code == 204
    return run


def held_and_released(service: Any, target: LoopbackTarget) -> Run:
    job = _job(service.user, target.url("/ok"))
    run = _waiting(job)
    _queue(run)
    assert service.patch(f"/api/jobs/{job.public_id}/", {"paused": True}).status_code == 200
    assert service.patch(f"/api/jobs/{job.public_id}/", {"paused": False}).status_code == 200
    _queue(run)
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    return run


SCENARIOS: dict[str, Callable[[Any, LoopbackTarget], Run]] = {
    f.__name__: f
    for f in (happy_path, retry_then_success, dead_after_retries, stale_write, misfire, lease_expiry_and_requeue,
              cancelled_by_delete, held_and_released)
}


def _iso(value: str) -> datetime | None:
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None


def _normal(value: Any, base: dict[str, Any]) -> Any:
    """A detail value with what differs between two runs of a scenario made relative."""
    if isinstance(value, dict):
        return {k: (VARIES[k] if k in VARIES else _normal(v, base)) for k, v in value.items()}
    if isinstance(value, str):
        for prefix in ("run", "job"):
            if value.startswith(f"{prefix}_") and value[4:].isdigit():
                return f"{prefix}+{int(value[4:]) - base[prefix]}"
        when = _iso(value) if len(value) >= 20 and value[4:5] == "-" else None
        if when is not None:
            delta = (when - base["scheduled_for"]).total_seconds()
            return f"scheduled_for{delta:+.0f}s" if delta == int(delta) and abs(delta) < 86400 else "<time>"
    return value


# Detail values that differ between two runs of a scenario by the clock or by chance.
VARIES = {"duration_ms": "<ms>", "late_by_s": "<s>"}


def normal_timeline(events: list[dict[str, Any]], base: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for e in events:
        detail = _normal(e["detail"], base)
        if e["type"] == "retry_scheduled":
            detail["due_at"] = "<time: now plus a jittered backoff>"
        found.append({"type": e["type"], "detail": detail})
    return found


def _read(service: Any, run: Run) -> list[dict[str, Any]]:
    answer = service.get(f"/api/runs/{run.public_id}/")
    assert answer.status_code == 200
    events = answer.json()["events"]
    assert [e["at"] for e in events] == sorted(e["at"] for e in events), "oldest first"
    return events


def _base(run: Run) -> dict[str, Any]:
    run.refresh_from_db()
    return {"run": run.pk, "job": run.job_id, "scheduled_for": run.scheduled_for}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_timeline_is_the_one_the_event_rows_gave(name: str, service: Any, target: LoopbackTarget,
                                                      admin_client: Any) -> None:
    run = SCENARIOS[name](service, target)
    events = _read(service, run)
    found = {"api": normal_timeline(events, _base(run)), "live": _live(admin_client, run)}
    out = os.environ.get("TIMELINE_FIXTURE_WRITE")
    if out:  # recording what this tree's code gives (run on the commit before the change)
        path = Path(out)
        recorded = json.loads(path.read_text()) if path.exists() else {}
        recorded[name] = found
        path.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
        return
    before = json.loads(FIXTURE.read_text())[name]
    assert found["api"] == before["api"]
    assert found["live"] == before["live"]
    assert [row["type"] for row in found["live"]] == [e["type"] for e in events]
    page = admin_client.get(f"/admin/runs/run/{run.pk}/change/")
    assert [row.type for row in page.context["timeline"].rows] == [e["type"] for e in events]


def _live(admin_client: Any, run: Run) -> list[dict[str, Any]]:
    """The admin's live view of the run (what live.js draws), with the call's time left out."""
    answer = admin_client.get(f"/admin/runs/run/{run.pk}/live/")
    assert answer.status_code == 200
    rows = answer.json()["events"]
    times = sorted({r["at"] for r in rows})
    return [
        {"at": times.index(r["at"]), "type": r["type"], "fence": r["fence"], "worker": r["worker"], "state": r["state"],
         "answer": re.sub(r" in \d+ ms$", " in N ms", r["answer"]), "detail_keys": sorted(
             part.split("=", 1)[0] for part in r["detail"].split(", ") if part)}
        for r in rows
    ]
