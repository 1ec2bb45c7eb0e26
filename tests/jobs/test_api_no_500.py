"""No input makes a 500: random JSON in every field of a create and a PATCH."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from tests.conftest import Service

FIELDS = [
    "name", "schedule", "at", "delay", "timezone", "target", "method", "headers", "secret_headers",
    "payload", "window", "misfire", "retry", "timeout", "notify", "paused", "state", "id",
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)
# Plausible values too, so some requests get past the first check and reach the service.
plausible = st.sampled_from(
    ["0 2 * * *", "2026-10-28T20:30:00", "10m", "UTC", "https://x.test/", "POST", "run_all", "0s", True]
)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values | plausible, max_size=6)


def safe_client(service: Service) -> APIClient:
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")
    return client


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_no_create_body_makes_a_500(service: Service, body: dict[str, Any]) -> None:
    body.setdefault("target", "https://x.test/")
    response = safe_client(service).post("/api/jobs/", body, format="json")

    assert response.status_code in (201, 400), (body, response.content)


@pytest.fixture
def job_path(service: Service) -> str:
    created = service.post("/api/jobs/", {"schedule": "0 2 * * *", "target": "https://x.test/"})
    return f"/api/jobs/{created.json()['id']}/"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_no_patch_body_makes_a_500(service: Service, job_path: str, body: dict[str, Any]) -> None:
    response = safe_client(service).patch(job_path, body, format="json")

    assert response.status_code in (200, 400), (body, response.content)
