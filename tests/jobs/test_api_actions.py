"""`POST /api/jobs/{id}/run/` and `POST /api/runs/{id}/retry/`: the admin's
run-now and requeue, for services, over the same services."""
from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.conf import settings
from django.utils import timezone

from jobs.models import AuditEntry, Job
from jobs.services import job_create, job_delete, job_pause
from runs import claims
from runs.models import Run
from runs.ops import target_pause
from runs.services import run_execute
from scanners.scan import scan_once
from tests.conftest import Service
from tests.target import LoopbackTarget
from tests.factories import entries, entry as timeline_entry

S = Run.Status


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def new_job(service: Service, target_url: str = "http://127.0.0.1:9/hook", **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "report", "schedule": "0 2 * * *", "target": target_url, "retry_max": 0}
    values.update(fields)
    return job_create(owner=service.user, fields=values)


def run_now(service: Service, job: Job) -> Any:
    return service.post(f"/api/jobs/{job.public_id}/run/", None)


def retry(service: Service, run: Run | str) -> Any:
    run_id = run if isinstance(run, str) else run.public_id
    return service.post(f"/api/runs/{run_id}/retry/", None)


def run_of(body: dict[str, Any]) -> Run:
    return Run.objects.get(pk=int(body["id"].removeprefix("run_")))


def execute_due() -> dict[int, str]:
    """The worker path: one scan queues what is due (the run-now run is due at the
    next whole second, so scan a little ahead), then each queued run is executed."""
    queued = scan_once(
        partitions=range(settings.SCHEDULER_PARTITIONS), now=claims.store_now() + timedelta(seconds=2), publish=False
    ).queued
    assert queued, "the scan queued nothing"
    return {run_id: run_execute(run_id=run_id, worker="w1") for run_id in queued}


def dead_run(service: Service, target: LoopbackTarget) -> Run:
    """A run that called its target once, got a 400 and went dead (retry max 0)."""
    target.script("/dead", [400, 200])
    job = new_job(service, target.url("/dead"))
    run = run_of(run_now(service, job).json())
    assert execute_due() == {run.pk: "dead"}
    run.refresh_from_db()
    assert run.status == S.DEAD and run.attempt == 1
    return run


# --------------------------------------------------------------------------- run now


@pytest.mark.embedded
@pytest.mark.django_db(transaction=True)
def test_run_now_answers_201_and_the_target_gets_the_manual_runs_key_and_first_attempt(
    service: Service, target: LoopbackTarget
) -> None:
    job = new_job(service, target.url("/now"))
    waiting = Run.objects.get(job=job)

    response = run_now(service, job)

    assert response.status_code == 201, response.content
    body = response.json()
    run = run_of(body)
    assert body["job"] == job.public_id and body["status"] == "scheduled"
    assert body["idempotency_key"] == f"{job.public_id}@{body['scheduled_for']}"
    assert run.is_backfill and run.scheduled_for <= timezone.now() + timedelta(seconds=1)
    assert execute_due() == {run.pk: "succeeded"}
    (call,) = target.calls("/now")
    assert call.headers["Idempotency-Key"] == body["idempotency_key"]
    assert call.headers["X-Attempt"] == "1" and call.headers["X-Run-Id"] == run.public_id
    # Not the job's next run: that one waits where it was, untouched.
    waiting_now = Run.objects.get(pk=waiting.pk)
    assert (waiting_now.status, waiting_now.scheduled_for) == (S.SCHEDULED, waiting.scheduled_for)
    assert Run.objects.filter(job=job, status__in=Run.OPEN, is_backfill=False).count() == 1
    entry = AuditEntry.objects.get(action="triggered", object_id=job.public_id)
    assert (entry.via, entry.actor, entry.detail) == ("api", "reports", {"run": run.public_id})


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("make_refused", "words"),
    [
        ("deleted", "is deleted"),
        ("paused", "is paused; resume it first"),
        ("target_paused", "target host is paused"),
    ],
)
def test_run_now_of_a_job_the_service_refuses_is_a_409_with_the_reason_and_writes_nothing(
    service: Service, make_refused: str, words: str
) -> None:
    job = new_job(service, "http://reports.internal/rebuild")
    if make_refused == "deleted":
        job_delete(job=job)
    elif make_refused == "paused":
        job_pause(job=job)
    else:
        target_pause(host="reports.internal", actor="olga")
    runs_before = Run.objects.count()

    response = run_now(service, job)

    assert response.status_code == 409
    assert response.json() == {"detail": response.json()["detail"]}  # the shape of every 409: detail only
    assert job.public_id in response.json()["detail"] and words in response.json()["detail"]
    assert Run.objects.count() == runs_before
    assert not AuditEntry.objects.filter(action="triggered").exists()


@pytest.mark.embedded
@pytest.mark.django_db
def test_a_second_run_now_in_the_same_second_is_a_409_naming_the_run_that_has_that_second(service: Service) -> None:
    job = new_job(service)
    with time_machine.travel(timezone.now().replace(microsecond=400000), tick=False):
        first = run_now(service, job)
        second = run_now(service, job)

    assert first.status_code == 201
    assert second.status_code == 409
    detail = second.json()["detail"]
    assert "a manual run for this second exists" in detail and first.json()["id"] in detail
    assert Run.objects.filter(job=job, is_backfill=True).count() == 1


@pytest.mark.django_db
def test_a_second_run_now_is_refused_also_when_the_first_moved_past_the_jobs_own_run_that_second(
    service: Service,
) -> None:
    job = new_job(service, schedule="* * * * *")
    waiting_time = Run.objects.get(job=job).scheduled_for  # the job's own run, on a minute
    with time_machine.travel(waiting_time - timedelta(milliseconds=600), tick=False):
        first = run_now(service, job)
        second = run_now(service, job)
    assert first.status_code == 201
    assert first.json()["scheduled_for"] != waiting_time.strftime("%Y-%m-%dT%H:%M:%SZ")  # moved on a second
    assert second.status_code == 409 and first.json()["id"] in second.json()["detail"]


@pytest.mark.django_db
def test_run_now_the_next_second_makes_a_second_manual_run(service: Service) -> None:
    job = new_job(service)
    start = timezone.now().replace(microsecond=400000)
    with time_machine.travel(start, tick=False):
        first = run_now(service, job).json()
    with time_machine.travel(start + timedelta(seconds=1), tick=False):
        second = run_now(service, job)
    assert second.status_code == 201
    assert second.json()["idempotency_key"] != first["idempotency_key"]


@pytest.mark.django_db
def test_run_now_of_another_services_job_is_a_404_and_makes_no_run(service: Service, other_service: Service) -> None:
    job = new_job(other_service)
    runs_before = Run.objects.count()
    response = run_now(service, job)
    assert response.status_code == 404
    assert response.json() == {"detail": f"No job {job.public_id}."}
    assert Run.objects.count() == runs_before


# --------------------------------------------------------------------------- retry


@pytest.mark.embedded
@pytest.mark.django_db(transaction=True)
def test_retrying_a_dead_run_answers_200_and_the_target_gets_the_same_key_and_the_next_attempt(
    service: Service, target: LoopbackTarget
) -> None:
    dead = dead_run(service, target)

    response = retry(service, dead)

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["id"] == dead.public_id and body["status"] == "scheduled"
    assert body["idempotency_key"] == dead.idempotency_key
    assert execute_due() == {dead.pk: "succeeded"}
    first, second = target.calls("/dead")
    assert second.headers["Idempotency-Key"] == first.headers["Idempotency-Key"] == dead.idempotency_key
    assert (first.headers["X-Attempt"], second.headers["X-Attempt"]) == ("1", "2")
    assert int(second.headers["X-Fence-Token"]) > int(first.headers["X-Fence-Token"])
    dead.refresh_from_db()
    assert (dead.status, dead.attempt) == (S.SUCCEEDED, 2)
    requeued = timeline_entry(dead, "requeued")
    assert requeued.detail["by"] == "reports" and requeued.detail["previous_attempts"] == 1
    entry = AuditEntry.objects.get(action="requeued", object_id=dead.public_id)
    assert (entry.via, entry.actor) == ("api", "reports")


@pytest.mark.django_db(transaction=True)
def test_retrying_a_run_that_is_not_dead_or_whose_job_or_target_is_paused_is_a_409_with_the_reason(
    service: Service, target: LoopbackTarget
) -> None:
    dead = dead_run(service, target)
    job = Job.objects.get(pk=dead.job_id)
    waiting = Run.objects.get(job=job, status=S.SCHEDULED, is_backfill=False)

    refused = {}
    refused["not dead"] = retry(service, waiting)
    job_pause(job=job)
    refused["job paused"] = retry(service, dead)
    Job.objects.filter(pk=job.pk).update(paused=False, state=Job.State.ACTIVE)
    target_pause(host=f"127.0.0.1:{target.port}", actor="olga")
    refused["target paused"] = retry(service, dead)
    job_delete(job=job)
    refused["job deleted"] = retry(service, dead)

    details = {why: (r.status_code, r.json()) for why, r in refused.items()}
    assert details == {
        "not dead": (409, {"detail": f"{waiting.public_id} is scheduled, not dead"}),
        "job paused": (409, {"detail": f"{job.public_id} is paused; resume it first"}),
        "target paused": (409, {"detail": f"{job.public_id}'s target host is paused (resume_target)"}),
        "job deleted": (409, {"detail": f"{job.public_id} is deleted"}),
    }
    dead.refresh_from_db()
    assert dead.status == S.DEAD and not dead.events.filter(type="requeued").exists()
    assert not AuditEntry.objects.filter(action="requeued").exists()


@pytest.mark.django_db(transaction=True)
def test_retrying_twice_is_a_409_the_second_time(service: Service, target: LoopbackTarget) -> None:
    dead = dead_run(service, target)
    assert retry(service, dead).status_code == 200
    again = retry(service, dead)
    assert (again.status_code, again.json()) == (409, {"detail": f"{dead.public_id} is scheduled, not dead"})
    assert len(entries(dead, "requeued")) == 1


@pytest.mark.django_db
def test_retrying_another_services_run_or_no_run_is_a_404(service: Service, other_service: Service) -> None:
    theirs = Run.objects.get(job=new_job(other_service))
    Run.objects.filter(pk=theirs.pk).update(status=S.DEAD, finished_at=timezone.now())

    assert (retry(service, theirs).status_code, retry(service, theirs).json()) == (
        404, {"detail": f"No run {theirs.public_id}."}
    )
    assert retry(service, "run_999999").status_code == 404
    assert retry(service, "nonsense").status_code == 404
    theirs.refresh_from_db()
    assert theirs.status == S.DEAD


@pytest.mark.django_db
def test_staff_may_run_any_services_job_now(service: Service, staff_client: Any) -> None:
    job = new_job(service)
    response = staff_client.post(f"/api/jobs/{job.public_id}/run/")
    assert response.status_code == 201
    assert AuditEntry.objects.get(action="triggered").actor == "ops-person"


def test_the_schema_documents_run_now_and_retry_with_their_answers(tmp_path: Any) -> None:
    from django.core.management import call_command

    path = tmp_path / "schema.yml"
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(path))
    import yaml

    schema = yaml.safe_load(path.read_text())
    run_now_op = schema["paths"]["/api/jobs/{id}/run/"]["post"]
    retry_op = schema["paths"]["/api/runs/{id}/retry/"]["post"]
    assert {"201", "404", "409"} <= set(run_now_op["responses"])
    assert {"200", "404", "409"} <= set(retry_op["responses"])
    assert "requestBody" not in run_now_op and "requestBody" not in retry_op
