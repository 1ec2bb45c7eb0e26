"""The job admin: the list an operator reads, its actions, and an edit page that
checks like the API and writes through the services."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from jobs.models import AuditEntry, Job
from runs.models import Run
from tests.ops.conftest import ago, dead_run, new_job

pytestmark = pytest.mark.django_db
S = Run.Status
LIST = "/admin/jobs/job/"


def act(client: Client, action: str, *jobs: Job) -> Any:
    return client.post(LIST, {"action": action, "_selected_action": [j.pk for j in jobs]}, follow=True)


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def test_the_job_list_shows_the_schedule_in_words_next_run_in_both_zones_and_last_outcome(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    dead_run(job, ago(days=2))
    page = operator_client.get(LIST).content.decode()
    page = page.replace("<wbr>", "")  # the date and the time may wrap apart
    assert "every day at 02:00 Asia/Kolkata" in page
    nxt = Run.objects.get(job=job, status=S.SCHEDULED)
    assert nxt.scheduled_for.strftime("%Y-%m-%dT%H:%M:%SZ") in page  # UTC (20:30Z the day before)
    assert nxt.scheduled_for.strftime("%H:%M") == "20:30" and "02:00 IST" in page  # the job's zone
    assert 'field-target_host">reports.internal<' in page
    assert 'field-last_outcome"><span class="badge badge-dead">dead</span><' in page  # red
    assert 'field-owner nowrap">reports<' in page
    assert 'field-state_badge"><span class="badge badge-active">Active</span><' in page
    assert f'?job={job.public_id}">runs</a>' in page  # the job's runs, one click away


def test_a_one_off_job_shows_its_time(operator_client: Client, owner: Any) -> None:
    new_job(owner, schedule="", run_at=ago(hours=-5), timezone="Europe/Paris", name="once")
    assert "once at " in operator_client.get(LIST).content.decode()


@pytest.mark.parametrize("term", ["job_{pk}", "{pk}", "nightly", "reports.internal"])
def test_search_finds_a_job_by_id_name_or_target(operator_client: Client, owner: Any, term: str) -> None:
    job = new_job(owner)
    other = new_job(owner, name="billing-sync", target="https://billing.internal/sync")
    response = operator_client.get(LIST, {"q": term.format(pk=job.pk)})
    shown = list(response.context["cl"].result_list)
    assert job in shown and other not in shown


def test_the_filters_narrow_by_host_paused_and_misfire(operator_client: Client, owner: Any) -> None:
    job = new_job(owner, misfire="skip")
    other = new_job(owner, target="https://billing.internal:8443/sync", paused=True)
    for params, expected in [
        ({"host": "reports.internal"}, job),
        ({"host": "billing.internal:8443"}, other),
        ({"paused__exact": "1"}, other),
        ({"misfire__exact": "skip"}, job),
    ]:
        assert list(operator_client.get(LIST, params).context["cl"].result_list) == [expected], params


def test_pause_and_resume_actions_call_the_services_and_say_what_they_did(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    response = act(operator_client, "pause_jobs", job)
    assert messages_of(response) == [f"Paused 1 job: {job.public_id}."]
    job.refresh_from_db()
    assert job.paused and job.state == Job.State.PAUSED and Run.objects.get(job=job).held
    assert "Skipped" in messages_of(act(operator_client, "pause_jobs", job))[0]
    assert messages_of(act(operator_client, "resume_jobs", job)) == [f"Resumed 1 job: {job.public_id}."]
    job.refresh_from_db()
    assert not job.paused and not Run.objects.get(job=job).held
    assert list(AuditEntry.objects.filter(object_id=job.public_id).values_list("action", "via")) == [
        ("resumed", "admin"),
        ("paused", "admin"),
    ]


def test_run_now_makes_an_extra_run(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    response = act(operator_client, "run_jobs_now", job)
    extra = Run.objects.get(job=job, is_backfill=True)
    assert f"Made run {extra.public_id} of {job.public_id}, due at" in messages_of(response)[0]
    assert extra.events.filter(type="triggered", detail__by="olga-operator").exists()


def test_run_now_on_a_paused_job_says_why_it_did_not_run(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    act(operator_client, "pause_jobs", job)
    response = act(operator_client, "run_jobs_now", job)
    assert messages_of(response) == [f"Not run now: {job.public_id} is paused; resume it first."]
    assert not Run.objects.filter(job=job, is_backfill=True).exists()


def test_delete_ends_the_job_and_keeps_its_history(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    act(operator_client, "delete_jobs", job)
    job.refresh_from_db()
    assert job.state == Job.State.DELETED and Run.objects.get(job=job).status == S.CANCELLED
    assert operator_client.get(f"{LIST}{job.pk}/delete/").status_code == 403  # no row deletes


def form_data(client: Client, job: Job, **changes: Any) -> dict[str, Any]:
    form = client.get(f"{LIST}{job.pk}/change/").context["adminform"].form
    data = {name: form.initial.get(name, "") for name in form.fields}
    for name in ("headers", "payload"):
        data[name] = form.fields[name].prepare_value(data[name]) if data[name] is not None else "null"
    data["paused"] = "on" if data["paused"] else ""
    data.update(changes)
    return {k: v for k, v in data.items() if v != ""}


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("schedule", "0 25 * * *", "is not a valid cron expression"),
        ("timezone", "Mars/Olympus", "unknown time zone"),
        ("window", "5 minutes", "is not a duration"),
        ("target", "ftp://x/y", "must start with http:// or https://, not ftp:"),
        ("retry_cap", "1s", "must be at least base"),
    ],
)
def test_a_bad_field_on_the_edit_page_is_a_form_error_in_the_apis_words(
    operator_client: Client, owner: Any, field: str, value: str, words: str
) -> None:
    job = new_job(owner)
    response = operator_client.post(f"{LIST}{job.pk}/change/", form_data(operator_client, job, **{field: value}))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert words in " ".join(errors.get(field, [])), errors
    job.refresh_from_db()
    assert job.schedule == "0 2 * * *" and job.timezone == "Asia/Kolkata"


def test_an_edit_goes_through_job_update_and_replaces_the_waiting_run(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    before = Run.objects.get(job=job, status=S.SCHEDULED)
    response = operator_client.post(f"{LIST}{job.pk}/change/", form_data(operator_client, job, schedule="30 3 * * *"))
    assert response.status_code == 302, response.context["adminform"].form.errors
    job.refresh_from_db()
    assert job.schedule == "30 3 * * *"
    before.refresh_from_db()
    assert before.status == S.CANCELLED
    assert Run.objects.get(job=job, status=S.SCHEDULED).scheduled_for.strftime("%H:%M") == "22:00"  # 03:30 IST


def test_the_edit_page_previews_the_next_five_times_in_the_jobs_zone_and_utc(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    page = operator_client.get(f"{LIST}{job.pk}/change/").content.decode()
    assert page.count("02:00 IST") >= 5 and page.count("T20:30:00Z") >= 5


def test_the_add_page_creates_the_job_and_its_first_run(operator_client: Client, owner: Any) -> None:
    data = {
        "owner": owner.pk,
        "name": "hourly",
        "schedule": "5 * * * *",
        "timezone": "UTC",
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
    response = operator_client.post(f"{LIST}add/", data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    job = Job.objects.get(name="hourly")
    assert job.owner == owner and Run.objects.filter(job=job, status=S.SCHEDULED).count() == 1
    bad = operator_client.post(f"{LIST}add/", {**data, "schedule": "", "name": "no-timing"})
    assert "one of schedule" in str(bad.context["adminform"].form.errors)


def test_the_edit_page_shows_and_saves_overlap_pause_after_failures_and_paused_until(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    page = operator_client.get(f"{LIST}{job.pk}/change/").content.decode()
    assert 'name="overlap"' in page and 'name="pause_after_failures"' in page and 'name="paused_until"' in page
    assert '<option value="allow"' in page  # the admin offers every overlap policy
    response = operator_client.post(
        f"{LIST}{job.pk}/change/",
        form_data(operator_client, job, overlap="buffer_one", pause_after_failures="4", paused="on",
                  paused_until="2099-01-01T00:00:00Z"),
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    job.refresh_from_db()
    assert (job.overlap, job.pause_after_failures, job.paused) == ("buffer_one", 4, True)
    assert job.paused_until is not None and job.paused_until.year == 2099
    page = operator_client.get(f"{LIST}{job.pk}/change/").content.decode()
    assert "2099-01-01T00:00:00Z" in page


def test_paused_until_on_a_job_left_running_is_a_form_error_in_the_apis_words(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    response = operator_client.post(
        f"{LIST}{job.pk}/change/", form_data(operator_client, job, paused_until="2099-01-01T00:00:00Z")
    )
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert "only a paused job resumes by itself" in " ".join(errors.get("paused_until", [])), errors
    job.refresh_from_db()
    assert not job.paused and job.paused_until is None


def test_an_operator_moving_the_target_to_another_host_drops_the_secret_headers(
    operator_client: Client, owner: Any
) -> None:
    """An operator edited the target of a job holding `Authorization: Bearer ...` (shown
    as ***) to a URL of their choosing, and run now sent the secret there. An edit by
    anyone but the owning service that moves the target to another host drops them."""
    from jobs.secrets import decrypt_headers

    job = new_job(owner, headers={"Authorization": "Bearer beta-token", "X-Team": "reports"})
    data = form_data(operator_client, job, target="https://elsewhere.example/collect")
    assert "***" in data["headers"]
    response = operator_client.post(f"{LIST}{job.pk}/change/", data, follow=True)
    assert response.status_code == 200
    job.refresh_from_db()
    assert job.target == "https://elsewhere.example/collect"
    assert decrypt_headers(job.secret_headers) == {} and job.headers == {"X-Team": "reports"}
    assert any("secret headers were dropped" in str(m) for m in response.context["messages"])


def test_an_operator_edit_that_keeps_the_host_keeps_the_secret_headers(operator_client: Client, owner: Any) -> None:
    from jobs.secrets import decrypt_headers

    job = new_job(owner, headers={"Authorization": "Bearer beta-token"})
    response = operator_client.post(f"{LIST}{job.pk}/change/",
                                    form_data(operator_client, job, target="https://reports.internal/other"))
    assert response.status_code == 302
    job.refresh_from_db()
    assert decrypt_headers(job.secret_headers) == {"Authorization": "Bearer beta-token"}
