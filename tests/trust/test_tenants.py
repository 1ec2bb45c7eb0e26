"""Tenants apart: every API endpoint, found by walking the URL map (so a new one is
covered without a change here), answers another service's ids with 404 and never
lists its objects. And a revoked or rotated-out token is a 401 on its next call."""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from django.core.management import call_command
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from rest_framework.test import APIClient

from jobs.models import Job
from runs.models import Run
from tests.conftest import Service
from tests.factories import make_run, utc

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
# Which object an `{id}` in a route names, by the route's first segment. A new
# endpoint with an id fails the test until it is taught here.
OBJECT_OF_ROUTE = {"jobs": "job", "runs": "run"}
THEIR_HOST = "billing-private.test"


def _walk(patterns: list[Any], prefix: str = "") -> Iterator[tuple[str, URLPattern]]:
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from _walk(pattern.url_patterns, prefix + str(pattern.pattern))
        else:
            yield prefix + str(pattern.pattern), pattern


@dataclass(frozen=True)
class Endpoint:
    route: str
    name: str
    kwargs: tuple[str, ...]
    methods: tuple[str, ...]

    def __str__(self) -> str:
        return f"{'/'.join(self.methods)} {self.route}"


def api_endpoints() -> list[Endpoint]:
    found = []
    for route, pattern in _walk(get_resolver().url_patterns):
        if not route.startswith("api/"):
            continue
        callback = pattern.callback
        actions = getattr(callback, "actions", None)
        view_class = getattr(callback, "cls", None) or getattr(callback, "view_class", None)
        if actions:
            methods = tuple(sorted(actions))
        else:
            methods = tuple(m for m in ("get", "post", "put", "patch", "delete") if hasattr(view_class, m))
        found.append(Endpoint(route, pattern.name or "", tuple(pattern.pattern.regex.groupindex), methods))
    return found


ENDPOINTS = api_endpoints()


@dataclass
class Theirs:
    job: Job
    runs: list[Run]

    def ids(self) -> list[str]:
        return [self.job.public_id, *(r.public_id for r in self.runs)]


@pytest.fixture
def theirs(other_service: Service) -> Theirs:
    created = other_service.post("/api/jobs/", {"schedule": "0 2 * * *", "target": f"https://{THEIR_HOST}/hook"})
    job = Job.objects.get(pk=int(created.json()["id"].removeprefix("job_")))
    dead = make_run(job, utc("2026-01-01T02:00:00Z"), status=Run.Status.DEAD, last_error="HTTP 500")
    return Theirs(job=job, runs=[*Run.objects.filter(job=job).exclude(pk=dead.pk), dead])


def url_for(endpoint: Endpoint, theirs: Theirs, run: Run) -> str:
    segment = endpoint.route.removeprefix("api/").lstrip("^").split("/")[0]
    kwargs = {}
    for name in endpoint.kwargs:
        kind = OBJECT_OF_ROUTE.get(segment)
        assert name == "id" and kind, f"teach this test which object {endpoint.route} takes as {name!r}"
        kwargs[name] = theirs.job.public_id if kind == "job" else run.public_id
    return reverse(endpoint.name, kwargs=kwargs)


def test_the_url_map_has_the_endpoints_this_test_knows_about() -> None:
    names = {e.name for e in ENDPOINTS}
    assert {"job-list", "job-detail", "job-runs", "run-list", "run-detail", "audit-list"} <= names


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=str)
def test_another_services_ids_are_404_and_its_objects_are_never_listed(
    endpoint: Endpoint, service: Service, theirs: Theirs
) -> None:
    create = service.post("/api/jobs/", {"schedule": "0 3 * * *", "target": "https://reports.test/hook"})
    assert create.status_code == 201
    for run in theirs.runs if endpoint.kwargs else theirs.runs[:1]:
        url = url_for(endpoint, theirs, run)
        for method in endpoint.methods:
            if endpoint.kwargs:
                response = getattr(service.client, method)(url, {"paused": True}, format="json")
                assert response.status_code == 404, (method, url, response.status_code)
                assert json.loads(response.content)["detail"]
            elif method == "get":
                query = {"object": theirs.job.public_id, "job": theirs.job.public_id, "run": run.public_id}
                response = service.client.get(url, query)
                assert response.status_code == 200, (url, response.status_code)
                body = response.content.decode()
                assert THEIR_HOST not in body
                assert not any(f'"{public_id}"' in body for public_id in theirs.ids()), body
    theirs.job.refresh_from_db()
    assert not theirs.job.paused and theirs.job.state == Job.State.ACTIVE  # nothing happened to it


# --------------------------------------------------------------------------- revoked and rotated tokens


def test_a_revoked_token_gets_401_on_its_next_call(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    assert service.get("/api/jobs/").status_code == 200

    call_command("revoke_service_token", "reports")

    response = service.get("/api/jobs/")
    assert response.status_code == 401 and response["WWW-Authenticate"] == "Token"
    assert response.json()["detail"]
    assert capsys.readouterr().out.strip() == "reports: revoked its API token"


def test_a_rotated_token_replaces_the_old_one_at_once(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    call_command("rotate_service_token", "reports")

    new = capsys.readouterr().out
    assert new.endswith("\n") and new.count("\n") == 1 and new.strip() != service.token
    assert service.get("/api/jobs/").status_code == 401
    fresh = APIClient()
    fresh.credentials(HTTP_AUTHORIZATION=f"Token {new.strip()}")
    assert fresh.get("/api/jobs/").status_code == 200


def test_revoking_twice_says_there_was_nothing_to_revoke(service: Service, capsys: pytest.CaptureFixture[str]) -> None:
    call_command("revoke_service_token", "reports")
    call_command("revoke_service_token", "reports")

    assert capsys.readouterr().out.splitlines()[-1] == "reports: had no API token; nothing to revoke"


@pytest.mark.parametrize("command", ["revoke_service_token", "rotate_service_token"])
def test_token_commands_refuse_an_unknown_service_in_one_line(command: str) -> None:
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="^no service account 'nobody'"):
        call_command(command, "nobody")


def test_a_person_is_not_a_service_for_the_token_commands(staff_client: APIClient) -> None:
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="no service account"):
        call_command("rotate_service_token", "ops-person")

