"""`GET /api/breakers/`: a host shared by two services shows each one its state, but
failure text only from its own runs; staff see all."""
from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from runs.models import Run, TargetBreaker
from runs.services import run_execute
from tests.conftest import Service
from tests.factories import make_job, make_run

pytestmark = [pytest.mark.django_db(transaction=True)]
SECRET = "card-4111-1111-1111-1111-of-service-a"


class EchoingFailure(BaseHTTPRequestHandler):
    """A target in trouble that echoes the request it got in its 500 (as many do)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        answer = b"upstream failed for request: " + body
        self.send_response(500)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def shared_host() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), EchoingFailure)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def run_once(owner: Any, url: str, payload: Any) -> str:
    job = make_job(owner, target=url, payload=payload, retry_max=10, retry_base_seconds=1, retry_cap_seconds=2)
    now = timezone.now().replace(microsecond=0)
    run = make_run(job, now, status=Run.Status.QUEUED, queued_at=now)
    return run_execute(run_id=run.pk)


def breaker_rows(client: APIClient) -> list[dict[str, Any]]:
    response = client.get("/api/breakers/")
    assert response.status_code == 200
    return response.json()["results"]


@override_settings(SCHEDULER_BREAKER_FAILURES=2, SCHEDULER_BREAKER_COOLDOWN=60)
def test_a_shared_hosts_breaker_shows_another_services_failure_text_to_no_one_but_staff(
    service: Service, other_service: Service, shared_host: str
) -> None:
    # Service B calls the host too, and succeeded earlier: it may see the host's breaker.
    make_job(other_service.user, target=f"{shared_host}/b")
    # Service A's calls fail; the host echoes A's payload, secret and all.
    assert [run_once(service.user, f"{shared_host}/a", {"card": SECRET}) for _ in range(2)] == ["retry_scheduled"] * 2
    assert TargetBreaker.objects.get().state == TargetBreaker.State.OPEN
    assert SECRET in TargetBreaker.objects.get().last_error  # stored for whoever caused it

    theirs = breaker_rows(other_service.client)
    assert [(r["state"], r["failures"]) for r in theirs] == [("open", 2)]  # the host's state: shared
    assert SECRET not in json.dumps(theirs)
    assert theirs[0]["last_error"] == ""

    mine = breaker_rows(service.client)
    assert SECRET in mine[0]["last_error"]
    assert any(SECRET in json.dumps(t["detail"]) for t in mine[0]["history"])

    from jobs.tokens import token_issue

    staff = get_user_model().objects.create_user("ops-person", is_staff=True)
    ops = APIClient()
    ops.credentials(HTTP_AUTHORIZATION=f"Token {token_issue(user=staff)}")
    assert SECRET in breaker_rows(ops)[0]["last_error"]


@override_settings(SCHEDULER_BREAKER_FAILURES=2, SCHEDULER_BREAKER_COOLDOWN=60)
def test_a_services_own_failure_after_another_services_shows_its_own_text(
    service: Service, other_service: Service, shared_host: str
) -> None:
    run_once(service.user, f"{shared_host}/a", {"card": SECRET})
    run_once(other_service.user, f"{shared_host}/b", {"note": "billing's own"})

    theirs = breaker_rows(other_service.client)
    assert "billing's own" in theirs[0]["last_error"] and SECRET not in json.dumps(theirs)
    mine = breaker_rows(service.client)
    assert mine[0]["last_error"] == "" and SECRET not in json.dumps(mine)  # the host's last failure was B's


@override_settings(SCHEDULER_BREAKER_FAILURES=1, SCHEDULER_BREAKER_COOLDOWN=0)
def test_a_breakers_history_shows_no_other_services_run_ids_nor_the_workers_host_and_process(
    service: Service, other_service: Service, shared_host: str
) -> None:
    """A's failure opens the shared host's breaker; B's run is the probe and, the host
    back, closes it. B sees its own run's id in the history; A sees neither B's run ids
    nor any worker's host and process ("by": "78/worker@vm/16461/81728" before)."""
    from datetime import timedelta

    from runs.breakers import admit, record

    run_once(service.user, f"{shared_host}/a", {"n": 1})
    assert TargetBreaker.objects.get().state == TargetBreaker.State.OPEN
    host = TargetBreaker.objects.get().host
    job = make_job(other_service.user, target=f"{shared_host}/b")
    probe = make_run(job, timezone.now().replace(microsecond=0))
    assert admit(host=host, holder=f"{probe.pk}/worker@vm/16461/81728", now=timezone.now(),
                 probe_lease=timedelta(seconds=60)).probe
    record(host=host, holder=f"{probe.pk}/worker@vm/16461/81728", trouble=False, error="", now=timezone.now())
    assert TargetBreaker.objects.get().state == TargetBreaker.State.CLOSED

    theirs = json.dumps(breaker_rows(service.client))
    assert str(probe.pk) + "/" not in theirs and "16461" not in theirs and "worker@vm" not in theirs
    assert f"run_{probe.pk}" not in theirs
    mine = breaker_rows(other_service.client)
    details = [t["detail"] for t in mine[0]["history"]]
    assert {"by": f"run_{probe.pk}"} in [{k: v for k, v in d.items() if k == "by"} for d in details]
    assert "16461" not in json.dumps(mine)
