"""No input makes a 500: random JSON in every field of a create and a PATCH; and what
is accepted is what the worker can send, byte for byte as stored."""
from __future__ import annotations

import http.client
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rest_framework.test import APIClient

from jobs.models import Job
from jobs.secrets import decrypt_headers
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
# Header names and values from the wire's edges: framing headers, non-ASCII, controls.
header_names = st.sampled_from(
    ["X-Team", "Authorization", "Host", "Content-Length", "transfer-encoding", "Connection", "TE", "Upgrade",
     "Proxy-Authorization", "X Team", "X-T\u00ebam", "\u65e5\u672c", ""]
) | st.text(max_size=12)
header_values = st.sampled_from(
    ["reports", "a b\tc", "\u65e5\u672c", "a\u2028b", "a\x01b", "a\x7fb", "a\x0bb", "a\x85b"]
) | st.text(max_size=12)
headers = st.dictionaries(header_names, header_values, max_size=4)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values | plausible, max_size=6) | st.builds(
    lambda h: {"schedule": "0 2 * * *", "headers": h}, headers
)
# What the scheduler never lets a job send (docs/reference.md, the API fields: headers).
NOT_SENDABLE = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer", "upgrade"}


def assert_sendable_as_stored() -> None:
    """Every stored header is one the worker sends as it is: an RFC 9110 token name that
    does not frame the request, and a visible-ASCII value (http.client's own checks)."""
    for job in Job.objects.all():
        for name, value in {**job.headers, **decrypt_headers(job.secret_headers)}.items():
            assert name.isascii() and http.client._is_legal_header_name(name.encode()), name
            assert name.lower() not in NOT_SENDABLE and not name.lower().startswith("proxy-"), name
            assert not http.client._is_illegal_header_value(value.encode()), value
            assert all(c == "\t" or " " <= c <= "~" for c in value), value


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
    assert_sendable_as_stored()


@pytest.fixture
def job_path(service: Service) -> str:
    created = service.post("/api/jobs/", {"schedule": "0 2 * * *", "target": "https://x.test/"})
    return f"/api/jobs/{created.json()['id']}/"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies)
def test_no_patch_body_makes_a_500(service: Service, job_path: str, body: dict[str, Any]) -> None:
    response = safe_client(service).patch(job_path, body, format="json")

    assert response.status_code in (200, 400), (body, response.content)
    assert_sendable_as_stored()
