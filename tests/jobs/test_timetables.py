"""The timetable kinds through the API and the run rows: every, starts_at/ends_at,
a list of cron expressions, exclude (docs/reference.md, the API fields)."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any
from unittest import mock

import pytest
import time_machine
from django.conf import settings
from django.test import override_settings
from django.utils import timezone

from jobs.models import Job
from runs import claims
from runs.delivery import iso_z
from runs.models import Run
from runs.services import run_execute_many
from scanners.scan import scan_once
from tests.conftest import Service
from tests.factories import utc, timeline_types, entry
from tests.jobs.conftest import error_messages, row_counts
from tests.target import LoopbackTarget

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


# --------------------------------------------------------------------------- through the run path


@pytest.fixture
def loopback() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


@contextmanager
def frozen_store_clock(start: str) -> Iterator[Any]:
    """The clock frozen at `start`, the store's clock (leases, due times) with it: the
    one seam for a test that mocks time (runs.claims._clock_in_the_database)."""
    with time_machine.travel(start, tick=False) as traveller:
        with mock.patch.object(claims, "_clock_in_the_database", lambda: False):
            yield traveller


def drive(job: Job, traveller: Any, until: datetime, limit: int = 200) -> None:
    """The job's runs, one after another, through the real path: the clock moves to the
    next run's due time, a scan queues it, a worker claims, calls and records it (and
    the outcome makes the next run). Bounded by `limit` runs."""
    for _ in range(limit):
        run = Run.objects.get(job=job, status__in=Run.OPEN, is_backfill=False)
        if run.scheduled_for >= until:
            return
        traveller.move_to(run.due_at)
        scan_once(partitions=frozenset(range(settings.SCHEDULER_PARTITIONS)), now=timezone.now(), publish=False)
        assert run_execute_many(run_ids=[run.pk], worker="table-worker") == {run.pk: "succeeded"}
    raise AssertionError(f"more than {limit} runs before {until}")


LONDON_TABLE = {
    "2026-12": """
        2026-12-01T09:00:00Z 2026-12-02T09:00:00Z 2026-12-03T09:00:00Z 2026-12-04T09:00:00Z 2026-12-05T12:00:00Z
        2026-12-07T09:00:00Z 2026-12-08T09:00:00Z 2026-12-09T09:00:00Z 2026-12-10T09:00:00Z 2026-12-11T09:00:00Z
        2026-12-12T12:00:00Z 2026-12-14T09:00:00Z 2026-12-15T09:00:00Z 2026-12-16T09:00:00Z 2026-12-17T09:00:00Z
        2026-12-18T09:00:00Z 2026-12-19T12:00:00Z 2026-12-21T09:00:00Z 2026-12-22T09:00:00Z 2026-12-23T09:00:00Z
        2026-12-24T09:00:00Z 2026-12-26T12:00:00Z 2026-12-28T09:00:00Z 2026-12-29T09:00:00Z 2026-12-30T09:00:00Z
        2026-12-31T09:00:00Z
    """,
    # BST from Sunday 2027-03-28: 09:00 London is 08:00Z from Monday 29 March.
    "2027-03": """
        2027-03-01T09:00:00Z 2027-03-02T09:00:00Z 2027-03-03T09:00:00Z 2027-03-04T09:00:00Z 2027-03-05T09:00:00Z
        2027-03-06T12:00:00Z 2027-03-08T09:00:00Z 2027-03-09T09:00:00Z 2027-03-10T09:00:00Z 2027-03-11T09:00:00Z
        2027-03-12T09:00:00Z 2027-03-13T12:00:00Z 2027-03-15T09:00:00Z 2027-03-16T09:00:00Z 2027-03-17T09:00:00Z
        2027-03-18T09:00:00Z 2027-03-19T09:00:00Z 2027-03-20T12:00:00Z 2027-03-22T09:00:00Z 2027-03-23T09:00:00Z
        2027-03-24T09:00:00Z 2027-03-25T09:00:00Z 2027-03-26T09:00:00Z 2027-03-27T12:00:00Z 2027-03-29T08:00:00Z
        2027-03-30T08:00:00Z 2027-03-31T08:00:00Z
    """,
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("month", "created", "until", "excluded"),
    [
        ("2026-12", "2026-11-30T12:00:00Z", "2027-01-01T00:00:00Z", ["2026-12-25T09:00:00Z"]),
        ("2027-03", "2027-02-28T12:00:00Z", "2027-04-01T00:00:00Z", []),
    ],
)
def test_a_list_schedule_with_christmas_excluded_in_london_runs_the_table_and_skips_christmas(
    service: Service, loopback: LoopbackTarget, month: str, created: str, until: str, excluded: list[str]
) -> None:
    with frozen_store_clock(created) as traveller:
        data = create(service, body(
            schedule=["0 9 * * 1-5", "0 12 * * 6"], exclude=["2026-12-25"], timezone="Europe/London",
            target=loopback.url("/report"),
        ))
        assert data["schedule"] == ["0 9 * * 1-5", "0 12 * * 6"] and data["exclude"] == ["2026-12-25"]
        job = job_of(data)

        drive(job, traveller, utc(until))

    runs = Run.objects.filter(job=job).order_by("scheduled_for")
    succeeded = [iso_z(r.scheduled_for) for r in runs if r.status == Run.Status.SUCCEEDED]
    assert succeeded == LONDON_TABLE[month].split()
    assert len(loopback.calls("/report")) == len(succeeded)
    skipped = [r for r in runs if r.status == Run.Status.SKIPPED]
    assert [iso_z(r.scheduled_for) for r in skipped] == excluded
    for run in skipped:
        assert list(run.events.filter(type="skipped").values_list("detail", flat=True)) == [{"reason": "excluded"}]
        assert run.last_error.startswith("excluded:")


# --------------------------------------------------------------------------- schedule lists and exclude, in the API


@pytest.mark.embedded
@time_machine.travel(FROZEN, tick=False)
def test_a_schedule_is_read_back_as_given_a_string_as_a_string_and_a_list_as_a_list(service: Service) -> None:
    one = create(service, body(schedule="0  9 * * *"))
    listed = create(service, body(schedule=["0 9 * * *"]))

    assert one["schedule"] == "0 9 * * *"
    assert listed["schedule"] == ["0 9 * * *"]
    assert service.get(f"{JOBS}{listed['id']}/").json()["schedule"] == ["0 9 * * *"]
    assert job_of(listed).schedule == "" and job_of(listed).schedule_list == ["0 9 * * *"]


@pytest.mark.embedded
@pytest.mark.parametrize(
    ("schedule", "words"),
    [
        (["0 9 * * *", "0 25 * * *"], "schedule[1]: '0 25 * * *' is not a valid cron expression: hour 25 is out of range"),
        (["0 9 * * *", 5], "schedule[1]: must be a 5-field cron expression (a string), not a number"),
        ([], "the list is empty"),
        (["0 9 * * *"] * 11, "the list has 11 expressions; the limit is 10"),
        ({"cron": "0 9 * * *"}, "must be a 5-field cron expression or a list of them, not an object"),
    ],
)
def test_a_bad_schedule_list_is_a_400_naming_schedule_and_the_bad_expressions_index(
    service: Service, schedule: Any, words: str
) -> None:
    errors = refused(service, body(schedule=schedule))

    assert list(errors) == ["schedule"]
    assert any(m.startswith(words) for m in errors["schedule"]), errors


@pytest.mark.embedded
@pytest.mark.parametrize(
    ("exclude", "words"),
    [
        (["2026-12-25", "2026-02-30"], "exclude[1]: '2026-02-30' is not a date of the calendar"),
        (["25/12/2026"], "exclude[0]: '25/12/2026' is not a date: use YYYY-MM-DD"),
        ([20261225], "exclude[0]: a number is not a date"),
        ("2026-12-25", "must be a list of dates"),
    ],
)
def test_a_bad_exclude_is_a_400_naming_exclude_and_the_bad_item(service: Service, exclude: Any, words: str) -> None:
    errors = refused(service, body(schedule="0 9 * * *", exclude=exclude))

    assert list(errors) == ["exclude"]
    assert any(m.startswith(words) for m in errors["exclude"]), errors


@time_machine.travel(FROZEN, tick=False)
def test_exclude_is_read_back_sorted_each_date_once(service: Service) -> None:
    data = create(service, body(every="1h", exclude=["2027-01-01", "2026-12-25", "2027-01-01"]))

    assert data["exclude"] == ["2026-12-25", "2027-01-01"]


@override_settings(SCHEDULER_MIN_INTERVAL="5m")
def test_a_list_whose_union_runs_closer_than_scheduler_min_interval_is_a_400(service: Service) -> None:
    errors = refused(service, body(schedule=["0 * * * *", "2 * * * *"]))

    assert list(errors) == ["schedule"] and "SCHEDULER_MIN_INTERVAL" in errors["schedule"][0]


# --------------------------------------------------------------------------- the run path: every, ends_at, exclude


@pytest.mark.django_db(transaction=True)
def test_an_every_jobs_runs_go_on_at_starts_at_plus_k_intervals_after_each_outcome(
    service: Service, loopback: LoopbackTarget
) -> None:
    with frozen_store_clock("2026-12-01T10:00:00Z") as traveller:
        data = create(service, body(every="7m", starts_at="2026-12-01T09:58:30Z", target=loopback.url("/e")))
        job = job_of(data)
        drive(job, traveller, utc("2026-12-01T10:30:00Z"))

    ran = [r.scheduled_for for r in Run.objects.filter(job=job, status=Run.Status.SUCCEEDED).order_by("scheduled_for")]
    assert ran == [utc(t) for t in ("2026-12-01T10:05:30Z", "2026-12-01T10:12:30Z", "2026-12-01T10:19:30Z",
                                    "2026-12-01T10:26:30Z")]
    assert Run.objects.get(job=job, status=Run.Status.SCHEDULED).scheduled_for == utc("2026-12-01T10:33:30Z")


@pytest.mark.django_db(transaction=True)
def test_a_job_whose_next_time_is_past_ends_at_is_completed_when_its_last_run_ends(
    service: Service, loopback: LoopbackTarget
) -> None:
    with frozen_store_clock("2026-12-01T10:00:00Z") as traveller:
        data = create(service, body(schedule="0 * * * *", ends_at="2026-12-01T12:00:00Z", target=loopback.url("/e")))
        job = job_of(data)
        for _ in range(2):
            run = Run.objects.get(job=job, status__in=Run.OPEN)
            traveller.move_to(run.due_at)
            scan_once(partitions=frozenset(range(settings.SCHEDULER_PARTITIONS)), now=timezone.now(), publish=False)
            assert run_execute_many(run_ids=[run.pk], worker="w") == {run.pk: "succeeded"}

        after = service.get(f"{JOBS}{data['id']}/").json()

    ran = [iso_z(r.scheduled_for) for r in Run.objects.filter(job=job).order_by("scheduled_for")]
    assert ran == ["2026-12-01T11:00:00Z", "2026-12-01T12:00:00Z"]
    assert after["state"] == "completed" and after["next_run"] is None


@time_machine.travel("2026-12-01T13:00:00Z", tick=False)
def test_moving_ends_at_later_on_a_completed_job_makes_it_active_again_with_its_next_run(service: Service) -> None:
    data = create(service, body(schedule="0 * * * *", ends_at="2026-12-01T12:00:00Z"))
    assert data["state"] == "completed"

    changed = service.patch(f"{JOBS}{data['id']}/", {"ends_at": "2026-12-02T00:00:00Z"}).json()

    assert changed["state"] == "active"
    assert changed["next_run"]["scheduled_for"] == "2026-12-01T14:00:00Z"


@pytest.mark.django_db(transaction=True)
@override_settings(SCHEDULER_MIN_INTERVAL="1s", SCHEDULER_EXCLUDE_MAX_SKIPPED=5)
def test_an_every_1s_job_excluded_for_a_day_writes_a_bounded_number_of_skipped_rows_and_counts_the_rest(
    service: Service, loopback: LoopbackTarget
) -> None:
    with frozen_store_clock("2026-12-24T23:59:58Z") as traveller:
        data = create(service, body(every="1s", exclude=["2026-12-25"], target=loopback.url("/e")))
        job = job_of(data)
        drive(job, traveller, utc("2026-12-25T00:00:00Z"))

    skipped = list(Run.objects.filter(job=job, status=Run.Status.SKIPPED).order_by("scheduled_for"))
    assert [iso_z(r.scheduled_for) for r in skipped] == [f"2026-12-25T00:00:0{i}Z" for i in range(5)]
    details = [entry(r, "skipped").detail for r in skipped]
    assert details[:4] == [{"reason": "excluded"}] * 4
    assert details[4] == {"reason": "excluded", "excluded_without_row": 86_400 - 5}
    assert Run.objects.get(job=job, status=Run.Status.SCHEDULED).scheduled_for == utc("2026-12-26T00:00:00Z")


LONDON = {"schedule": ["0 9 * * 1-5", "0 12 * * 6"], "exclude": ["2026-12-25"], "timezone": "Europe/London"}


@pytest.mark.django_db(transaction=True)
def test_taking_a_date_out_of_exclude_cancels_its_skipped_row_and_runs_that_time_again(
    service: Service, loopback: LoopbackTarget
) -> None:
    with frozen_store_clock("2026-12-23T10:00:00Z") as traveller:
        data = create(service, body(**LONDON, target=loopback.url("/e")))
        job = job_of(data)
        drive(job, traveller, utc("2026-12-25T00:00:00Z"))
        christmas = Run.objects.get(job=job, scheduled_for=utc("2026-12-25T09:00:00Z"))
        assert christmas.status == Run.Status.SKIPPED

        changed = service.patch(f"{JOBS}{data['id']}/", {"exclude": []}).json()

    assert changed["next_run"]["scheduled_for"] == "2026-12-25T09:00:00Z"
    christmas.refresh_from_db()
    assert christmas.status == Run.Status.SCHEDULED
    assert timeline_types(christmas) == ["skipped", "cancelled", "scheduled"]


@pytest.mark.django_db(transaction=True)
def test_a_misfire_over_an_excluded_date_skips_that_time_with_reason_excluded_not_the_policy(
    service: Service, loopback: LoopbackTarget
) -> None:
    with frozen_store_clock("2026-12-23T10:00:00Z") as traveller:
        data = create(service, body(**LONDON, target=loopback.url("/e")))
        job = job_of(data)
        late = Run.objects.get(job=job, status=Run.Status.SCHEDULED)
        assert late.scheduled_for == utc("2026-12-24T09:00:00Z")
        traveller.move_to("2026-12-28T08:00:00Z")  # nothing ran for four days

        scan_once(partitions=frozenset(range(settings.SCHEDULER_PARTITIONS)), now=timezone.now(), publish=False)
        assert run_execute_many(run_ids=[late.pk], worker="w") == {late.pk: "succeeded"}

    rows = {iso_z(r.scheduled_for): r for r in Run.objects.filter(job=job)}
    assert rows["2026-12-24T09:00:00Z"].status == Run.Status.SUCCEEDED  # run_once: the late run runs
    reasons = {t: rows[t].events.get(type="skipped").detail["reason"] for t in ("2026-12-25T09:00:00Z",
                                                                                   "2026-12-26T12:00:00Z")}
    assert reasons == {"2026-12-25T09:00:00Z": "excluded", "2026-12-26T12:00:00Z": "misfire policy run_once"}
    assert rows["2026-12-28T09:00:00Z"].status == Run.Status.SCHEDULED
    assert set(rows) == {"2026-12-24T09:00:00Z", "2026-12-25T09:00:00Z", "2026-12-26T12:00:00Z",
                         "2026-12-28T09:00:00Z"}


@time_machine.travel("2026-12-27T00:00:00Z", tick=False)
def test_a_backfill_lists_an_every_jobs_times_but_not_those_on_excluded_dates(service: Service) -> None:
    from jobs.services import backfill_plan
    from tests.factories import created_long_ago

    data = create(service, body(every="12h", starts_at="2026-12-24T06:00:00Z", exclude=["2026-12-25"]))

    plan = backfill_plan(job=created_long_ago(job_of(data)), since=utc("2026-12-24T00:00:00Z"), until=utc("2026-12-27T00:00:00Z"),
                         now=timezone.now())

    assert [iso_z(t) for t in plan.times] == ["2026-12-24T06:00:00Z", "2026-12-24T18:00:00Z",
                                              "2026-12-26T06:00:00Z", "2026-12-26T18:00:00Z"]


@pytest.mark.parametrize("when", ["0010-01-10T00:01:00Z", "1969-12-31T23:59:59Z", "2999-01-01T00:00:00Z"])
def test_a_starts_at_before_1970_or_more_than_100_years_ahead_is_a_400_naming_it(service: Service, when: str) -> None:
    # Found by the API fuzz: year 10 was stored and read back as "10-01-10T00:01:00Z".
    errors = refused(service, body(every="1h", starts_at=when))

    assert list(errors) == ["starts_at"]
