"""Idempotent creates (jobs/create_keys.py): `POST /api/jobs/` with an
`Idempotency-Key` header replays the first answer for 24 hours and creates nothing;
another body under a used key is a 422; a retry after a dropped connection, and two
requests at once, make one job."""
from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import pytest
import time_machine
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.models import CreateKey, Job
from tests.conftest import Service

JOBS = "/api/jobs/"
BODY = {"name": "nightly", "schedule": "0 2 * * *", "target": "https://reports.internal/rebuild"}


def post(service: Service, body: Any, key: str | None) -> Any:
    headers = {"HTTP_IDEMPOTENCY_KEY": key} if key is not None else {}
    return service.client.post(JOBS, body, format="json", **headers)


@pytest.mark.embedded
def test_the_same_key_and_body_replay_the_first_answer_and_create_nothing(service: Service) -> None:
    first = post(service, BODY, "k-1")
    assert first.status_code == 201, first.content
    again = post(service, dict(reversed(list(BODY.items()))), "k-1")  # other key order: the same body
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert Job.objects.count() == 1 and "Idempotent-Replayed" not in first


@pytest.mark.embedded
def test_a_used_key_with_another_body_is_a_422_and_writes_nothing(service: Service) -> None:
    assert post(service, BODY, "k-2").status_code == 201
    refused = post(service, {**BODY, "schedule": "0 3 * * *"}, "k-2")
    assert refused.status_code == 422
    assert "'k-2' was used by this service" in refused.json()["detail"]
    assert Job.objects.count() == 1 and CreateKey.objects.count() == 1


@pytest.mark.embedded
def test_keys_are_per_service(service: Service, other_service: Service) -> None:
    assert post(service, BODY, "shared").status_code == 201
    theirs = post(other_service, BODY, "shared")
    assert theirs.status_code == 201 and "Idempotent-Replayed" not in theirs
    assert Job.objects.count() == 2


@pytest.mark.embedded
@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "caf\u00e9", "tab\there"])
def test_a_malformed_key_is_a_400_naming_the_header(service: Service, key: str) -> None:
    response = post(service, BODY, key)
    assert response.status_code == 400 and list(response.json()) == ["Idempotency-Key"], response.content
    assert Job.objects.count() == 0 and CreateKey.objects.count() == 0


@pytest.mark.embedded
def test_a_400_keeps_nothing_so_the_corrected_body_may_use_the_key(service: Service) -> None:
    assert post(service, {**BODY, "schedule": "not cron"}, "k-3").status_code == 400
    assert CreateKey.objects.count() == 0
    assert post(service, BODY, "k-3").status_code == 201


@pytest.mark.embedded
def test_a_key_older_than_24_hours_makes_a_new_job(service: Service) -> None:
    with time_machine.travel(timezone.now() - timedelta(hours=25)):
        assert post(service, BODY, "k-4").status_code == 201
    fresh = post(service, BODY, "k-4")
    assert fresh.status_code == 201 and "Idempotent-Replayed" not in fresh
    assert Job.objects.count() == 2 and CreateKey.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_two_creates_with_one_key_at_once_make_one_job(service: Service) -> None:
    """Threads, each with its own store connection: the second insert of the key
    waits for the first's commit, fails, and its job is rolled back."""
    if connection.vendor != "postgresql":
        pytest.skip("concurrent writers: PostgreSQL")
    answers: list[Any] = []
    start = threading.Barrier(4)

    def create() -> None:
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")
        start.wait()
        answers.append(client.post(JOBS, BODY, format="json", HTTP_IDEMPOTENCY_KEY="race"))
        connection.close()

    threads = [threading.Thread(target=create) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [a.status_code for a in answers] == [201] * 4
    assert Job.objects.count() == 1
    assert len({a.json()["id"] for a in answers}) == 1


@pytest.mark.django_db(transaction=True)
def test_a_create_retried_after_the_connection_dropped_past_the_commit_makes_one_job(
    live_server: Any, service: Service
) -> None:
    """A real server: the client sends the create and closes its socket once the job
    is in the store, before reading the answer (as a dropped connection would); the
    retry with the same key gets the first answer."""
    where = urlsplit(live_server.url)
    raw = json.dumps(BODY).encode()
    request = (
        f"POST {JOBS} HTTP/1.1\r\nHost: {where.netloc}\r\nAuthorization: Token {service.token}\r\n"
        f"Content-Type: application/json\r\nIdempotency-Key: dropped-1\r\nContent-Length: {len(raw)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + raw
    sock = socket.create_connection((where.hostname, where.port), timeout=10)
    sock.sendall(request)
    deadline = time.monotonic() + 20
    while not Job.objects.exists():
        assert time.monotonic() < deadline, "the server did not commit the job"
        time.sleep(0.02)
    sock.close()  # the answer never read
    retry = APIClient()
    retry.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")
    again = retry.post(f"{live_server.url}{JOBS}", BODY, format="json", HTTP_IDEMPOTENCY_KEY="dropped-1")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert Job.objects.count() == 1 and again.json()["id"] == Job.objects.get().public_id
