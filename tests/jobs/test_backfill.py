"""`backfill JOB_ID --since T --until T`: the runs a job would have had, once."""
from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
import time_machine
from django.core.management import CommandError, call_command

from jobs.services import job_create
from runs.models import Run
from tests.factories import created_long_ago, utc

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def backfill(*args: str) -> str:
    out = StringIO()
    call_command("backfill", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture
def hourly(service: Any) -> Any:
    job = job_create(
        owner=service.user,
        fields={"name": "hourly", "schedule": "0 * * * *", "target": "http://127.0.0.1:9/h"},
        now=utc("2026-10-28T12:30:00Z"),
    )
    return created_long_ago(job)


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_backfill_run_twice_over_the_same_range_creates_the_runs_once(hourly: Any) -> None:
    args = (hourly.public_id, "--since", "2026-10-28T06:00:00Z", "--until", "2026-10-28T10:00:00Z")
    assert "created 4 runs" in backfill(*args)
    assert "created 0 runs; 4 times already had a run" in backfill(*args)
    made = Run.objects.filter(job=hourly, is_backfill=True).order_by("scheduled_for")
    assert [f"{r.scheduled_for:%H:%M}" for r in made] == ["06:00", "07:00", "08:00", "09:00"]
    assert all(r.status == Run.Status.SCHEDULED and r.due_at == r.scheduled_for for r in made)


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_backfill_stops_at_now(hourly: Any) -> None:
    backfill(hourly.public_id, "--since", "2026-10-28T11:00:00Z", "--until", "2026-10-29T00:00:00Z")
    times = set(Run.objects.filter(job=hourly, is_backfill=True).values_list("scheduled_for", flat=True))
    assert times == {utc("2026-10-28T11:00:00Z"), utc("2026-10-28T12:00:00Z")}


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_a_dry_run_creates_nothing(hourly: Any) -> None:
    assert "would create 2 runs" in backfill(hourly.public_id, "--since", "2026-10-28T09:00:00Z", "--until", "2026-10-28T11:00:00Z", "--dry-run")
    assert not Run.objects.filter(job=hourly, is_backfill=True).exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("job_999999", "--since", "2026-10-01T00:00:00Z", "--until", "2026-10-02T00:00:00Z"), "no job"),
        (("{job}", "--since", "yesterday", "--until", "2026-10-02T00:00:00Z"), "--since"),
        (("{job}", "--since", "2026-10-02T00:00:00Z", "--until", "2026-10-01T00:00:00Z"), "after --since"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(hourly: Any, args: tuple[str, ...], message: str) -> None:
    filled = [a.replace("{job}", hourly.public_id) for a in args]
    with pytest.raises(CommandError, match=message):
        backfill(*filled)
    assert not Run.objects.filter(job=hourly, is_backfill=True).exists()


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_a_backfill_from_before_the_job_existed_is_refused_naming_when_it_was_created(service: Any) -> None:
    job = job_create(
        owner=service.user,
        fields={"name": "new", "schedule": "0 * * * *", "target": "http://127.0.0.1:9/h"},
        now=utc("2026-10-28T12:30:00Z"),
    )
    with pytest.raises(CommandError) as refused:
        backfill(job.public_id, "--since", "2026-10-28T10:30:00Z", "--until", "2026-10-28T12:30:00Z")
    assert str(refused.value) == (
        f"--since 2026-10-28T10:30:00Z is before {job.public_id} was created (2026-10-28T12:30:00Z); "
        "give --since 2026-10-28T12:30:00Z or later, or --before-created to fill the times before it too"
    )
    assert not Run.objects.filter(job=job, is_backfill=True).exists()


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_before_created_fills_the_times_before_the_job_existed_once(service: Any) -> None:
    """A migration's gap: the job was made at 12:30, the old scheduler stopped at 10:00."""
    job = job_create(
        owner=service.user,
        fields={"name": "moved", "schedule": "0 * * * *", "target": "http://127.0.0.1:9/h"},
        now=utc("2026-10-28T12:30:00Z"),
    )
    args = (job.public_id, "--since", "2026-10-28T10:00:00Z", "--until", "2026-10-28T12:30:00Z", "--before-created")
    assert "would create 3 runs from 2026-10-28T10:00:00Z to 2026-10-28T12:00:00Z" in backfill(*args, "--dry-run")
    assert not Run.objects.filter(job=job, is_backfill=True).exists()
    assert "created 3 runs" in backfill(*args)
    times = sorted(Run.objects.filter(job=job, is_backfill=True).values_list("scheduled_for", flat=True))
    assert times == [utc("2026-10-28T10:00:00Z"), utc("2026-10-28T11:00:00Z"), utc("2026-10-28T12:00:00Z")]
    assert "created 0 runs" in backfill(*args) and Run.objects.filter(job=job, is_backfill=True).count() == 3


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_a_time_with_an_offset_other_than_utc_is_refused_naming_the_utc_time(hourly: Any) -> None:
    with pytest.raises(CommandError) as refused:
        backfill(hourly.public_id, "--since", "2026-10-28T11:30:00+05:30", "--until", "2026-10-28T10:00:00Z")
    assert str(refused.value) == (
        "--since '2026-10-28T11:30:00+05:30' is not in UTC; give it as 2026-10-28T06:00:00Z (times here are UTC)"
    )
    assert not Run.objects.filter(job=hourly, is_backfill=True).exists()


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_a_utc_offset_written_as_plus_zero_is_accepted(hourly: Any) -> None:
    out = backfill(hourly.public_id, "--since", "2026-10-28T06:00:00+00:00", "--until", "2026-10-28T07:00:00Z")
    assert out.strip() == f"{hourly.public_id}: created 1 run from 2026-10-28T06:00:00Z to 2026-10-28T06:00:00Z; 0 times already had a run"


@time_machine.travel("2026-10-28T12:30:00Z", tick=False)
def test_one_time_that_already_had_a_run_is_counted_in_the_singular(hourly: Any) -> None:
    args = (hourly.public_id, "--since", "2026-10-28T06:00:00Z", "--until", "2026-10-28T07:00:00Z")
    backfill(*args)
    assert backfill(*args).strip() == f"{hourly.public_id}: created 0 runs; 1 time already had a run"
