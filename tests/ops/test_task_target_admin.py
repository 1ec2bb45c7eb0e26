"""Celery task targets in the admin: the job form's Target fieldset, and a service's
task prefixes on its account page."""
from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from jobs.models import Job, ServiceAccount
from jobs.services import service_tasks_grant
from runs.models import Run

pytestmark = pytest.mark.django_db
LIST = "/admin/jobs/job/"


def form(owner: Any, **changes: Any) -> dict[str, Any]:
    data = {
        "owner": owner.pk, "name": "task-job", "schedule": "5 * * * *", "timezone": "UTC", "window": "0s",
        "misfire": "run_once", "target": "", "task": "reports.tasks.rebuild", "args": "[1]", "kwargs": '{"a": 2}',
        "queue": "reports", "method": "POST", "headers": "{}", "payload": "null", "retry_max": "3",
        "retry_backoff": "exponential", "retry_base": "10s", "retry_cap": "1h", "timeout": "30s",
    }
    data.update(changes)
    return data


def test_the_add_page_creates_a_task_job_for_a_service_granted_the_task(operator_client: Client, owner: Any) -> None:
    service_tasks_grant(name="reports", prefixes=["reports."])
    response = operator_client.post(f"{LIST}add/", form(owner))
    assert response.status_code == 302, response.context["adminform"].form.errors
    job = Job.objects.get(name="task-job")
    assert (job.task, job.target, job.args, job.kwargs, job.queue) == ("reports.tasks.rebuild", "", [1], {"a": 2},
                                                                        "reports")
    assert Run.objects.filter(job=job).count() == 1
    page = operator_client.get(LIST).content.decode()
    assert 'field-target_host">celery:reports<' in page


def test_the_add_page_refuses_a_task_the_owner_is_not_granted_in_the_apis_words(
    operator_client: Client, owner: Any
) -> None:
    response = operator_client.post(f"{LIST}add/", form(owner))
    assert response.status_code == 200
    assert "may name no Celery task" in str(response.context["adminform"].form.errors["task"])
    assert not Job.objects.filter(name="task-job").exists()


def test_the_add_page_refuses_both_a_target_and_a_task(operator_client: Client, owner: Any) -> None:
    service_tasks_grant(name="reports", prefixes=["reports."])
    response = operator_client.post(f"{LIST}add/", form(owner, target="https://r.internal/x"))
    errors = response.context["adminform"].form.errors
    assert "only one of target" in str(errors["target"]) and "only one of target" in str(errors["task"])


def test_a_task_jobs_edit_page_shows_and_saves_its_task_fields(operator_client: Client, owner: Any) -> None:
    service_tasks_grant(name="reports", prefixes=["reports."])
    operator_client.post(f"{LIST}add/", form(owner))
    job = Job.objects.get(name="task-job")
    page = operator_client.get(f"{LIST}{job.pk}/change/")
    initial = page.context["adminform"].form.initial
    assert (initial["task"], initial["queue"], initial["args"]) == ("reports.tasks.rebuild", "reports", [1])
    data = form(owner, queue="reports-slow")
    data.pop("owner")
    response = operator_client.post(f"{LIST}{job.pk}/change/", data)
    assert response.status_code == 302, response.context["adminform"].form.errors
    job.refresh_from_db()
    assert job.queue == "reports-slow" and job.task == "reports.tasks.rebuild"


def test_a_service_accounts_page_edits_its_task_prefixes_checked_like_grant_tasks(owner: Any) -> None:
    admin = get_user_model().objects.create_superuser("root-person", password="x")
    client = Client()
    client.force_login(admin)
    account = ServiceAccount.objects.get(user=owner)
    url = f"/admin/jobs/serviceaccount/{account.pk}/change/"
    assert client.post(url, {"task_prefixes": "reports., shared.tasks"}).status_code == 302
    account.refresh_from_db()
    assert account.task_prefixes == ["reports.", "shared.tasks"]
    bad = client.post(url, {"task_prefixes": "reports. bad-prefix"})
    assert "is not a task prefix" in str(bad.context["adminform"].form.errors["task_prefixes"])
    account.refresh_from_db()
    assert account.task_prefixes == ["reports.", "shared.tasks"]
    assert "reports., shared.tasks" in client.get("/admin/jobs/serviceaccount/").content.decode()
