"""The REST API, as a service sees it (docs/reference.md, the API fields)."""
from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import time_machine
from django.core.management import call_command
from rest_framework.test import APIClient
from rest_framework.throttling import UserRateThrottle

import jobs.services
from jobs.models import Job
from runs.models import Run, RunEvent
from tests.conftest import Service
from tests.jobs.conftest import error_messages, row_counts
from tests.factories import timeline_types

# Also run on the embedded defaults (SQLite): the API must behave the same there.
pytestmark = pytest.mark.embedded

JOBS = "/api/jobs/"
NIGHTLY = {
    "name": "nightly-report",
    "schedule": "0 2 * * *",
    "timezone": "Asia/Kolkata",
    "target": "https://reports.internal/rebuild",
    "method": "POST",
    "headers": {"X-Team": "reports"},
    "payload": {"report": "daily"},
    "window": "0s",
    "misfire": "run_once",
    "retry": {"max": 5, "backoff": "exponential"},
    "timeout": "30s",
}
FROZEN = "2026-10-28T10:00:00Z"


def one_off(**fields: Any) -> dict[str, Any]:
    body = {"name": "export", "target": "https://exports.internal/run"}
    body.update(fields)
    return body


def create(service: Service, body: dict[str, Any]) -> dict[str, Any]:
    response = service.post(JOBS, body)
    assert response.status_code == 201, response.content
    return response.json()


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


# --------------------------------------------------------------------------- creating


@time_machine.travel(FROZEN, tick=False)
def test_creating_a_cron_job_answers_201_with_its_first_run_in_utc(service: Service) -> None:
    body = create(service, NIGHTLY)

    assert body["id"].startswith("job_")
    assert body["schedule"] == "0 2 * * *"
    assert body["at"] is None
    assert body["state"] == "active" and body["paused"] is False
    assert body["window"] == "0s" and body["timeout"] == "30s"
    assert body["retry"] == {"max": 5, "backoff": "exponential", "base": "10s", "cap": "1h"}
    # 02:00 in Kolkata (UTC+05:30) is 20:30 UTC the day before.
    assert body["next_run"]["scheduled_for"] == "2026-10-28T20:30:00Z"
    assert body["next_run"]["due_at"] == "2026-10-28T20:30:00Z"
    assert body["next_run"]["status"] == "scheduled"
    assert body["created_at"] == "2026-10-28T10:00:00Z"
    job = Job.objects.get(pk=int(body["id"].removeprefix("job_")))
    run = Run.objects.get(job=job)
    assert body["next_run"]["id"] == f"run_{run.pk}"
    assert run.scheduled_for == at("2026-10-28T20:30:00Z")
    assert timeline_types(run) == ["scheduled"]


def test_creating_applies_the_contract_defaults(service: Service) -> None:
    body = create(service, {"schedule": "*/5 * * * *", "target": "http://example.test/hook"})

    assert body["timezone"] == "UTC"
    assert body["method"] == "POST"
    assert body["misfire"] == "run_once"
    assert body["window"] == "0s"
    assert body["timeout"] == "30s"
    assert body["retry"] == {"max": 3, "backoff": "exponential", "base": "10s", "cap": "1h"}
    assert body["headers"] == {} and body["secret_headers"] == []
    assert body["payload"] is None and body["notify"] is None and body["name"] == ""


@pytest.mark.django_db(transaction=True)
def test_a_failure_after_the_job_insert_leaves_neither_row(
    service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    inserted: list[int] = []

    def explode(*, job: Job, **kwargs: Any) -> Run:
        inserted.append(job.pk)  # the job row exists at this point
        raise RuntimeError("the database went away")

    # The first run is made by job_next_run (the one place a job's next run is decided).
    monkeypatch.setattr(jobs.services, "job_next_run", explode)
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")
    before = row_counts()

    response = client.post(JOBS, NIGHTLY, format="json")

    assert response.status_code == 500
    assert inserted, "job_next_run was never reached"
    assert row_counts() == before == (0, 0, 0)


# --------------------------------------------------------------------------- bad input

BIG = "x" * (257 * 1024)
BAD_INPUT = [
    # (test id, changes to NIGHTLY (None removes a field), the field the 400 must name)
    ("bad-cron", {"schedule": "every night"}, "schedule"),
    ("six-field-cron", {"schedule": "0 0 2 * * *"}, "schedule"),
    ("cron-out-of-range", {"schedule": "61 2 * * *"}, "schedule"),
    ("unknown-zone", {"timezone": "Mars/Olympus_Mons"}, "timezone"),
    ("schedule-and-at", {"at": "2026-11-01T00:00:00Z"}, "at"),
    ("schedule-and-delay", {"delay": "10m"}, "delay"),
    ("none-of-schedule-at-delay", {"schedule": None}, "schedule"),
    ("negative-delay", {"schedule": None, "delay": "-5m"}, "delay"),
    ("malformed-delay", {"schedule": None, "delay": "5 minutes"}, "delay"),
    ("delay-not-a-string", {"schedule": None, "delay": 600}, "delay"),
    ("malformed-window", {"window": "five minutes"}, "window"),
    ("window-too-long", {"window": "2d"}, "window"),
    ("ftp-target", {"target": "ftp://files.internal/report"}, "target"),
    ("target-without-host", {"target": "http:///rebuild"}, "target"),
    ("link-local-target", {"target": "http://169.254.169.254/latest/meta-data"}, "target"),
    ("target-not-a-string", {"target": {"url": "https://x.test"}}, "target"),
    ("unknown-misfire", {"misfire": "sometimes"}, "misfire"),
    ("retry-max-too-big", {"retry": {"max": 101}}, "retry"),
    ("retry-max-negative", {"retry": {"max": -1}}, "retry"),
    ("unknown-backoff", {"retry": {"backoff": "random"}}, "retry"),
    ("retry-cap-below-base", {"retry": {"base": "1m", "cap": "30s"}}, "retry"),
    ("retry-unknown-key", {"retry": {"tries": 3}}, "retry"),
    ("retry-not-an-object", {"retry": 5}, "retry"),
    ("payload-over-256-kib", {"payload": {"blob": BIG}}, "payload"),
    ("payload-with-nul", {"payload": {"text": "a\u0000b"}}, "payload"),
    ("payload-nested-too-deep", {"payload": json.loads("[" * 70 + "]" * 70)}, "payload"),
    ("headers-not-an-object", {"headers": ["X-Team: reports"]}, "headers"),
    ("bad-header-name", {"headers": {"X Team": "reports"}}, "headers"),
    ("header-value-not-a-string", {"headers": {"X-Count": 5}}, "headers"),
    ("header-value-with-newline", {"headers": {"X-Team": "a\r\nX-Evil: 1"}}, "headers"),
    ("header-set-by-the-scheduler", {"headers": {"Idempotency-Key": "mine"}}, "headers"),
    ("headers-over-16-kib", {"headers": {"X-Big": "y" * (17 * 1024)}}, "headers"),
    ("secret-headers-not-a-list", {"secret_headers": "X-Api-Key"}, "secret_headers"),
    ("unknown-field", {"colour": "blue"}, "colour"),
    ("read-only-field", {"state": "paused"}, "state"),
    ("malformed-at", {"schedule": None, "at": "tomorrow at noon"}, "at"),
    ("at-at-the-end-of-time", {"schedule": None, "at": "9999-12-31T23:59:59.5Z"}, "at"),
    ("at-long-ago", {"schedule": None, "at": "1999-01-01T00:00:00Z"}, "at"),
    ("timeout-zero", {"timeout": "0s"}, "timeout"),
    ("timeout-too-big", {"timeout": "2h"}, "timeout"),
    ("method-fetch", {"method": "FETCH"}, "method"),
    ("notify-not-an-email", {"notify": "the reports team"}, "notify"),
    ("paused-not-a-boolean", {"paused": "perhaps"}, "paused"),
    ("name-too-long", {"name": "n" * 201}, "name"),
    ("name-with-nul", {"name": "a\u0000b"}, "name"),
]


def with_changes(changes: dict[str, Any]) -> dict[str, Any]:
    body = dict(NIGHTLY)
    for key, value in changes.items():
        if value is None:
            body.pop(key, None)
        else:
            body[key] = value
    return body


@time_machine.travel(FROZEN, tick=False)
@pytest.mark.parametrize("changes, field", [c[1:] for c in BAD_INPUT], ids=[c[0] for c in BAD_INPUT])
def test_a_bad_field_is_a_400_that_names_it_in_words_and_writes_nothing(
    service: Service, changes: dict[str, Any], field: str
) -> None:
    before = row_counts()

    response = service.post(JOBS, with_changes(changes))

    assert response.status_code == 400, response.content
    errors = response.json()
    assert field in errors, errors
    messages = error_messages(errors[field])
    assert messages and all(len(m.split()) >= 2 for m in messages), messages
    assert row_counts() == before == (0, 0, 0)


@pytest.mark.parametrize("body", [[NIGHTLY], None, "a job", 12], ids=["list", "null", "string", "number"])
def test_a_body_that_is_not_a_json_object_is_a_400_in_words(service: Service, body: Any) -> None:
    response = service.client.post(JOBS, json.dumps(body), content_type="application/json")

    assert response.status_code == 400
    assert "must be a JSON object" in response.json()["non_field_errors"][0]
    assert row_counts() == (0, 0, 0)


RAW_BODIES = [
    ("nan", '{"schedule": "0 2 * * *", "target": "https://x.test/", "payload": NaN}'),
    ("infinity-by-overflow", '{"schedule": "0 2 * * *", "target": "https://x.test/", "payload": 1e400}'),
    ("huge-int", '{"schedule": "0 2 * * *", "target": "https://x.test/", "payload": ' + "9" * 5000 + "}"),
    ("lone-surrogate", '{"schedule": "0 2 * * *", "target": "https://x.test/", "name": "\\ud800"}'),
    ("nested-past-the-stack", "[" * 200_000 + "]" * 200_000),
    ("truncated", '{"schedule": "0 2 * * *", '),
]


@pytest.mark.parametrize("raw", [r[1] for r in RAW_BODIES], ids=[r[0] for r in RAW_BODIES])
def test_json_the_database_would_refuse_is_a_400_not_a_500(service: Service, raw: str) -> None:
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")

    response = client.post(JOBS, raw, content_type="application/json")

    assert response.status_code == 400, response.content[:300]
    assert response.json()["detail"].startswith("JSON parse error")
    assert row_counts() == (0, 0, 0)


def test_invalid_utf8_is_a_400(service: Service) -> None:
    response = service.client.post(JOBS, b'{"name": "\xff"}', content_type="application/json")

    assert response.status_code == 400


def test_a_body_over_one_mebibyte_is_a_413(service: Service) -> None:
    body = json.dumps(with_changes({"payload": {"blob": "z" * (1024 * 1024)}}))

    response = service.client.post(JOBS, body, content_type="application/json")

    assert response.status_code == 413
    assert row_counts() == (0, 0, 0)


def test_a_payload_over_256_kib_in_a_body_under_one_mebibyte_is_a_400_naming_payload(service: Service) -> None:
    body = json.dumps(with_changes({"payload": {"blob": "z" * (300 * 1024)}}))
    assert len(body) < 1024 * 1024

    response = service.client.post(JOBS, body, content_type="application/json")

    assert response.status_code == 400
    assert "262144" in response.json()["payload"][0]


# --------------------------------------------------------------------------- who may see what


def test_no_token_is_a_401_with_www_authenticate_token(db: None) -> None:
    response = APIClient().get(JOBS)

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"


def test_a_bad_token_is_a_401(db: None) -> None:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")

    response = client.post(JOBS, NIGHTLY, format="json")

    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Token"
    assert row_counts() == (0, 0, 0)


def test_another_services_job_and_runs_are_404_and_untouched(service: Service, other_service: Service) -> None:
    theirs = create(other_service, NIGHTLY)
    path = f"{JOBS}{theirs['id']}/"
    run_path = f"/api/runs/{theirs['next_run']['id']}/"

    assert service.get(path).status_code == 404
    assert service.patch(path, {"paused": True}).status_code == 404
    assert service.delete(path).status_code == 404
    assert service.get(f"{path}runs/").status_code == 404
    assert service.get(run_path).status_code == 404
    assert other_service.get(path).json()["state"] == "active"
    assert other_service.get(run_path).status_code == 200


def test_lists_show_only_the_callers_jobs_and_runs(service: Service, other_service: Service) -> None:
    mine = create(service, NIGHTLY)
    create(other_service, NIGHTLY)

    jobs_page = service.get(JOBS).json()
    runs_page = service.get("/api/runs/").json()

    assert [j["id"] for j in jobs_page["results"]] == [mine["id"]]
    assert jobs_page["count"] == 1 and set(jobs_page) == {"count", "next", "previous", "results"}
    assert [r["job"] for r in runs_page["results"]] == [mine["id"]]


def test_staff_see_every_services_jobs_and_runs(
    service: Service, other_service: Service, staff_client: APIClient
) -> None:
    mine = create(service, NIGHTLY)
    theirs = create(other_service, NIGHTLY)

    listed = {j["id"] for j in staff_client.get(JOBS).json()["results"]}
    runs = {r["job"] for r in staff_client.get("/api/runs/").json()["results"]}

    assert listed == runs == {mine["id"], theirs["id"]}
    assert staff_client.get(f"{JOBS}{theirs['id']}/").status_code == 200


def test_over_the_throttle_is_a_429_with_retry_after(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {"user": "2/min"})

    statuses = [service.get(JOBS).status_code for _ in range(3)]
    response = service.get(JOBS)

    assert statuses == [200, 200, 429]
    assert response.status_code == 429
    assert int(response["Retry-After"]) > 0


@pytest.mark.parametrize("job_id", ["job_999999", "run_1", "job_", "job_12x", "-1", "1" * 30, "%00"])
def test_an_unknown_or_malformed_id_is_a_404(service: Service, job_id: str) -> None:
    assert service.get(f"{JOBS}{job_id}/").status_code == 404
    assert service.get(f"/api/runs/{job_id}/").status_code == 404


def test_a_job_is_found_by_its_plain_number_too(service: Service) -> None:
    job = create(service, NIGHTLY)
    number = job["id"].removeprefix("job_")

    assert service.get(f"{JOBS}{number}/").json()["id"] == job["id"]


# --------------------------------------------------------------------------- times


@time_machine.travel(FROZEN, tick=False)
@pytest.mark.parametrize(
    "wall, expected",
    [
        ("2026-12-01T09:00:00", "2026-12-01T14:00:00Z"),  # EST, -05:00
        ("2026-11-01T01:30:00", "2026-11-01T05:30:00Z"),  # the fall-back hour: its first pass (EDT)
        ("2026-12-01T09:00:00+01:00", "2026-12-01T08:00:00Z"),  # an offset wins over the zone
    ],
)
def test_an_at_without_offset_is_wall_clock_time_in_the_jobs_zone(
    service: Service, wall: str, expected: str
) -> None:
    body = create(service, one_off(at=wall, timezone="America/New_York"))

    assert body["at"] == expected
    assert body["next_run"]["scheduled_for"] == expected
    assert body["schedule"] is None


@time_machine.travel(FROZEN, tick=False)
def test_an_at_with_a_fraction_is_rounded_up_to_the_next_whole_second(service: Service) -> None:
    body = create(service, one_off(at="2026-10-28T20:30:00.2Z"))

    assert body["at"] == "2026-10-28T20:30:01Z"
    run = Run.objects.get(job_id=int(body["id"].removeprefix("job_")))
    assert run.scheduled_for == at("2026-10-28T20:30:01Z")
    assert run.idempotency_key == f"{body['id']}@2026-10-28T20:30:01Z"


@time_machine.travel("2026-10-28T10:00:00.25Z", tick=False)
def test_a_delay_is_now_plus_the_delay_rounded_up_to_a_whole_second(service: Service) -> None:
    body = create(service, one_off(delay="10m"))

    assert body["at"] == "2026-10-28T10:10:01Z"
    assert body["next_run"]["scheduled_for"] == "2026-10-28T10:10:01Z"
    assert "delay" not in body


@time_machine.travel(FROZEN, tick=False)
def test_a_window_spreads_due_at_inside_it(service: Service) -> None:
    body = create(service, with_changes({"window": "5m"}))

    due = at(body["next_run"]["due_at"])
    assert body["window"] == "5m"
    assert at("2026-10-28T20:30:00Z") <= due <= at("2026-10-28T20:35:00Z")


# --------------------------------------------------------------------------- changing


@time_machine.travel(FROZEN, tick=False)
def test_patching_the_schedule_replaces_the_waiting_run(service: Service) -> None:
    job = create(service, NIGHTLY)
    old_run = job["next_run"]["id"]

    response = service.patch(f"{JOBS}{job['id']}/", {"schedule": "30 3 * * *"})

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["schedule"] == "30 3 * * *"
    assert body["next_run"]["scheduled_for"] == "2026-10-28T22:00:00Z"  # 03:30 IST
    assert body["next_run"]["id"] != old_run
    old = Run.objects.get(pk=int(old_run.removeprefix("run_")))
    assert old.status == Run.Status.CANCELLED
    assert timeline_types(old) == ["scheduled", "cancelled"]


@time_machine.travel(FROZEN, tick=False)
def test_patching_back_to_an_earlier_schedule_reopens_its_cancelled_run(service: Service) -> None:
    job = create(service, NIGHTLY)
    path = f"{JOBS}{job['id']}/"

    service.patch(path, {"schedule": "30 3 * * *"})
    response = service.patch(path, {"schedule": "0 2 * * *"})

    assert response.status_code == 200, response.content
    next_run = response.json()["next_run"]
    assert next_run["id"] == job["next_run"]["id"]
    assert next_run["scheduled_for"] == "2026-10-28T20:30:00Z"
    assert Run.objects.filter(status=Run.Status.SCHEDULED).count() == 1


@time_machine.travel(FROZEN, tick=False)
def test_patching_only_the_window_keeps_the_run_and_respreads_it(service: Service) -> None:
    job = create(service, NIGHTLY)

    response = service.patch(f"{JOBS}{job['id']}/", {"window": "1h"})

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["window"] == "1h"
    assert body["next_run"]["id"] == job["next_run"]["id"]
    assert at("2026-10-28T20:30:00Z") <= at(body["next_run"]["due_at"]) <= at("2026-10-28T21:30:00Z")


@time_machine.travel(FROZEN, tick=False)
def test_patching_a_cron_job_to_a_delay_makes_it_a_one_off(service: Service) -> None:
    job = create(service, NIGHTLY)

    body = service.patch(f"{JOBS}{job['id']}/", {"delay": "90s"}).json()

    assert body["schedule"] is None
    assert body["at"] == "2026-10-28T10:01:30Z"
    assert body["next_run"]["scheduled_for"] == "2026-10-28T10:01:30Z"


@time_machine.travel(FROZEN, tick=False)
def test_a_bad_patch_is_a_400_naming_the_field_and_changes_nothing(service: Service) -> None:
    job = create(service, NIGHTLY)
    before = row_counts()

    response = service.patch(f"{JOBS}{job['id']}/", {"schedule": "0 2 * *", "retry": {"cap": "1s"}})

    assert response.status_code == 400
    assert set(response.json()) == {"schedule"}
    assert row_counts() == before
    assert service.get(f"{JOBS}{job['id']}/").json() == job


@time_machine.travel(FROZEN, tick=False)
def test_a_patch_checks_retry_cap_against_the_stored_base(service: Service) -> None:
    job = create(service, with_changes({"retry": {"base": "2m"}}))

    response = service.patch(f"{JOBS}{job['id']}/", {"retry": {"cap": "1m"}})

    assert response.status_code == 400
    assert "at least base (2m)" in response.json()["retry"]["cap"][0]


@time_machine.travel(FROZEN, tick=False)
def test_pausing_and_resuming_shows_in_paused_state_and_the_runs_hold(service: Service) -> None:
    job = create(service, NIGHTLY)
    path = f"{JOBS}{job['id']}/"
    run = Run.objects.get(pk=int(job["next_run"]["id"].removeprefix("run_")))

    paused = service.patch(path, {"paused": True}).json()
    run.refresh_from_db()
    assert (paused["paused"], paused["state"], run.held) == (True, "paused", True)

    resumed = service.patch(path, {"paused": False}).json()
    run.refresh_from_db()
    assert (resumed["paused"], resumed["state"], run.held) == (False, "active", False)


@time_machine.travel(FROZEN, tick=False)
def test_a_job_created_paused_holds_its_first_run(service: Service) -> None:
    job = create(service, with_changes({"paused": True}))

    assert job["state"] == "paused"
    assert Run.objects.get(pk=int(job["next_run"]["id"].removeprefix("run_"))).held is True


def complete(job: dict[str, Any]) -> None:
    """What the worker does when a one-off's run ends."""
    job_id = int(job["id"].removeprefix("job_"))
    Run.objects.filter(job_id=job_id).update(status=Run.Status.SUCCEEDED, finished_at=at(FROZEN))
    Job.objects.filter(pk=job_id).update(state=Job.State.COMPLETED)


@time_machine.travel(FROZEN, tick=False)
def test_a_new_time_for_a_completed_one_off_schedules_it_again(service: Service) -> None:
    job = create(service, one_off(at="2026-10-28T12:00:00Z"))
    complete(job)

    body = service.patch(f"{JOBS}{job['id']}/", {"at": "2026-10-29T12:00:00Z"}).json()

    assert body["state"] == "active"
    assert body["next_run"]["scheduled_for"] == "2026-10-29T12:00:00Z"


@time_machine.travel(FROZEN, tick=False)
def test_a_completed_one_off_stays_completed_when_paused_resumed_or_given_a_window(service: Service) -> None:
    job = create(service, one_off(at="2026-10-28T12:00:00Z"))
    complete(job)
    path = f"{JOBS}{job['id']}/"

    responses = [service.patch(path, change) for change in ({"paused": True}, {"paused": False}, {"window": "5m"})]

    assert [r.status_code for r in responses] == [200, 200, 200]
    assert [r.json()["state"] for r in responses] == ["completed"] * 3
    assert responses[0].json()["paused"] is True and responses[2].json()["next_run"] is None


@time_machine.travel(FROZEN, tick=False)
def test_delete_is_204_then_the_job_reads_as_deleted_with_its_run_cancelled(service: Service) -> None:
    job = create(service, NIGHTLY)
    path = f"{JOBS}{job['id']}/"

    response = service.delete(path)

    assert response.status_code == 204
    body = service.get(path).json()
    assert body["state"] == "deleted" and body["next_run"] is None
    run = Run.objects.get(pk=int(job["next_run"]["id"].removeprefix("run_")))
    assert run.status == Run.Status.CANCELLED
    assert service.get(f"{path}runs/").json()["results"][0]["status"] == "cancelled"


@time_machine.travel(FROZEN, tick=False)
def test_a_deleted_job_cannot_be_patched_and_deleting_again_changes_nothing(service: Service) -> None:
    job = create(service, NIGHTLY)
    path = f"{JOBS}{job['id']}/"
    service.delete(path)
    deleted_at = Job.objects.get().deleted_at

    patched = service.patch(path, {"name": "again"})
    with time_machine.travel("2026-10-29T00:00:00Z", tick=False):
        again = service.delete(path)

    assert patched.status_code == 409
    assert "deleted" in patched.json()["detail"]
    assert again.status_code == 204
    assert Job.objects.get().deleted_at == deleted_at


def test_put_is_not_allowed(service: Service) -> None:
    job = create(service, NIGHTLY)

    assert service.client.put(f"{JOBS}{job['id']}/", NIGHTLY, format="json").status_code == 405


# --------------------------------------------------------------------------- secrets


def test_secret_headers_are_shown_as_stars_and_never_in_clear(service: Service) -> None:
    headers = {"Authorization": "Bearer s3cr3t-t0ken", "X-Api-Key": "k3y-v4lue", "X-Team": "reports"}
    job = create(service, with_changes({"headers": headers, "secret_headers": ["X-Api-Key"]}))
    responses = [service.get(f"{JOBS}{job['id']}/"), service.get(JOBS)]

    assert job["headers"] == {"Authorization": "***", "X-Api-Key": "***", "X-Team": "reports"}
    assert job["secret_headers"] == ["X-Api-Key"]
    for response in responses:
        assert b"s3cr3t-t0ken" not in response.content and b"k3y-v4lue" not in response.content
    assert "s3cr3t" not in str(Job.objects.values_list("headers", "secret_headers").get())


def test_a_secret_sent_back_as_stars_keeps_its_stored_value(service: Service) -> None:
    job = create(service, with_changes({"headers": {"Authorization": "Bearer s3cr3t-t0ken"}}))

    body = service.patch(f"{JOBS}{job['id']}/", {"headers": {**job["headers"], "X-Team": "ops"}}).json()

    assert body["headers"] == {"Authorization": "***", "X-Team": "ops"}
    from jobs.secrets import decrypt_headers

    assert decrypt_headers(Job.objects.get().secret_headers) == {"Authorization": "Bearer s3cr3t-t0ken"}


def test_marking_a_stored_header_secret_encrypts_it(service: Service) -> None:
    job = create(service, with_changes({"headers": {"X-Api-Key": "k3y-v4lue"}}))

    body = service.patch(f"{JOBS}{job['id']}/", {"secret_headers": ["X-Api-Key"]}).json()

    assert body["headers"] == {"X-Api-Key": "***"}
    assert Job.objects.get().headers == {}


# --------------------------------------------------------------------------- runs


def make_run(job_id: str, status: str, hours: int) -> Run:
    job = Job.objects.get(pk=int(job_id.removeprefix("job_")))
    when = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(hours=hours)
    return Run.objects.create(
        job=job, scheduled_for=when, due_at=when, partition=job.partition, status=status,
        attempt=4, finished_at=when,
    )


def test_status_dead_lists_only_dead_runs(service: Service) -> None:
    job = create(service, NIGHTLY)
    dead = [make_run(job["id"], Run.Status.DEAD, hours) for hours in (1, 2)]
    make_run(job["id"], Run.Status.SUCCEEDED, 3)

    page = service.get("/api/runs/", status="dead").json()

    assert page["count"] == 2
    assert [r["id"] for r in page["results"]] == [f"run_{r.pk}" for r in reversed(dead)]
    assert {r["status"] for r in page["results"]} == {"dead"}


def test_a_jobs_runs_are_newest_first_and_filter_by_status(service: Service) -> None:
    job = create(service, NIGHTLY)
    for hours, status in enumerate([Run.Status.SUCCEEDED, Run.Status.DEAD, Run.Status.SUCCEEDED]):
        make_run(job["id"], status, hours)

    everything = service.get(f"{JOBS}{job['id']}/runs/").json()["results"]
    succeeded = service.get(f"{JOBS}{job['id']}/runs/", status="succeeded").json()["results"]

    times = [r["scheduled_for"] for r in everything]
    assert times == sorted(times, reverse=True) and len(times) == 4
    assert [r["status"] for r in succeeded] == ["succeeded", "succeeded"]


@pytest.mark.parametrize("path", ["/api/runs/", "/api/jobs/{job}/runs/"])
def test_an_unknown_status_filter_is_a_400_naming_status(service: Service, path: str) -> None:
    job = create(service, NIGHTLY)

    response = service.get(path.format(job=job["id"]), status="exploded")

    assert response.status_code == 400
    assert "unknown status" in response.json()["status"][0]


@time_machine.travel(FROZEN, tick=False)
def test_a_run_reads_with_its_whole_timeline_oldest_first(service: Service) -> None:
    job = create(service, NIGHTLY)
    run = Run.objects.get()
    RunEvent.objects.create(run=run, at=at("2026-10-28T20:30:02Z"), type="claimed", detail={"fence": 1, "worker": "w1"})
    RunEvent.objects.create(run=run, at=at("2026-10-28T20:30:01Z"), type="queued", detail={})

    body = service.get(f"/api/runs/{job['next_run']['id']}/").json()

    assert body["id"] == f"run_{run.pk}" and body["job"] == job["id"]
    assert body["idempotency_key"] == f"{job['id']}@2026-10-28T20:30:00Z"
    assert (body["attempt"], body["fence"], body["started_at"], body["finished_at"]) == (0, 0, None, None)
    assert [(e["at"], e["type"]) for e in body["events"]] == [
        ("2026-10-28T10:00:00Z", "scheduled"),
        ("2026-10-28T20:30:01Z", "queued"),
        ("2026-10-28T20:30:02Z", "claimed"),
    ]
    assert body["events"][2]["detail"] == {"fence": 1, "worker": "w1"}
    assert "events" not in service.get("/api/runs/").json()["results"][0]


def test_list_endpoints_run_a_bounded_number_of_queries(
    service: Service, django_assert_max_num_queries: Any
) -> None:
    for n in range(8):
        job = create(service, with_changes({"name": f"job-{n}"}))
        make_run(job["id"], Run.Status.DEAD, n)

    # Token lookup, count, page, and one prefetch of the open runs: not one per job.
    with django_assert_max_num_queries(5):
        assert len(service.get(JOBS).json()["results"]) == 8
    with django_assert_max_num_queries(4):
        assert len(service.get("/api/runs/").json()["results"]) == 16


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize("client_kind", ["with-token", "without-token"])
def test_the_schema_and_docs_pages_are_served(service: Service, client_kind: str) -> None:
    client = service.client if client_kind == "with-token" else APIClient()

    schema = client.get("/api/schema/")
    docs = client.get("/api/docs/")

    assert schema.status_code == 200
    assert b"/api/jobs/{id}/:" in schema.content and b"/api/runs/{id}/:" in schema.content
    assert b"/api/jobs/{id}/runs/:" in schema.content
    assert docs.status_code == 200
    assert b"swagger-ui" in docs.content
    assert b"cdn." not in docs.content  # the assets are ours (drf-spectacular-sidecar), not a CDN's


def test_the_openapi_schema_generates_without_warnings(tmp_path: Path) -> None:
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yml"))

    assert "/api/jobs/{id}/runs/" in (tmp_path / "schema.yml").read_text()


def test_staff_moving_a_services_target_to_another_host_drops_its_secret_headers_and_the_owner_keeps_them(
    service: Any, staff_client: Any
) -> None:
    """Secret headers are the owning service's to send to its target: staff changing
    the target's host through the API drop them; the owning service's own PATCH to
    another host keeps them (sent back as "***"), as documented."""
    from jobs.secrets import decrypt_headers

    body = {"name": "secret", "schedule": "0 2 * * *", "target": "https://a.example/x",
            "headers": {"Authorization": "Bearer s3cret"}}
    created = service.client.post("/api/jobs/", body, format="json").json()
    url = f"/api/jobs/{created['id']}/"
    assert service.client.patch(url, {"target": "https://b.example/x", "headers": {"Authorization": "***"}},
                                format="json").status_code == 200
    job = Job.objects.get(name="secret")
    assert decrypt_headers(job.secret_headers) == {"Authorization": "Bearer s3cret"}

    assert staff_client.patch(url, {"target": "https://c.example/x"}, format="json").status_code == 200
    job.refresh_from_db()
    assert decrypt_headers(job.secret_headers) == {}


@pytest.mark.parametrize("name", ["report\x1b[2J", "line\nbreak", "bell\x07", "c1\x9b31m", "tab\there"])
def test_a_name_with_control_characters_is_a_400_naming_name(service: Any, name: str) -> None:
    body = {"name": name, "schedule": "0 2 * * *", "target": "https://a.example/x"}
    response = service.client.post("/api/jobs/", body, format="json")
    assert response.status_code == 400 and "control characters" in response.json()["name"][0], response.json()
    assert not Job.objects.exists()


def test_job_fields_a_form_or_code_can_hand_over_with_lone_surrogates_are_refused_in_words(service: Any) -> None:
    """The API's JSON parser refuses a lone surrogate; the admin's forms, sync_jobs and
    import_beat hand Python strings to the same serializer, where PostgreSQL's refusal
    was a 500 (the admin) or a traceback (the commands)."""
    from jobs.serializers import JobSerializer

    base = {"name": "x", "schedule": "0 2 * * *", "target": "https://a.example/x"}
    for field, value in [("payload", {"k": "\ud800"}), ("payload", {"\udfff": 1}), ("name", "bad\ud800")]:
        serializer = JobSerializer(data={**base, field: value}, context={"owner": service.user})
        assert not serializer.is_valid()
        assert "urrogate" in str(serializer.errors[field]), serializer.errors
    task = {"name": "t", "schedule": "0 2 * * *", "task": "reports.tasks.x", "args": ["\ud800"]}
    serializer = JobSerializer(data=task, context={"owner": service.user})
    assert not serializer.is_valid() and "lone surrogates" in str(serializer.errors["args"]), serializer.errors
