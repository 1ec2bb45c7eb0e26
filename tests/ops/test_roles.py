"""Who may do what: the read-only group sees and cannot act; service accounts cannot log in."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from jobs.models import Job
from runs.models import Run
from tests.ops.conftest import ago, dead_run, new_job

pytestmark = pytest.mark.django_db
S = Run.Status


def test_a_read_only_user_sees_jobs_and_runs_without_any_action(viewer_client: Client, owner: Any) -> None:
    job = new_job(owner)
    run = dead_run(job, ago(days=1))
    for url in ("/admin/jobs/job/", "/admin/runs/run/"):
        response = viewer_client.get(url)
        assert response.status_code == 200 and response.context["action_form"] is None, url
    page = viewer_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert "Timeline" in page and "Requeue" not in page and "Mark handled" not in page
    job_page = viewer_client.get(f"/admin/jobs/job/{job.pk}/change/")
    assert job_page.status_code == 200 and "every day at 02:00 Asia/Kolkata" in job_page.content.decode()
    assert viewer_client.get("/admin/system/").status_code == 200


def test_a_read_only_users_action_urls_are_refused(viewer_client: Client, owner: Any) -> None:
    job = new_job(owner)
    run = dead_run(job, ago(days=1))
    response = viewer_client.post("/admin/jobs/job/", {"action": "pause_jobs", "_selected_action": [job.pk]})
    job.refresh_from_db()
    assert not job.paused  # an action the user may not run is not an action at all
    assert response.status_code in (200, 302)
    viewer_client.post("/admin/runs/run/", {"action": "requeue_dead_runs", "_selected_action": [run.pk]})
    assert viewer_client.post(f"/admin/runs/run/{run.pk}/requeue/").status_code == 403
    assert viewer_client.post(f"/admin/runs/run/{run.pk}/handled/").status_code == 403
    assert viewer_client.post(f"/admin/jobs/job/{job.pk}/change/", {"name": "renamed"}).status_code == 403
    assert viewer_client.get("/admin/jobs/job/add/").status_code == 403
    assert viewer_client.post("/admin/runs/pausedtarget/add/", {"host": "reports.internal"}).status_code == 403
    run.refresh_from_db()
    job.refresh_from_db()
    assert run.status == S.DEAD and run.handled_at is None and job.name == "nightly-report"


def test_an_operator_sees_the_actions(operator_client: Client, owner: Any) -> None:
    new_job(owner)
    choices = dict(operator_client.get("/admin/jobs/job/").context["action_form"].fields["action"].choices)
    assert {"pause_jobs", "resume_jobs", "run_jobs_now", "delete_jobs"} <= set(choices)
    assert "delete_selected" not in choices


def test_a_service_token_cannot_log_into_the_admin(owner: Any) -> None:
    from jobs.tokens import token_issue

    token = token_issue(user=owner)
    client = Client()
    response = client.post("/admin/login/", {"username": owner.username, "password": token})
    assert response.status_code == 200 and "Please enter the correct username and password" in response.content.decode()
    assert not owner.has_usable_password() and not owner.is_staff
    # Even with a session forced on it, the admin sends a service account back to the login page.
    client.force_login(owner)
    assert client.get("/admin/").status_code == 302
    assert client.get("/admin/jobs/job/").status_code == 302
    # And a token on the admin is not a login either.
    header = Client(HTTP_AUTHORIZATION=f"Token {token}")
    assert header.get("/admin/jobs/job/").status_code == 302


def test_anonymous_is_sent_to_login_for_the_system_page() -> None:
    response = Client().get("/admin/system/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert Job.objects.count() == 0
