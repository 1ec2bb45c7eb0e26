"""The run lifecycle in-process: claim, call a real loopback target, record the outcome."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.core import mail
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from jobs.models import Job
from jobs.services import job_create
from runs import claims
from runs.models import Notice, Run
from runs.notices import notices_send
from runs.services import run_execute
from runs.signals import run_dead
from tests.factories import expire_lease, make_job, make_run, timeline_types, entry
from tests.target import LoopbackTarget

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def create(owner: Any, target_url: str, **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "t", "schedule": "*/5 * * * *", "target": target_url, "retry_base_seconds": 1}
    values.update(fields)
    return job_create(owner=owner, fields=values)


def queue_now(job: Job) -> Run:
    run = Run.objects.get(job=job, status=S.SCHEDULED, is_backfill=False)
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=timezone.now(), due_at=timezone.now())
    run.refresh_from_db()
    return run


def types(run: Run) -> list[str]:
    return timeline_types(run)


@pytest.mark.embedded
def test_a_successful_call_records_the_outcome_and_creates_the_next_run(service: Any, target: LoopbackTarget) -> None:
    job = create(service.user, target.url("/ok"), payload={"report": "daily"}, headers={"X-Team": "reports"})
    run = queue_now(job)
    assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.attempt == 1 and run.fence == 1
    assert types(run) == ["scheduled", "claimed", "target_answered", "succeeded"]
    nxt = Run.objects.get(job=job, status=S.SCHEDULED)
    assert entry(run, "succeeded").detail["next_run"] == nxt.public_id
    assert nxt.scheduled_for == run.scheduled_for + timedelta(minutes=5)
    [call] = target.calls("/ok")
    assert call.headers["Idempotency-Key"] == f"{job.public_id}@{run.scheduled_for:%Y-%m-%dT%H:%M:%SZ}"
    assert call.headers["X-Fence-Token"] == "1" and call.headers["X-Attempt"] == "1"
    assert call.headers["X-Run-Id"] == run.public_id
    assert call.headers["X-Scheduled-For"] == f"{run.scheduled_for:%Y-%m-%dT%H:%M:%SZ}"
    assert call.headers["X-Team"] == "reports" and call.headers["Content-Type"] == "application/json"
    assert call.body == b'{"report":"daily"}'


def test_a_500_schedules_a_retry_as_a_row_with_a_later_due_at(service: Any, target: LoopbackTarget) -> None:
    target.script("/flaky", [500, 200])
    job = create(service.user, target.url("/flaky"))
    run = queue_now(job)
    before = timezone.now()
    assert run_execute(run_id=run.pk) == "retry_scheduled"
    run.refresh_from_db()
    assert run.status == S.SCHEDULED and run.attempt == 1 and run.due_at > before
    assert run.last_error.startswith("HTTP 500")
    assert types(run)[-1] == "retry_scheduled"


def test_retry_after_is_honoured_up_to_the_cap(service: Any, target: LoopbackTarget) -> None:
    target.script("/busy", [429], headers={"Retry-After": "120"})
    job = create(service.user, target.url("/busy"), retry_cap_seconds=3600)
    run = queue_now(job)
    assert run_execute(run_id=run.pk) == "retry_scheduled"
    run.refresh_from_db()
    assert run.due_at >= timezone.now() + timedelta(seconds=115)


def test_a_400_sends_the_run_to_the_dead_list_at_once_and_tells_the_owner(service: Any, target: LoopbackTarget) -> None:
    target.script("/bad", [400])
    told: list[str] = []

    def listener(sender: Any, run: Run, reason: str, **kwargs: Any) -> None:
        told.append(reason)

    run_dead.connect(listener)
    try:
        job = create(service.user, target.url("/bad"))
        run = queue_now(job)
        assert run_execute(run_id=run.pk) == "dead"
    finally:
        run_dead.disconnect(listener)
    run.refresh_from_db()
    assert run.status == S.DEAD and "HTTP 400" in run.last_error
    assert told and "HTTP 400" in told[0]
    # The worker only wrote the notice to the outbox; the sender e-mails it.
    assert mail.outbox == [] and Notice.objects.get(run=run).status == Notice.Status.PENDING
    with override_settings(SCHEDULER_EMAIL_ENABLED=True):
        notices_send()
    assert len(mail.outbox) == 1 and mail.outbox[0].to == ["reports@example.test"]
    dead = entry(run, "dead")
    assert dead.detail["notified"] == "reports@example.test"
    assert Run.objects.filter(job=job, status=S.SCHEDULED).count() == 1  # the schedule goes on


def test_a_run_out_of_tries_is_dead(service: Any, target: LoopbackTarget) -> None:
    target.script("/down", [503])
    job = create(service.user, target.url("/down"), retry_max=1)
    run = queue_now(job)
    assert run_execute(run_id=run.pk) == "retry_scheduled"
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED)
    assert run_execute(run_id=run.pk) == "dead"
    run.refresh_from_db()
    assert run.attempt == 2 and run.status == S.DEAD and "out of tries" in run.last_error


def test_a_refused_connection_is_retried(service: Any) -> None:
    job = create(service.user, "http://127.0.0.1:9/nothing-listens")
    run = queue_now(job)
    assert run_execute(run_id=run.pk) == "retry_scheduled"
    run.refresh_from_db()
    assert run.last_error == "connection refused"  # the fixed words: no library text, address or port


def test_a_timeout_is_retried(service: Any, target: LoopbackTarget) -> None:
    target.delay("/slow", 3)
    job = create(service.user, target.url("/slow"), timeout_seconds=1)
    run = queue_now(job)
    assert run_execute(run_id=run.pk) == "retry_scheduled"
    run.refresh_from_db()
    assert run.last_error == "timed out after 1s"


def test_a_one_off_job_is_completed_after_its_run(service: Any, target: LoopbackTarget) -> None:
    job = create(service.user, target.url("/ok"), schedule="", run_at=timezone.now().replace(microsecond=0))
    run = queue_now(job)
    assert run_execute(run_id=run.pk) == "succeeded"
    job.refresh_from_db()
    assert job.state == Job.State.COMPLETED
    assert not Run.objects.filter(job=job, status__in=Run.OPEN).exists()


def test_a_stale_holder_cannot_record_its_outcome(service: Any, target: LoopbackTarget) -> None:
    # The first holder's lease runs out while its call is in flight; another takes the run over.
    target.delay("/slow", 2)
    job = create(service.user, target.url("/slow"))
    run = queue_now(job)
    from django.test import override_settings

    import threading

    outcome: list[str] = []

    def first_holder() -> None:
        from django.db import connection

        try:
            with override_settings(SCHEDULER_LEASE_SECONDS=1):
                outcome.append(run_execute(run_id=run.pk, worker="frozen"))
        finally:
            connection.close()

    thread = threading.Thread(target=first_holder)
    thread.start()
    # Take the run over once the first lease has run out: the lease is made to run out by
    # the store's clock (as when the holder froze) and claimed in one transaction, so that
    # no heartbeat of the first holder lands between the two. A claimer whose clock merely
    # runs ahead cannot take a live lease (tests/runs/test_claims.py).
    import time

    deadline = time.monotonic() + 10
    while not target.calls("/slow"):  # the first holder has claimed the run and is in its call
        assert time.monotonic() < deadline, "the first holder's call never arrived"
        time.sleep(0.02)
    with transaction.atomic():
        expire_lease(run.pk)
        taken = claims.claim(run_id=run.pk, worker="rescuer", lease=timedelta(seconds=60))
    thread.join()
    assert taken is not None and taken.fence == 2
    assert outcome == ["stale_write_rejected"]
    rejected = entry(run, "stale_write_rejected")
    assert rejected.detail == {"fence": 1, "worker": "frozen"}
    run.refresh_from_db()
    assert run.status == S.RUNNING and run.fence == 2


def test_a_metadata_address_is_refused_at_call_time(service: Any) -> None:
    # Written past the API's checks, as if the row had been edited by hand.
    job = make_job(service.user, target="http://169.254.169.254/latest/meta-data")
    run = make_run(job, timezone.now().replace(microsecond=0), status=S.QUEUED, queued_at=timezone.now())
    assert run_execute(run_id=run.pk) == "dead"
    run.refresh_from_db()
    assert "link-local or metadata" in run.last_error
