"""Limits: the throttle's 429 says when to come back, oversized input is refused in
words, a service's jobs are capped, a backfill cannot flood the run table, and a
schedule may be kept from firing more often than SCHEDULER_MIN_INTERVAL."""
from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.test import override_settings
from django.utils import timezone
from rest_framework.throttling import UserRateThrottle

from jobs.models import Job
from runs.models import Run, RunEvent
from tests.conftest import Service
from tests.factories import created_long_ago, make_job

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
JOB = {"schedule": "0 2 * * *", "target": "https://reports.test/hook"}


def counts() -> tuple[int, int, int]:
    return Job.objects.count(), Run.objects.count(), RunEvent.objects.count()


def test_over_the_throttle_is_a_429_with_retry_after_in_seconds(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {"user": "3/min"})

    answers = [service.get("/api/jobs/") for _ in range(4)]

    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert 0 < int(answers[-1]["Retry-After"]) <= 60
    assert "throttled" in answers[-1].json()["detail"].lower()


def test_the_throttle_counts_per_token(
    service: Service, other_service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {"user": "1/min"})

    assert service.get("/api/jobs/").status_code == 200
    assert service.get("/api/jobs/").status_code == 429
    assert other_service.get("/api/jobs/").status_code == 200


def test_a_body_over_1_mib_is_a_413_before_anything_reads_it(service: Service) -> None:
    body = json.dumps({**JOB, "name": "x" * (1024 * 1024)})

    response = service.client.post("/api/jobs/", body, content_type="application/json")

    assert response.status_code == 413 and "limit" in response.json()["detail"]
    assert counts() == (0, 0, 0)


def test_a_payload_over_256_kib_is_a_400_naming_payload(service: Service) -> None:
    response = service.post("/api/jobs/", {**JOB, "payload": {"blob": "x" * (256 * 1024)}})

    assert response.status_code == 400 and "256 KiB" in response.json()["payload"][0]
    assert counts() == (0, 0, 0)


def test_headers_over_16_kib_are_a_400_naming_headers(service: Service) -> None:
    headers = {f"X-Big-{n}": "y" * 1000 for n in range(20)}

    response = service.post("/api/jobs/", {**JOB, "headers": headers})

    assert response.status_code == 400 and "16 KiB" in response.json()["headers"][0]
    assert counts() == (0, 0, 0)


@override_settings(SCHEDULER_MAX_JOBS_PER_SERVICE=2)
def test_a_service_over_its_job_cap_gets_a_400_saying_so_and_deleted_jobs_do_not_count(service: Service) -> None:
    first = service.post("/api/jobs/", JOB).json()
    service.post("/api/jobs/", JOB)
    before = counts()

    refused = service.post("/api/jobs/", JOB)

    assert refused.status_code == 400
    assert "already has 2 jobs" in refused.json()["detail"]
    assert "SCHEDULER_MAX_JOBS_PER_SERVICE=2" in refused.json()["detail"]
    assert counts() == before
    assert service.delete(f"/api/jobs/{first['id']}/").status_code == 204
    assert service.post("/api/jobs/", JOB).status_code == 201


@override_settings(SCHEDULER_MAX_JOBS_PER_SERVICE=1)
def test_the_job_cap_is_per_service(service: Service, other_service: Service) -> None:
    assert service.post("/api/jobs/", JOB).status_code == 201
    assert other_service.post("/api/jobs/", JOB).status_code == 201


@override_settings(SCHEDULER_BACKFILL_MAX_RUNS=5)
def test_a_backfill_over_the_cap_refuses_with_a_message_and_creates_nothing() -> None:
    job = created_long_ago(make_job(schedule="* * * * *"))
    before = counts()
    until = timezone.now().replace(second=0, microsecond=0)
    since = until - timedelta(hours=1)

    with pytest.raises(CommandError, match="more than 5 runs.*SCHEDULER_BACKFILL_MAX_RUNS"):
        call_command("backfill", job.public_id, "--since", since.isoformat(), "--until", until.isoformat())

    assert counts() == before


@override_settings(SCHEDULER_BACKFILL_MAX_RUNS=60)
def test_a_backfill_at_the_cap_is_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    job = created_long_ago(make_job(schedule="* * * * *"))
    until = timezone.now().replace(second=0, microsecond=0)

    call_command("backfill", job.public_id, "--since", (until - timedelta(hours=1)).isoformat(),
                 "--until", until.isoformat())

    assert Run.objects.filter(job=job, is_backfill=True).count() == 60


@override_settings(SCHEDULER_MIN_INTERVAL="5m")
@pytest.mark.parametrize(("schedule", "gap"), [("* * * * *", "1m"), ("*/2 * * * *", "2m"), ("0,3 * * * *", "3m"),
                                               ("*/7 * * * *", "4m")])
def test_a_schedule_firing_more_often_than_the_floor_is_a_400_naming_schedule(
    service: Service, schedule: str, gap: str
) -> None:
    response = service.post("/api/jobs/", {**JOB, "schedule": schedule})

    assert response.status_code == 400
    [message] = response.json()["schedule"]
    assert f"only {gap} apart" in message and "at least 5m" in message and "SCHEDULER_MIN_INTERVAL" in message
    assert counts() == (0, 0, 0)


@override_settings(SCHEDULER_MIN_INTERVAL="5m")
@pytest.mark.parametrize("schedule", ["*/5 * * * *", "0 2 * * *", "0,30 * * * *", "0 0 29 2 *"])
def test_a_schedule_at_or_above_the_floor_is_accepted(service: Service, schedule: str) -> None:
    assert service.post("/api/jobs/", {**JOB, "schedule": schedule}).status_code == 201


@override_settings(SCHEDULER_MIN_INTERVAL="5m")
def test_the_floor_applies_to_a_changed_schedule_too(service: Service) -> None:
    job = service.post("/api/jobs/", JOB).json()

    response = service.patch(f"/api/jobs/{job['id']}/", {"schedule": "* * * * *"})

    assert response.status_code == 400 and "schedule" in response.json()


def test_by_default_every_5_field_cron_is_allowed(service: Service, settings: Any) -> None:
    assert settings.SCHEDULER_MIN_INTERVAL == "1m"
    assert service.post("/api/jobs/", {**JOB, "schedule": "* * * * *"}).status_code == 201
