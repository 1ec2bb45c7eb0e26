"""Schedules in code (issue 20): `sync_jobs` over an app whose schedules.py defines
1,000 jobs, and code-owned jobs being read-only in the API and the admin."""
from __future__ import annotations

import time
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext, override_settings

from jobs import schedule
from jobs.models import AuditEntry, Job
from jobs.services import job_create, service_account_ensure
from runs.models import Run
from tests.codejobs import schedules as code_app
from tests.conftest import Service
from tests.jobs.conftest import row_counts
from tests.ops.conftest import person
from runs.ops import OPERATOR_GROUP

S = Run.Status
SOURCE = "tests.codejobs.schedules"
pytestmark = pytest.mark.django_db


@pytest.fixture
def code_service(db: None) -> Service:
    return Service(code_app.OWNER)


@pytest.fixture
def code_app_installed(code_service: Service) -> Iterator[None]:
    """The test app in INSTALLED_APPS for this test only."""
    with override_settings(INSTALLED_APPS=[*settings.INSTALLED_APPS, "tests.codejobs"]):
        yield


@pytest.fixture
def few(code_app_installed: None, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Three definitions instead of 1,000, for the tests about one thing each."""
    definitions = [code_app.definition(i) for i in range(3)]
    monkeypatch.setattr(code_app, "SCHEDULES", definitions)
    return definitions


def sync(*args: str) -> str:
    out = StringIO()
    call_command("sync_jobs", *args, stdout=out)
    return out.getvalue()


def code_jobs() -> dict[str, Job]:
    return {j.name: j for j in Job.objects.exclude(code_source="").exclude(state=Job.State.DELETED)}


def waiting_run(job: Job) -> Run:
    return Run.objects.get(job=job, status=S.SCHEDULED, is_backfill=False)


# --------------------------------------------------------------------------- 1,000 jobs


def test_sync_jobs_dry_runs_creates_changes_nothing_then_changes_and_prunes_exactly_two_of_1000(
    code_app_installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = time.monotonic()
    lap = lambda what: print(f"\n{what}: {time.monotonic() - started:.1f}s")  # noqa: E731
    # Dry run: the diff, nothing written.
    before = row_counts()
    out = sync("--dry-run")
    assert out.count("would create ") == 1000
    assert f"would create code-service/report-0000 ({SOURCE})" in out
    assert out.strip().endswith("dry run, nothing written: 1000 to create, 0 to change, 0 unchanged, 0 to prune")
    assert row_counts() == before
    lap("dry run")

    # First run: 1,000 jobs, each with its first run, in a bounded number of queries.
    with CaptureQueriesContext(connection) as queries:
        out = sync()
    assert out.strip().endswith("1000 created, 0 changed, 0 unchanged, 0 pruned")
    assert len(queries) < 60, f"{len(queries)} queries for 1,000 jobs"  # bulk: not one (or more) per job
    jobs = code_jobs()
    assert len(jobs) == 1000
    assert {j.code_source for j in jobs.values()} == {SOURCE}
    sample = jobs["report-0007"]
    assert (sample.schedule, sample.timezone, sample.window_seconds, sample.retry_max) == (
        "7 7 * * *", "Europe/Paris", 0, 2
    )
    assert sample.payload == {"report": 7} and sample.target == "https://reports.internal/rebuild/7"
    assert Run.objects.filter(job__code_source=SOURCE, status=S.SCHEDULED, is_backfill=False).count() == 1000
    first = waiting_run(sample)
    assert first.scheduled_for == schedule.next_cron_time("7 7 * * *", "Europe/Paris", sample.created_at)
    assert AuditEntry.objects.filter(action="created", via="command", detail__source=SOURCE).count() == 1000

    lap("first run")
    # Second run: nothing changes, and it says so.
    stamps = dict(Job.objects.values_list("pk", "updated_at"))
    counts = row_counts()
    with CaptureQueriesContext(connection) as queries:
        out = sync()
    assert out.strip() == "nothing to change: 1000 unchanged"
    assert len(queries) < 10
    assert row_counts() == counts and dict(Job.objects.values_list("pk", "updated_at")) == stamps

    lap("second run")
    # One schedule changed, one job removed from the code; --prune changes exactly those two.
    changed, removed = jobs["report-0005"], jobs["report-0999"]
    definitions = [code_app.definition(i) for i in range(999)]
    definitions[5] = code_app.definition(5, schedule="*/15 * * * *")
    monkeypatch.setattr(code_app, "SCHEDULES", definitions)
    out = sync("--prune")
    assert f"change {changed.public_id} code-service/report-0005:\n    schedule: '5 5 * * *' -> '*/15 * * * *'\n" in out
    assert f"prune {removed.public_id} code-service/report-0999 (no longer defined in {SOURCE})" in out
    assert out.strip().endswith("0 created, 1 changed, 998 unchanged, 1 pruned")

    after = {j.pk: j for j in Job.objects.all()}
    assert {pk for pk, j in after.items() if j.updated_at != stamps[pk]} == {changed.pk, removed.pk}
    assert after[changed.pk].schedule == "*/15 * * * *" and after[changed.pk].state == Job.State.ACTIVE
    assert after[removed.pk].state == Job.State.DELETED
    assert not Run.objects.filter(job=removed, status__in=Run.OPEN).exists()
    # The changed job's waiting run follows the new schedule, from the edit on.
    edited_at = after[changed.pk].timing_changed_at
    assert edited_at is not None
    assert waiting_run(changed).scheduled_for == schedule.next_cron_time("*/15 * * * *", "Europe/Paris", edited_at)
    assert Run.objects.filter(job=changed, status=S.CANCELLED).count() == 1  # the old waiting run
    assert (waiting_run(sample).pk, waiting_run(sample).scheduled_for) == (first.pk, first.scheduled_for)  # others: as they were
    assert list(AuditEntry.objects.filter(action__in=("changed", "deleted")).values_list("action", "object_id")) in (
        [("changed", changed.public_id), ("deleted", removed.public_id)],
        [("deleted", removed.public_id), ("changed", changed.public_id)],
    )
    assert sync("--prune").strip() == "nothing to change: 999 unchanged"
    print(f"\n1,000-job sync_jobs test: {time.monotonic() - started:.1f}s")  # noted in docs/schedules-in-code.md


# --------------------------------------------------------------------------- the command, one thing at a time


@pytest.mark.embedded
def test_a_first_and_second_sync_on_the_embedded_defaults_create_then_change_nothing(few: list[Any]) -> None:
    assert sync().strip().endswith("3 created, 0 changed, 0 unchanged, 0 pruned")
    assert sync().strip() == "nothing to change: 3 unchanged"
    assert len(code_jobs()) == 3


def test_a_job_no_longer_defined_is_kept_and_listed_without_prune(few: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    sync()
    gone = code_jobs()["report-0002"]
    monkeypatch.setattr(code_app, "SCHEDULES", few[:2])
    out = sync()
    assert f"not defined any more: {gone.public_id} code-service/report-0002 (kept; --prune deletes it)" in out
    assert out.strip().endswith("nothing to change: 2 unchanged")
    assert Job.objects.get(pk=gone.pk).state == Job.State.ACTIVE


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"schedule": "61 * * * *"}, "job 'report-0001' (owner 'code-service'): schedule: "),
        ({"timezone": "Mars/Olympus"}, "job 'report-0001' (owner 'code-service'): timezone: "),
        ({"retry": {"max": 1, "base": "1h", "cap": "1m"}}, "job 'report-0001' (owner 'code-service'): retry.cap: "),
        ({"shedule": "0 2 * * *"}, "job 'report-0001' (owner 'code-service'): shedule: unknown field"),
        ({"paused": True}, "job 'report-0001' (owner 'code-service'): paused is an operator's switch"),
        ({"schedule": None, "delay": "10m"}, "job 'report-0001' (owner 'code-service'): delay is relative"),
    ],
)
def test_a_bad_definition_is_a_one_line_reason_naming_the_job_and_field_and_writes_nothing(
    few: list[Any], monkeypatch: pytest.MonkeyPatch, changes: dict[str, Any], words: str
) -> None:
    few[1] = code_app.definition(1, **changes)
    before = row_counts()
    with pytest.raises(CommandError) as refused:
        sync()
    message = str(refused.value)
    assert message.startswith(f"{SOURCE}: ") and words in message, message
    assert "\n" not in message
    assert row_counts() == before  # the two good definitions were not written either


def test_a_change_that_would_break_one_job_leaves_every_job_as_it_was(
    few: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sync()
    stamps = dict(Job.objects.values_list("pk", "updated_at"))
    changed = [code_app.definition(0, schedule="1 1 * * *"), code_app.definition(1, timezone="Nowhere/Else"), few[2]]
    monkeypatch.setattr(code_app, "SCHEDULES", changed)
    with pytest.raises(CommandError, match="report-0001.*timezone"):
        sync()
    assert dict(Job.objects.values_list("pk", "updated_at")) == stamps
    assert code_jobs()["report-0000"].schedule == "0 0 * * *"


def test_a_name_clash_with_a_hand_made_job_is_refused_with_the_reason(few: list[Any], code_service: Service) -> None:
    hand_made = job_create(
        owner=code_service.user, fields={"name": "report-0001", "schedule": "0 3 * * *", "target": "https://x.test/"}
    )
    with pytest.raises(CommandError) as refused:
        sync()
    assert f"{hand_made.public_id} already has this name and was made by hand" in str(refused.value)
    assert Job.objects.count() == 1
    hand_made.refresh_from_db()
    assert hand_made.code_source == "" and hand_made.schedule == "0 3 * * *"


def test_an_owner_that_is_not_a_service_account_is_refused(few: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_app, "SCHEDULES", [*few, code_app.job("x", owner="nobody", schedule="0 1 * * *",
                                                                   target="https://x.test/")])
    with pytest.raises(CommandError, match="owner 'nobody' is not a service account"):
        sync()
    assert Job.objects.count() == 0


def test_prune_with_no_definitions_at_all_is_refused_and_deletes_nothing(
    few: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    sync()
    monkeypatch.setattr(code_app, "SCHEDULES", [])
    with pytest.raises(CommandError, match="refusing to --prune every code-owned job"):
        sync("--prune")
    assert len(code_jobs()) == 3


def test_the_same_name_twice_for_one_owner_is_refused(few: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(code_app, "SCHEDULES", [*few, code_app.definition(1, schedule="0 9 * * *")])
    with pytest.raises(CommandError, match="report-0001.*defined twice"):
        sync()


def test_headers_changes_show_secret_values_only_as_changed(few: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    few[0] = code_app.definition(0, headers={"Authorization": "Bearer one", "X-Team": "reports"})
    sync()
    few[0] = code_app.definition(0, headers={"Authorization": "Bearer two", "X-Team": "reports"})
    out = sync()
    assert "    secret header values: changed\n" in out and "Bearer" not in out
    job = code_jobs()["report-0000"]
    from jobs.secrets import decrypt_headers

    assert decrypt_headers(job.secret_headers) == {"Authorization": "Bearer two"}
    assert sync().strip() == "nothing to change: 3 unchanged"
    few[0] = code_app.definition(0)  # headers gone from the code: gone from the job
    out = sync()
    assert "    headers: {" in out and "'Authorization': '***'" in out and "} -> {}\n" in out
    assert code_jobs()["report-0000"].headers == {} and code_jobs()["report-0000"].secret_headers == ""


def test_a_field_removed_from_the_definition_goes_back_to_its_default(few: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    few[0] = code_app.definition(0, retry={"max": 4, "base": "1m"}, misfire="skip")
    sync()
    few[0] = code_app.definition(0, retry={"max": 4})
    out = sync()
    assert "    retry: {'max': 4, 'backoff': 'exponential', 'base': '1m', 'cap': '1h'} -> " in out
    assert "    misfire: 'skip' -> 'run_once'" in out
    job = code_jobs()["report-0000"]
    assert (job.retry_base_seconds, job.misfire) == (10, "run_once")


def test_a_pause_by_an_operator_survives_the_next_sync(few: list[Any], code_service: Service) -> None:
    sync()
    job = code_jobs()["report-0000"]
    response = code_service.patch(f"/api/jobs/{job.public_id}/", {"paused": True})
    assert response.status_code == 200 and response.json()["paused"] is True
    assert sync().strip() == "nothing to change: 3 unchanged"
    assert Job.objects.get(pk=job.pk).paused


# --------------------------------------------------------------------------- read-only elsewhere


def test_the_api_refuses_to_change_or_delete_a_code_owned_job_but_pauses_and_runs_it(
    few: list[Any], code_service: Service
) -> None:
    sync()
    job = code_jobs()["report-0000"]
    url = f"/api/jobs/{job.public_id}/"
    reason = f"{job.public_id} is defined in code by {SOURCE}; change it there and run sync_jobs"

    patched = code_service.patch(url, {"schedule": "0 9 * * *"})
    deleted = code_service.delete(url)
    assert (patched.status_code, patched.json()) == (409, {"detail": reason})
    assert (deleted.status_code, deleted.json()) == (409, {"detail": reason})
    mixed = code_service.patch(url, {"paused": True, "window": "1m"})
    assert mixed.status_code == 409
    job.refresh_from_db()
    assert job.schedule == "0 0 * * *" and job.state == Job.State.ACTIVE and not job.paused

    assert code_service.get(url).json()["defined_in"] == SOURCE
    assert code_service.patch(url, {"paused": True}).json()["state"] == "paused"
    assert code_service.patch(url, {"paused": False}).json()["state"] == "active"
    assert code_service.post(f"{url}run/", None).status_code == 201


def test_a_hand_made_job_says_it_is_not_defined_in_code(service: Service) -> None:
    body = service.post("/api/jobs/", {"schedule": "0 1 * * *", "target": "https://x.test/"}).json()
    assert body["defined_in"] is None


@pytest.fixture
def operator_client(db: None) -> Client:
    client = Client()
    client.force_login(person("olga-operator", OPERATOR_GROUP))
    return client


def test_the_admin_shows_a_code_owned_job_read_only_and_refuses_its_change_form_and_delete(
    few: list[Any], operator_client: Client
) -> None:
    sync()
    job = code_jobs()["report-0000"]
    page = f"/admin/jobs/job/{job.pk}/change/"
    reason = f"{job.public_id} is defined in code by {SOURCE}; change it there and run sync_jobs"

    listing = operator_client.get("/admin/jobs/job/", {"code": "yes"})
    assert job in listing.context["cl"].result_list
    assert f'<small class="code-source">defined in code: {SOURCE}</small>' in listing.content.decode()

    shown = operator_client.get(page)
    assert shown.status_code == 200 and not shown.context["has_change_permission"]
    assert 'name="schedule"' not in shown.content.decode()  # no editable field: read-only
    assert f"{reason}." in [str(m) for m in shown.context["messages"]]

    posted = operator_client.post(page, {"name": job.name, "schedule": "0 9 * * *", "target": job.target}, follow=True)
    assert f"Not saved: {reason}." in [str(m) for m in posted.context["messages"]]
    job.refresh_from_db()
    assert job.schedule == "0 0 * * *"

    deleted = operator_client.post(
        "/admin/jobs/job/", {"action": "delete_jobs", "_selected_action": [job.pk]}, follow=True
    )
    assert f"Skipped {reason}." in [str(m) for m in deleted.context["messages"]]
    assert Job.objects.get(pk=job.pk).state == Job.State.ACTIVE

    paused = operator_client.post("/admin/jobs/job/", {"action": "pause_jobs", "_selected_action": [job.pk]})
    assert paused.status_code == 302 and Job.objects.get(pk=job.pk).paused


def test_a_hand_made_service_job_stays_editable_in_the_admin(operator_client: Client) -> None:
    owner, _ = service_account_ensure(name="reports")
    job = job_create(owner=owner, fields={"name": "n", "schedule": "0 1 * * *", "target": "https://x.test/"})
    assert operator_client.get(f"/admin/jobs/job/{job.pk}/change/").context["has_change_permission"]
