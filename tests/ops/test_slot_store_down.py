"""The pages that show calls in flight (the bulkhead's slots) while the slot store,
Redis, does not answer: the soak under load (2026-12-01) found `GET /api/breakers/`
answering 500 while its Redis restarted. The count is unknown then; the page still
answers with everything else it shows.

Redis here is a real client to a loopback port nothing listens on: a Redis that is
down, as during its restart."""
from __future__ import annotations

import socket
from typing import Any

import pytest
from django.test import Client, override_settings

from jobs.validators import target_key
from runs.models import TargetBreaker
from tests.conftest import Service
from tests.factories import make_job

pytestmark = [pytest.mark.django_db(transaction=True)]
METRICS_TOKEN = "slot-store-down-scrape"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again once the socket is: connections are refused


@pytest.fixture
def redis_down() -> Any:
    with override_settings(
        SCHEDULER_BULKHEAD="redis",
        SCHEDULER_BULKHEAD_REDIS_URL=f"redis://127.0.0.1:{closed_port()}/0",
        SCHEDULER_METRICS_TOKEN=METRICS_TOKEN,
    ):
        yield


@pytest.fixture
def open_breaker(service: Service) -> str:
    host = target_key(make_job(service.user, target="http://hooks.example.test/hook"))
    TargetBreaker.objects.create(host=host, state=TargetBreaker.State.OPEN, failures=5)
    return host


def test_the_breakers_api_answers_with_calls_in_flight_unknown(
    redis_down: None, service: Service, open_breaker: str
) -> None:
    response = service.client.get("/api/breakers/")
    assert response.status_code == 200, response.content
    [row] = response.json()["results"]
    assert (row["host"], row["state"], row["failures"], row["in_flight"]) == (open_breaker, "open", 5, None)


def test_metrics_leave_out_the_unknown_count_and_keep_the_breaker_states(
    redis_down: None, open_breaker: str
) -> None:
    response = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {METRICS_TOKEN}")
    assert response.status_code == 200, response.content
    lines = response.content.decode().splitlines()
    assert not [line for line in lines if line.startswith("scheduler_target_in_flight{")]
    assert f'scheduler_target_breaker_state{{host="{open_breaker}",state="open"}} 1' in lines


def test_the_admin_system_page_and_dashboard_show_the_count_as_unknown(
    redis_down: None, open_breaker: str, operator_client: Client
) -> None:
    for path in ("/admin/system/", "/admin/"):
        response = operator_client.get(path)
        assert response.status_code == 200, (path, response.content[:2000])
        assert open_breaker in response.content.decode(), path
    assert "unknown of" in operator_client.get("/admin/system/").content.decode()
