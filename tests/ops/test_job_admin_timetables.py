"""The job admin's timetable fields (every, starts_at, ends_at, a list of cron
expressions, exclude): checked like the API, written through the services."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import time_machine
from django.test import Client

from jobs.models import Job
from jobs.serializers import JobSerializer
from runs.models import Run
from tests.ops.test_job_admin import LIST, form_data

pytestmark = pytest.mark.django_db
S = Run.Status
FROZEN = "2026-12-23T10:00:00Z"


@pytest.fixture
def operator_client(operator: Any) -> Iterator[Client]:
    """Logged in under the frozen clock: a session made at the real time would have run
    out by the frozen one (the login page's redirect, not the form, would answer)."""
    with time_machine.travel(FROZEN, tick=False):
        client = Client()
        client.force_login(operator)
        yield client
ADD = {
    "name": "timetable",
    "timezone": "Europe/London",
    "window": "0s",
    "misfire": "run_once",
    "target": "http://receiver:8080/hook",
    "method": "POST",
    "headers": "{}",
    "payload": "null",
    "retry_max": "3",
    "retry_backoff": "exponential",
    "retry_base": "10s",
    "retry_cap": "1h",
    "timeout": "30s",
}


def test_the_add_page_makes_a_list_schedule_from_one_expression_a_line_with_excluded_dates(
    operator_client: Client, owner: Any
) -> None:
    data = {**ADD, "owner": owner.pk, "schedule": "0 9 * * 1-5\n0 12 * * 6", "exclude": "2026-12-25, 2027-01-01"}

    response = operator_client.post(f"{LIST}add/", data)

    assert response.status_code == 302, response.context["adminform"].form.errors
    job = Job.objects.get(name="timetable")
    assert job.schedule_list == ["0 9 * * 1-5", "0 12 * * 6"] and job.exclude == ["2026-12-25", "2027-01-01"]
    assert JobSerializer(job).data["schedule"] == ["0 9 * * 1-5", "0 12 * * 6"]
    assert Run.objects.get(job=job, status=S.SCHEDULED).scheduled_for.isoformat() == "2026-12-24T09:00:00+00:00"
    page = operator_client.get(f"{LIST}{job.pk}/change/").content.decode()
    assert "every weekday at 09:00 Europe/London and every Saturday at 12:00 Europe/London" in page
    assert "2026-12-26T12:00:00Z" in page and "2026-12-25T09:00:00Z" not in page  # the preview skips Christmas


def test_the_add_page_makes_an_every_job_from_starts_at(operator_client: Client, owner: Any) -> None:
    data = {**ADD, "owner": owner.pk, "every": "90m", "starts_at": "2026-12-24T00:00:00Z"}

    response = operator_client.post(f"{LIST}add/", data)

    assert response.status_code == 302, response.context["adminform"].form.errors
    job = Job.objects.get(name="timetable")
    assert job.every_seconds == 5400 and job.schedule == "" and job.run_at is None
    assert Run.objects.get(job=job, status=S.SCHEDULED).scheduled_for.isoformat() == "2026-12-24T00:00:00+00:00"


def test_a_bad_exclude_or_ends_at_on_the_add_page_is_a_form_error_in_the_apis_words(
    operator_client: Client, owner: Any
) -> None:
    data = {**ADD, "owner": owner.pk, "schedule": "0 9 * * *", "exclude": "2026-13-01"}
    bad_date = operator_client.post(f"{LIST}add/", data)
    data = {**ADD, "owner": owner.pk, "every": "1h", "starts_at": "2027-01-02T00:00:00Z",
            "ends_at": "2027-01-01T00:00:00Z"}
    bad_end = operator_client.post(f"{LIST}add/", data)

    assert bad_date.context["adminform"].form.errors["exclude"] == [
        "exclude[0]: '2026-13-01' is not a date of the calendar"
    ]
    assert "must be after starts_at" in bad_end.context["adminform"].form.errors["ends_at"][0]
    assert not Job.objects.filter(name="timetable").exists()


def test_editing_another_field_of_a_list_job_keeps_its_list(operator_client: Client, owner: Any) -> None:
    operator_client.post(f"{LIST}add/", {**ADD, "owner": owner.pk, "schedule": "0 9 * * 1-5\n0 12 * * 6"})
    job = Job.objects.get(name="timetable")

    response = operator_client.post(f"{LIST}{job.pk}/change/", form_data(operator_client, job, name="renamed"))

    assert response.status_code == 302, response.context["adminform"].form.errors
    job.refresh_from_db()
    assert job.name == "renamed" and job.schedule_list == ["0 9 * * 1-5", "0 12 * * 6"]
