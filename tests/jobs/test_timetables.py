"""The timetable kinds through the API and the run rows: every, starts_at/ends_at,
a list of cron expressions, exclude (CONTRACT "Job body")."""
from __future__ import annotations

from typing import Any

import pytest
import time_machine
from django.test import override_settings

from jobs.models import Job
from runs.models import Run
from tests.conftest import Service
from tests.factories import utc
from tests.jobs.conftest import error_messages, row_counts

JOBS = "/api/jobs/"
FROZEN = "2026-10-28T10:00:00Z"
TARGET = "https://reports.internal/rebuild"


def body(**fields: Any) -> dict[str, Any]:
    return {"name": "timetable", "target": TARGET, **fields}


def create(service: Service, data: dict[str, Any]) -> dict[str, Any]:
    response = service.post(JOBS, data)
    assert response.status_code == 201, response.content
    return response.json()


def refused(service: Service, data: dict[str, Any]) -> dict[str, Any]:
    before = row_counts()
    response = service.post(JOBS, data)
    assert response.status_code == 400, response.content
    assert row_counts() == before  # nothing written on a 400
    return response.json()


def job_of(data: dict[str, Any]) -> Job:
    return Job.objects.get(pk=int(data["id"].removeprefix("job_")))


# --------------------------------------------------------------------------- every


@pytest.mark.embedded
@time_machine.travel(FROZEN, tick=False)
def test_an_every_job_runs_first_one_interval_after_its_creation(service: Service) -> None:
    data = create(service, body(every="90m"))

    assert data["every"] == "90m" and data["schedule"] is None and data["at"] is None
    assert data["starts_at"] is None and data["ends_at"] is None and data["exclude"] == []
    assert data["next_run"]["scheduled_for"] == "2026-10-28T11:30:00Z"
    assert job_of(data).every_seconds == 5400


@pytest.mark.embedded
@time_machine.travel(FROZEN, tick=False)
def test_an_every_job_with_starts_at_runs_at_starts_at_then_each_interval(service: Service) -> None:
    data = create(service, body(every="90m", starts_at="2026-10-29T00:00:00Z"))

    assert data["starts_at"] == "2026-10-29T00:00:00Z"
    assert data["next_run"]["scheduled_for"] == "2026-10-29T00:00:00Z"


@time_machine.travel(FROZEN, tick=False)
def test_an_every_job_whose_starts_at_has_passed_runs_at_its_next_interval_from_starts_at(service: Service) -> None:
    data = create(service, body(every="7m", starts_at="2026-10-28T09:00:00Z"))

    # 09:00 + 9 * 7m = 10:03, the first after 10:00.
    assert data["next_run"]["scheduled_for"] == "2026-10-28T10:03:00Z"


@pytest.mark.embedded
@pytest.mark.parametrize("every", ["0s", "367d", "90", "1w", 90])
@override_settings(SCHEDULER_MIN_INTERVAL="1s")
def test_an_every_outside_1s_to_366d_or_not_a_duration_is_a_400_naming_every(service: Service, every: Any) -> None:
    errors = refused(service, body(every=every))

    assert list(errors) == ["every"]


@override_settings(SCHEDULER_MIN_INTERVAL="1s")
@time_machine.travel(FROZEN, tick=False)
def test_every_takes_1s_and_366d_at_the_ends_of_its_range(service: Service) -> None:
    assert create(service, body(every="1s"))["next_run"]["scheduled_for"] == "2026-10-28T10:00:01Z"
    assert create(service, body(every="366d"))["next_run"]["scheduled_for"] == "2027-10-29T10:00:00Z"


@override_settings(SCHEDULER_MIN_INTERVAL="5m")
def test_an_every_shorter_than_scheduler_min_interval_is_a_400_naming_it(service: Service) -> None:
    errors = refused(service, body(every="4m"))

    assert list(errors) == ["every"]
    assert "SCHEDULER_MIN_INTERVAL" in errors["every"][0] and "5m" in errors["every"][0]


@pytest.mark.embedded
@pytest.mark.parametrize(
    "timing",
    [
        {"every": "5m", "schedule": "0 * * * *"},
        {"every": "5m", "at": "2026-11-01T00:00:00Z"},
        {"every": "5m", "delay": "10m"},
        {"schedule": "0 * * * *", "delay": "10m"},
    ],
)
def test_two_timings_at_once_are_a_400_naming_both(service: Service, timing: dict[str, str]) -> None:
    errors = refused(service, body(**timing))

    assert set(errors) == set(timing)
    assert all("only one of schedule, every, at or delay" in m for m in error_messages(errors))


def test_no_timing_is_a_400_naming_the_four_kinds(service: Service) -> None:
    errors = refused(service, body())

    assert set(errors) == {"schedule", "every", "at", "delay"}


@time_machine.travel(FROZEN, tick=False)
def test_changing_every_replaces_the_waiting_run_from_the_edit(service: Service) -> None:
    data = create(service, body(every="1h", starts_at="2026-10-28T09:30:00Z"))
    first = Run.objects.get(job=job_of(data))
    assert first.scheduled_for == utc("2026-10-28T10:30:00Z")

    changed = service.patch(f"{JOBS}{data['id']}/", {"every": "20m"}).json()

    # Still counted from starts_at: 09:30 + 2 * 20m = 10:10.
    assert changed["every"] == "20m" and changed["next_run"]["scheduled_for"] == "2026-10-28T10:10:00Z"
    first.refresh_from_db()
    assert first.status == Run.Status.CANCELLED
    assert job_of(data).timing_changed_at == utc(FROZEN)


@time_machine.travel(FROZEN, tick=False)
def test_a_patch_from_every_to_a_schedule_clears_every(service: Service) -> None:
    data = create(service, body(every="1h"))

    changed = service.patch(f"{JOBS}{data['id']}/", {"schedule": "0 12 * * *"}).json()

    assert changed["every"] is None and changed["schedule"] == "0 12 * * *"
    assert changed["next_run"]["scheduled_for"] == "2026-10-28T12:00:00Z"
    assert job_of(data).every_seconds is None


# --------------------------------------------------------------------------- starts_at / ends_at


@pytest.mark.embedded
@time_machine.travel(FROZEN, tick=False)
def test_a_cron_job_has_no_run_before_starts_at(service: Service) -> None:
    data = create(service, body(schedule="0 * * * *", starts_at="2026-11-02T08:30:00Z"))

    assert data["next_run"]["scheduled_for"] == "2026-11-02T09:00:00Z"


@time_machine.travel(FROZEN, tick=False)
def test_starts_at_without_an_offset_is_a_wall_clock_time_in_the_jobs_zone(service: Service) -> None:
    data = create(service, body(schedule="0 * * * *", timezone="Asia/Kolkata", starts_at="2026-11-02T09:00:00"))

    assert data["starts_at"] == "2026-11-02T03:30:00Z"
    assert data["next_run"]["scheduled_for"] == "2026-11-02T03:30:00Z"  # 09:00 IST itself


@pytest.mark.embedded
@time_machine.travel(FROZEN, tick=False)
def test_a_job_whose_ends_at_has_passed_is_completed_with_no_next_run(service: Service) -> None:
    data = create(service, body(schedule="0 * * * *", starts_at="2026-10-01T00:00:00Z", ends_at="2026-10-28T09:59:00Z"))

    assert data["state"] == "completed" and data["next_run"] is None
    assert not Run.objects.filter(job=job_of(data)).exists()


@pytest.mark.embedded
@pytest.mark.parametrize("field", ["starts_at", "ends_at", "exclude"])
def test_starts_at_ends_at_and_exclude_on_a_one_off_are_a_400_naming_the_field(service: Service, field: str) -> None:
    value = ["2026-12-25"] if field == "exclude" else "2026-12-01T00:00:00Z"
    errors = refused(service, body(at="2026-11-01T00:00:00Z", **{field: value}))

    assert list(errors) == [field] and "recurring" in errors[field][0]


@pytest.mark.parametrize("ends_at", ["2026-11-01T00:00:00Z", "2026-10-31T00:00:00Z"])
def test_ends_at_not_after_starts_at_is_a_400_naming_ends_at(service: Service, ends_at: str) -> None:
    errors = refused(service, body(every="1h", starts_at="2026-11-01T00:00:00Z", ends_at=ends_at))

    assert list(errors) == ["ends_at"] and "after starts_at" in errors["ends_at"][0]


def test_a_bad_starts_at_is_a_400_naming_it(service: Service) -> None:
    errors = refused(service, body(every="1h", starts_at="next tuesday"))

    assert list(errors) == ["starts_at"]
