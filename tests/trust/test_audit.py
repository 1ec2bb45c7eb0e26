"""The audit log: every change through the API, the admin or a command says who,
what, when and from where; a service reads the entries about its own objects."""
from __future__ import annotations

import getpass
import socket
from typing import Any

import pytest
import time_machine
from django.contrib import admin
from django.core.management import call_command
from django.test import Client, RequestFactory
from rest_framework.test import APIClient

from jobs.audit import audit_record
from jobs.models import AuditEntry, Job
from tests.conftest import Service
from tests.factories import created_long_ago, make_job, make_run, utc

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
JOB = {"schedule": "0 2 * * *", "target": "https://reports.test/hook"}
FROZEN = "2026-10-28T10:00:00Z"


def entries(**filters: Any) -> list[tuple[str, str, str, str]]:
    rows = AuditEntry.objects.filter(**filters).order_by("at", "id")
    return [(e.actor, e.via, e.action, e.object_id) for e in rows]


@time_machine.travel(FROZEN, tick=False)
def test_every_api_change_is_audited_with_who_what_when_and_where(service: Service) -> None:
    job = service.post("/api/jobs/", {**JOB, "name": "nightly"}).json()
    path = f"/api/jobs/{job['id']}/"
    service.patch(path, {"name": "nightly-2", "window": "5m"})
    service.patch(path, {"paused": True})
    service.patch(path, {"paused": True})  # already paused: nothing changed, nothing to audit
    service.patch(path, {"paused": False, "timeout": "10s"})
    service.delete(path)
    service.delete(path)  # already deleted: 204 again, no second entry

    me, job_id = "reports", job["id"]
    assert entries(object_id=job_id) == [
        (me, "api", "created", job_id),
        (me, "api", "changed", job_id),
        (me, "api", "paused", job_id),
        (me, "api", "changed", job_id),
        (me, "api", "resumed", job_id),
        (me, "api", "deleted", job_id),
    ]
    created = AuditEntry.objects.filter(action="created").get()
    assert created.remote_addr == "127.0.0.1" and created.at == utc(FROZEN)
    assert created.detail == {"fields": ["name", "schedule", "target"]}
    assert AuditEntry.objects.get(action="changed", detail__fields=["name", "window"]).owner == service.user


def test_a_refused_change_leaves_no_audit_entry(service: Service) -> None:
    job = service.post("/api/jobs/", JOB).json()

    assert service.patch(f"/api/jobs/{job['id']}/", {"schedule": "0 25 * * *"}).status_code == 400
    assert service.post("/api/jobs/", {**JOB, "timezone": "Mars/Base"}).status_code == 400

    assert [e.action for e in AuditEntry.objects.all()] == ["created"]


def test_a_service_reads_the_entries_about_its_own_objects_only(
    service: Service, other_service: Service, staff_client: APIClient
) -> None:
    mine = service.post("/api/jobs/", JOB).json()
    theirs = other_service.post("/api/jobs/", JOB).json()

    listed = service.get("/api/audit/").json()
    assert [(e["action"], e["object_id"], e["actor"], e["via"]) for e in listed["results"]] == [
        ("created", mine["id"], "reports", "api")
    ]
    assert set(listed["results"][0]) == {"at", "actor", "via", "action", "object_type", "object_id", "remote_addr",
                                         "detail"}
    assert listed["results"][0]["at"].endswith("Z")
    assert service.get("/api/audit/", object=theirs["id"]).json()["count"] == 0
    everything = staff_client.get("/api/audit/").json()
    assert {e["object_id"] for e in everything["results"]} == {mine["id"], theirs["id"]}
    assert staff_client.get("/api/audit/", {"object": theirs["id"]}).json()["count"] == 1


def test_entries_about_a_run_are_the_owners_too(service: Service) -> None:
    job = make_job(owner=service.user)
    run = make_run(job, utc("2026-01-01T02:00:00Z"))

    entry = audit_record(actor="ops-person", via="admin", action="requeued", obj=run, remote_addr="10.0.0.9")

    assert (entry.object_type, entry.object_id, entry.owner) == ("run", run.public_id, service.user)
    assert service.get("/api/audit/").json()["results"][0]["object_id"] == run.public_id


def test_an_admin_edit_is_audited_with_the_persons_name(superuser: Any, service: Service) -> None:
    job = make_job(owner=service.user)
    request = RequestFactory().post("/admin/jobs/job/1/change/", REMOTE_ADDR="10.1.2.3")
    request.user = superuser
    model_admin = admin.site._registry[Job]

    model_admin.log_change(request, job, [{"changed": {"fields": ["Name"]}}])

    [entry] = AuditEntry.objects.all()
    assert (entry.actor, entry.via, entry.action, entry.object_id) == ("root-person", "admin", "changed", job.public_id)
    assert entry.owner == service.user and "Name" in entry.detail["message"]


def test_the_audit_log_in_the_admin_is_read_only(superuser: Any, service: Service) -> None:
    service.post("/api/jobs/", JOB)
    entry = AuditEntry.objects.get()
    browser = Client()
    browser.force_login(superuser)

    listing = browser.get("/admin/jobs/auditentry/")
    page = browser.get(f"/admin/jobs/auditentry/{entry.pk}/change/")

    assert listing.status_code == 200 and b"reports" in listing.content
    assert page.status_code == 200 and b'name="_save"' not in page.content
    assert browser.get("/admin/jobs/auditentry/add/").status_code == 403
    assert browser.post(f"/admin/jobs/auditentry/{entry.pk}/delete/").status_code == 403


def test_commands_are_audited_with_the_os_user_and_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    call_command("create_service_token", "reports")
    call_command("create_service_token", "reports")
    call_command("rotate_signing_secret", "reports")
    call_command("rotate_service_token", "reports")
    call_command("revoke_service_token", "reports")

    assert [(e.action, e.object_type, e.object_id) for e in AuditEntry.objects.order_by("id")] == [
        ("created", "service", "reports"),
        ("token_created", "service", "reports"),  # each token made is audited (by prefix)
        ("token_created", "service", "reports"),
        ("signing_secret_rotated", "service", "reports"),
        ("token_rotated", "service", "reports"),
        ("token_revoked", "service", "reports"),
    ]
    for entry in AuditEntry.objects.all():
        assert entry.via == "command" and entry.actor == getpass.getuser()
        assert entry.remote_addr == socket.gethostname()[:64]


def test_a_backfill_is_audited(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    job = created_long_ago(make_job(owner=service.user, schedule="0 * * * *"))

    call_command("backfill", job.public_id, "--since", "2026-01-01T00:00:00Z", "--until", "2026-01-01T03:00:00Z")

    entry = AuditEntry.objects.get(action="backfilled")
    assert entry.object_id == job.public_id and entry.via == "command" and entry.detail["runs"] == 3


def test_audit_record_refuses_an_unknown_channel_and_object() -> None:
    with pytest.raises(ValueError, match="via must be one of"):
        audit_record(actor="x", via="email", action="changed", obj="host")
    with pytest.raises(TypeError, match="cannot audit"):
        audit_record(actor="x", via="api", action="changed", obj=42)
