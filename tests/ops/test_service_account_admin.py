"""A service account's default `notify`, set in the admin: checked like a job's."""
from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from jobs.models import ServiceAccount
from jobs.services import service_account_ensure

pytestmark = pytest.mark.django_db


def change(client: Client, service: ServiceAccount, notify: str) -> Any:
    return client.post(f"/admin/jobs/serviceaccount/{service.pk}/change/", {"notify": notify})


@pytest.mark.parametrize("notify", ["oncall@example.test", "https://hooks.example.test/dead"])
def test_a_service_accounts_default_notify_is_saved_from_the_admin(admin_client: Client, notify: str) -> None:
    user, _ = service_account_ensure(name="billing")
    response = change(admin_client, user.service, notify)
    assert response.status_code == 302, response.content[:2000]
    assert ServiceAccount.objects.get(user=user).notify == notify


@pytest.mark.parametrize("notify", ["http://hooks.example.test/dead", "the billing team", "https://169.254.169.254/"])
def test_a_bad_default_notify_is_refused_in_words_and_not_saved(admin_client: Client, notify: str) -> None:
    user, _ = service_account_ensure(name="billing")
    response = change(admin_client, user.service, notify)
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors["notify"]
    assert errors and errors[0].startswith("notify ")
    assert ServiceAccount.objects.get(user=user).notify == ""


def test_create_service_token_sets_the_default_notify_and_refuses_a_bad_one_in_words() -> None:
    from io import StringIO

    from django.core.management import CommandError, call_command

    call_command("create_service_token", "payments", "--notify", "https://hooks.example.test/dead", stdout=StringIO())
    assert ServiceAccount.objects.get(user__username="payments").notify == "https://hooks.example.test/dead"
    with pytest.raises(CommandError, match="^--notify must be an e-mail address or an https URL$"):
        call_command("create_service_token", "payments", "--notify", "http://hooks.example.test/dead")
    assert ServiceAccount.objects.get(user__username="payments").notify == "https://hooks.example.test/dead"


def test_the_notices_outbox_is_listed_read_only_in_the_admin(admin_client: Client) -> None:
    from runs.notices import notice_add
    from tests.factories import make_job

    job = make_job(notify="oncall@example.test")
    notice_add(job=job, kind="paused", reason="5 dead runs in a row")
    listing = admin_client.get("/admin/runs/notice/")
    assert listing.status_code == 200 and b"paused" in listing.content and b"pending" in listing.content
    assert admin_client.get("/admin/runs/notice/add/").status_code == 403
