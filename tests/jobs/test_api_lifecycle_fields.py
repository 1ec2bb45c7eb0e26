"""The API's run-lifecycle fields: `overlap`, `pause_after_failures`, `paused_until`
(docs/reference.md, the API fields). A bad value is a 400 naming the field, and nothing is written."""
from __future__ import annotations

from typing import Any

import pytest
import time_machine

from jobs.models import Job
from runs.models import Run
from tests.conftest import Service
from tests.jobs.conftest import error_messages, row_counts

# Also run on the embedded defaults (SQLite): the API must behave the same there.
pytestmark = pytest.mark.embedded

JOBS = "/api/jobs/"
FROZEN = "2026-10-28T10:00:00Z"
BODY = {"name": "sync", "schedule": "*/5 * * * *", "target": "https://sync.internal/run"}


def create(service: Service, **fields: Any) -> dict[str, Any]:
    response = service.post(JOBS, {**BODY, **fields})
    assert response.status_code == 201, response.content
    return response.json()


def refused(response: Any, field: str) -> str:
    assert response.status_code == 400, response.content
    body = response.json()
    assert field in body, body
    return " ".join(error_messages(body[field]))


@time_machine.travel(FROZEN, tick=False)
def test_a_new_job_skips_overlapping_times_and_never_pauses_itself_by_default(service: Service) -> None:
    job = create(service)
    assert (job["overlap"], job["pause_after_failures"], job["paused_until"]) == ("skip", 0, None)


@time_machine.travel(FROZEN, tick=False)
def test_overlap_and_pause_after_failures_are_kept_as_given(service: Service) -> None:
    job = create(service, overlap="buffer_one", pause_after_failures=3)
    assert (job["overlap"], job["pause_after_failures"]) == ("buffer_one", 3)
    stored = Job.objects.get()
    assert (stored.overlap, stored.pause_after_failures) == ("buffer_one", 3)
    patched = service.patch(f"{JOBS}{job['id']}/", {"overlap": "skip", "pause_after_failures": 0}).json()
    assert (patched["overlap"], patched["pause_after_failures"]) == ("skip", 0)


@time_machine.travel(FROZEN, tick=False)
def test_overlap_allow_is_accepted_and_kept(service: Service) -> None:
    job = create(service, overlap="allow")
    assert job["overlap"] == "allow" and Job.objects.get().overlap == "allow"
    assert job["next_run"]["status"] == "scheduled"


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("overlap", "sometimes", 'unknown overlap policy "sometimes": use skip, buffer_one or allow'),
        ("pause_after_failures", -1, "greater than or equal to 0"),
        ("pause_after_failures", 1001, "less than or equal to 1000"),
        ("pause_after_failures", "often", "valid integer"),
        ("paused_until", "tomorrow", "wrong format"),
    ],
)
@time_machine.travel(FROZEN, tick=False)
def test_a_bad_lifecycle_field_is_a_400_naming_it_and_nothing_is_written(
    service: Service, field: str, value: Any, words: str
) -> None:
    before = row_counts()
    message = refused(service.post(JOBS, {**BODY, "paused": True, field: value}), field)
    assert words in message, message
    assert row_counts() == before


@time_machine.travel(FROZEN, tick=False)
def test_paused_until_on_a_job_that_is_not_paused_is_a_400(service: Service) -> None:
    job = create(service)
    message = refused(service.patch(f"{JOBS}{job['id']}/", {"paused_until": "2026-10-29T10:00:00Z"}), "paused_until")
    assert 'send "paused": true with it' in message
    message = refused(
        service.patch(f"{JOBS}{job['id']}/", {"paused": False, "paused_until": "2026-10-29T10:00:00Z"}),
        "paused_until",
    )
    assert "only a paused job" in message
    stored = Job.objects.get()
    assert not stored.paused and stored.paused_until is None


@time_machine.travel(FROZEN, tick=False)
def test_a_paused_until_that_has_passed_is_a_400_and_the_job_is_not_paused(service: Service) -> None:
    job = create(service)
    response = service.patch(f"{JOBS}{job['id']}/", {"paused": True, "paused_until": "2026-10-28T09:59:59Z"})
    message = refused(response, "paused_until")
    assert 'is not in the future; to resume the job now, send "paused": false' in message
    stored = Job.objects.get()
    assert not stored.paused and stored.paused_until is None
    assert not Run.objects.get().held


@time_machine.travel(FROZEN, tick=False)
def test_pausing_until_a_time_sets_both_and_resuming_by_hand_clears_it(service: Service) -> None:
    job = create(service)
    url = f"{JOBS}{job['id']}/"
    paused = service.patch(url, {"paused": True, "paused_until": "2026-10-29T10:00:00.250Z"})
    assert paused.status_code == 200, paused.content
    assert paused.json()["paused"] is True
    assert paused.json()["paused_until"] == "2026-10-29T10:00:01Z"  # whole seconds, rounded up
    assert Run.objects.get().held
    moved = service.patch(url, {"paused_until": "2026-10-30T10:00:00Z"}).json()  # already paused: just the time
    assert moved["paused_until"] == "2026-10-30T10:00:00Z" and moved["paused"] is True
    cleared = service.patch(url, {"paused_until": None}).json()
    assert cleared["paused_until"] is None and cleared["paused"] is True
    service.patch(url, {"paused_until": "2026-10-30T10:00:00Z"})
    resumed = service.patch(url, {"paused": False}).json()
    assert resumed["paused"] is False and resumed["paused_until"] is None
    assert Job.objects.get().paused_until is None


@time_machine.travel(FROZEN, tick=False)
def test_a_job_may_be_created_paused_until_a_time(service: Service) -> None:
    job = create(service, paused=True, paused_until="2026-10-28T12:00:00Z")
    assert job["paused"] is True and job["paused_until"] == "2026-10-28T12:00:00Z" and job["state"] == "paused"


def test_the_openapi_schema_describes_the_lifecycle_fields(service: Service) -> None:
    schema = service.get("/api/schema/", format="json").json()
    job = schema["components"]["schemas"]["Job"]["properties"]
    assert "buffer_one" in job["overlap"]["description"] and "allow (runs may overlap" in job["overlap"]["description"]
    assert "pauses itself" in job["pause_after_failures"]["description"]
    assert "resumes by itself" in job["paused_until"]["description"]
