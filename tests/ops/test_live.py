"""The run page's live view (staff JSON under /admin/), the workers' heartbeats on the
system page, the titles, and the CSRF 403 that says why."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from runs import events, workers
from runs.models import Run, WorkerHeartbeat
from tests.factories import make_run
from tests.ops.conftest import ago, new_job

pytestmark = pytest.mark.django_db
S = Run.Status


def test_the_live_view_gives_the_run_its_timeline_and_the_next_run(viewer_client: Client, owner: Any) -> None:
    job = new_job(owner)
    run = make_run(job, ago(minutes=5), status=S.SUCCEEDED, attempt=1, fence=1, is_backfill=False,
                   started_at=ago(minutes=5), finished_at=ago(minutes=4))
    nxt = Run.objects.get(job=job, status=S.SCHEDULED)
    for kind, extra in (("queued", {}), ("claimed", {"fence": 1, "worker": "w1@box/1/2"}),
                        ("target_answered", {"fence": 1, "status": 200, "duration_ms": 12}), ("succeeded", {"fence": 1})):
        events.record(run.pk, kind, timezone.now(), **extra)
    response = viewer_client.get(f"/admin/runs/run/{run.pk}/live/")
    assert response.status_code == 200 and response["Content-Type"] == "application/json"
    body = response.json()
    assert body["status"] == "succeeded" and body["open"] is False and body["fence"] == 1
    assert [e["type"] for e in body["events"]] == ["queued", "claimed", "target_answered", "succeeded"]
    assert body["events"][1]["worker"] == "w1@box/1/2" and body["events"][2]["answer"] == "HTTP 200 in 12 ms"
    assert body["next_run"]["id"] == nxt.public_id


def test_the_live_view_needs_a_staff_session(owner: Any) -> None:
    run = make_run(new_job(owner), ago(minutes=5), is_backfill=True)
    response = Client().get(f"/admin/runs/run/{run.pk}/live/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]


def test_the_run_page_is_titled_for_the_run_and_loads_the_live_script(viewer_client: Client, owner: Any) -> None:
    job = new_job(owner)
    run = make_run(job, ago(minutes=5), status=S.QUEUED, is_backfill=True)
    page = viewer_client.get(f"/admin/runs/run/{run.pk}/change/").content.decode()
    assert f"<h1>Run {run.public_id} of {job.public_id} nightly-report</h1>" in page
    assert "Change run" not in page and "Django administration" not in page
    assert f"<title>{run.public_id} queued | Run {run.public_id} of" in page and "| Scheduler admin</title>" in page
    assert 'src="/static/scheduler/live.js"' in page and f'data-live-url="/admin/runs/run/{run.pk}/live/"' in page
    assert '<span id="run-status"><span class="badge badge-queued">queued</span></span>' in page


def test_the_job_page_links_to_its_runs_its_latest_outcome_and_its_latest_run(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    dead = make_run(job, ago(days=1), status=S.DEAD, is_backfill=True, finished_at=ago(hours=23))
    page = operator_client.get(f"/admin/jobs/job/{job.pk}/change/").content.decode()
    assert f'href="/admin/runs/run/?job={job.public_id}"' in page
    assert f'{dead.public_id}</a>\n      <span class="badge badge-dead">dead</span>' in page
    latest = Run.objects.get(job=job, status=S.SCHEDULED)
    assert f'data-live-url="/admin/runs/run/{latest.pk}/live/"' in page


def test_plural_names_are_right(operator_client: Client) -> None:
    from django.contrib.auth import get_user_model

    get_user_model().objects.filter(username="olga-operator").update(is_superuser=True)
    page = operator_client.get("/admin/").content.decode()
    assert "Audit entries" in page and "entrys" not in page


def test_a_worker_heartbeat_shows_on_the_system_page_with_its_runs_in_flight(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    make_run(job, ago(minutes=1), status=S.RUNNING, is_backfill=True, lease_owner="w1@box/123/4",
             lease_expires_at=timezone.now() + timedelta(minutes=1))
    make_run(job, ago(minutes=2), status=S.RUNNING, is_backfill=True, lease_owner="w10@box/9/4",
             lease_expires_at=timezone.now() + timedelta(minutes=1))
    workers.worker_beat(name="w1@box", host="box", started_at=ago(minutes=10))
    WorkerHeartbeat.objects.create(name="w2@old", host="old", started_at=ago(hours=2), beat_at=ago(minutes=5))
    page = operator_client.get("/admin/system/").content.decode()
    assert WorkerHeartbeat.objects.get(name="w1@box").in_flight == 1  # w10@box's run is not w1's
    assert '<tr class="worker-alive">\n        <td><code>w1@box</code></td><td>box</td>' in page
    assert '<tr class="worker-gone">\n        <td><code>w2@old</code></td>' in page
    assert "no heartbeat" in page
    workers.worker_stopped(name="w1@box")
    assert "stopped" in operator_client.get("/admin/system/").content.decode()


@override_settings(CSRF_COOKIE_SECURE=True, SESSION_COOKIE_SECURE=True)
def test_a_csrf_failure_over_plain_http_with_secure_cookies_names_the_settings(operator: Any) -> None:
    client = Client(enforce_csrf_checks=True)
    response = client.post("/admin/login/", {"username": "x", "password": "y"})
    assert response.status_code == 403
    page = response.content.decode()
    assert "SCHEDULER_SECURE_COOKIES" in page and "SCHEDULER_BEHIND_TLS_PROXY" in page
    assert 'id="csrf-secure-cookies"' in page and "plain http" in page
