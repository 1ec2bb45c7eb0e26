"""What a newcomer meets first: the API's index, the site root, the wrong auth scheme,
and the words of the errors and the schema they read."""
from __future__ import annotations

import json
from typing import Any

import pytest
from django.core.cache import cache
from django.core.management import call_command
from rest_framework.test import APIClient

from jobs.authentication import PREFIX
from jobs.models import Job
from tests.conftest import Service

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def test_the_api_index_is_public_and_lists_the_api_links(db: None) -> None:
    response = APIClient().get("/api/")
    assert response.status_code == 200
    body = response.json()
    assert body["links"] == {
        "jobs": "http://testserver/api/jobs/",
        "runs": "http://testserver/api/runs/",
        "dead_runs": "http://testserver/api/runs/?status=dead",
        "breakers": "http://testserver/api/breakers/",
        "audit": "http://testserver/api/audit/",
        "schema": "http://testserver/api/schema/",
        "docs": "http://testserver/api/docs/",
    }
    assert "Authorization: Token <token>" in body["authentication"]


def test_the_site_root_sends_a_browser_to_the_admin(db: None) -> None:
    response = APIClient().get("/")
    assert response.status_code == 302 and response["Location"] == "/admin/"


def test_a_bearer_token_is_a_401_that_names_the_token_scheme_and_counts_no_failure(service: Service) -> None:
    cache.clear()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {service.token}")

    response = client.get("/api/jobs/")

    assert response.status_code == 401 and response["WWW-Authenticate"] == "Token"
    assert response.json() == {"detail": "This API's scheme is Token, not Bearer: send `Authorization: Token <token>`."}
    assert cache.get(f"{PREFIX}count:127.0.0.1") is None
    client.credentials(HTTP_AUTHORIZATION="Token not-a-token")  # where a guess is counted
    assert client.get("/api/jobs/").status_code == 401 and cache.get(f"{PREFIX}count:127.0.0.1") == 1


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("/rebuild", "must be a full URL starting with http:// or https://, like https://reports.internal/rebuild"),
        ("ftp://files.internal/report", "must start with http:// or https://, not ftp:"),
    ],
)
def test_a_target_that_is_not_http_says_so_in_plain_words(service: Service, target: str, message: str) -> None:
    response = service.post("/api/jobs/", {"name": "x", "delay": "1m", "target": target})
    assert response.status_code == 400
    assert response.json() == {"target": [message]}
    assert not Job.objects.exists()


def schema(tmp_path: Any) -> dict[str, Any]:
    out = tmp_path / "schema.json"
    call_command("spectacular", "--format", "openapi-json", "--file", str(out))
    return json.loads(out.read_text())


def test_the_schema_describes_jobs_for_api_users_and_summarises_the_breakers(tmp_path: Any) -> None:
    document = schema(tmp_path)
    for name in ("Job", "PatchedJob", "Retry"):
        description = document["components"]["schemas"][name]["description"]
        assert "contract" not in description.lower()
        assert "column" not in description and "source" not in description
    assert document["components"]["schemas"]["PatchedJob"]["description"].startswith("A job: what to call")
    assert document["paths"]["/api/breakers/"]["get"]["summary"] == (
        "Target hosts' circuit breakers (the caller's hosts; staff: all)"
    )
    assert "/api/" not in document["paths"]  # the index, like the schema and docs pages, is not an operation
