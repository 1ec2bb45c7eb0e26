"""The circuit breaker per target host: it opens after failures in a row, holds the
host's runs without spending their tries, lets one probe through after the cooldown,
and closes when the host answers again. Its state shows in the API and the admin."""
from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.test import override_settings
from django.utils import timezone
from rest_framework.test import APIClient

from jobs.tokens import token_issue
from jobs.validators import target_host
from runs import breakers
from runs.invariants import timelines
from runs.models import Run, TargetBreaker
from runs.services import run_execute
from tests.factories import make_job, make_run, entries
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.django_db(transaction=True)]
S = Run.Status
B = TargetBreaker.State
QUICK = override_settings(SCHEDULER_BREAKER_FAILURES=5, SCHEDULER_BREAKER_COOLDOWN=1)


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def runs_to(url: str, count: int, owner: Any = None) -> list[Run]:
    now = timezone.now().replace(microsecond=0)
    jobs = [make_job(owner, target=url, retry_max=10, retry_base_seconds=1, retry_cap_seconds=2) for _ in range(count)]
    return [make_run(job, now, status=S.QUEUED, queued_at=now) for job in jobs]


def queue_again(run: Run) -> None:
    # What the scanner does once due_at has come: back to queued.
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=timezone.now())


def breaker(url: str) -> TargetBreaker:
    return TargetBreaker.objects.get(host=target_host(url))


# The cooldown (jittered) outlasts a failed run's retry delay (1 to 2 s): the requeued
# failing run comes due while the breaker is still open. With a 1 s cooldown the two
# raced, and the run was at times the probe (once the test target's answers stopped
# taking 40 ms each, the breaker opened that much later after the first failure).
@override_settings(SCHEDULER_BREAKER_FAILURES=5, SCHEDULER_BREAKER_COOLDOWN=3)
@pytest.mark.embedded
def test_a_failing_host_opens_its_breaker_holds_its_runs_without_tries_and_they_succeed_when_it_recovers(
    target: LoopbackTarget,
) -> None:
    url = target.url("/down")
    target.script("/down", [503])
    failing, held = runs_to(url, 5), runs_to(url, 2)
    assert [run_execute(run_id=r.pk) for r in failing] == ["retry_scheduled"] * 5
    assert breaker(url).state == B.OPEN and breaker(url).failures == 5

    queue_again(failing[0])
    for run in [*held, failing[0]]:
        assert run_execute(run_id=run.pk) == "held_by_breaker"
    assert len(target.calls("/down")) == 5  # held runs were not called
    next_probe = breaker(url).next_probe_at
    for run, attempt in [(held[0], 0), (held[1], 0), (failing[0], 1)]:
        run.refresh_from_db()
        assert run.status == S.SCHEDULED and run.attempt == attempt and run.due_at >= next_probe
        assert len(entries(run, "held_by_breaker")) == 1

    target.script("/down", [200])  # the host recovers
    time.sleep((next_probe - timezone.now()).total_seconds() + 0.1)
    for run in [*held, failing[0]]:
        queue_again(run)
    assert run_execute(run_id=held[0].pk) == "succeeded"  # the probe
    assert breaker(url).state == B.CLOSED and breaker(url).failures == 0
    assert [run_execute(run_id=r.pk) for r in (held[1], failing[0])] == ["succeeded", "succeeded"]
    attempts = {r.pk: r.attempt for r in Run.objects.filter(pk__in=[held[0].pk, held[1].pk, failing[0].pk])}
    assert attempts == {held[0].pk: 1, held[1].pk: 1, failing[0].pk: 2}
    history = [t.state for t in breaker(url).transitions.order_by("at", "id")]
    assert history == [B.OPEN, B.HALF_OPEN, B.CLOSED]
    assert timelines() == []


@QUICK
def test_while_the_probe_is_in_flight_the_other_runs_keep_waiting(target: LoopbackTarget) -> None:
    url = target.url("/down")
    TargetBreaker.objects.create(host=target_host(url), state=B.OPEN, failures=5, next_probe_at=timezone.now())
    assert breakers.admit(host=target_host(url), holder="1/w", now=timezone.now(), probe_lease=timedelta(seconds=60)).probe
    [run] = runs_to(url, 1)
    assert run_execute(run_id=run.pk) == "held_by_breaker"
    assert breakers.shown_state(breaker(url), timezone.now()) == B.HALF_OPEN


@QUICK
def test_a_failed_probe_opens_the_breaker_again_for_another_cooldown(target: LoopbackTarget) -> None:
    url = target.url("/down")
    target.script("/down", [503])
    TargetBreaker.objects.create(host=target_host(url), state=B.OPEN, failures=5, next_probe_at=timezone.now())
    [probe, other] = runs_to(url, 2)
    assert run_execute(run_id=probe.pk) == "retry_scheduled"
    after = breaker(url)
    assert after.state == B.OPEN and after.next_probe_at > timezone.now() and after.failures == 6
    assert run_execute(run_id=other.pk) == "held_by_breaker"
    assert "probe failed" in after.transitions.first().detail["reason"]


@QUICK
def test_a_4xx_answer_means_the_host_is_up_and_resets_the_count(target: LoopbackTarget) -> None:
    url = target.url("/x")
    target.script("/x", [503, 503, 404, 503])
    assert [run_execute(run_id=r.pk) for r in runs_to(url, 4)] == ["retry_scheduled", "retry_scheduled", "dead", "retry_scheduled"]
    assert breaker(url).state == B.CLOSED and breaker(url).failures == 1


@pytest.mark.urls("tests.reliability.urls")
def test_the_api_shows_a_service_the_breakers_of_its_own_hosts_and_staff_every_host(
    service: Any, other_service: Any
) -> None:
    make_job(service.user, target="https://reports.internal:8443/rebuild")
    make_job(other_service.user, target="https://billing.internal/charge")
    now = timezone.now()
    TargetBreaker.objects.create(host="reports.internal:8443", state=B.OPEN, failures=5, opened_at=now,
                                 next_probe_at=now + timedelta(seconds=30), last_error="HTTP 503",
                                 last_error_owner=service.user)  # its own run's failure (tests/trust/test_breakers_tenancy.py)
    TargetBreaker.objects.create(host="billing.internal", failures=2)

    mine = service.get("/api/breakers/").json()
    assert [r["host"] for r in mine["results"]] == ["reports.internal:8443"]
    row = mine["results"][0]
    assert row["state"] == "open" and row["failures"] == 5 and row["next_probe_at"].endswith("Z")
    assert row["in_flight"] == 0 and row["last_error"] == "HTTP 503"

    staff = get_user_model().objects.create_user("ops", password="x", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token_issue(user=staff)}")
    every = client.get("/api/breakers/").json()
    assert [r["host"] for r in every["results"]] == ["billing.internal", "reports.internal:8443"]
    assert APIClient().get("/api/breakers/").status_code == 401


def test_breaker_states_gives_the_admin_every_host() -> None:
    TargetBreaker.objects.create(host="a.internal", state=B.OPEN, failures=5, next_probe_at=timezone.now())
    TargetBreaker.objects.create(host="b.internal")
    rows = breakers.breaker_states()
    assert [(r["host"], r["state"]) for r in rows] == [("a.internal", "half_open"), ("b.internal", "closed")]


@override_settings(SCHEDULER_BREAKER_FAILURES=2, SCHEDULER_BREAKER_COOLDOWN=30)
def test_a_jobs_own_short_timeout_does_not_open_the_hosts_breaker_for_other_services(
    target: LoopbackTarget, service: Any, other_service: Any,
) -> None:
    """On 75cfded one service's job with `timeout: 1s` against a host answering in 1.5 s,
    run a few times, opened the host's breaker: the other service's next run was
    `held_by_breaker` for the cooldown. A timeout shorter than
    SCHEDULER_BREAKER_MIN_TIMEOUT (30 s) is the job's own: retried under its policy,
    never the host's trouble. A host that keeps a long enough timeout waiting is."""
    target.delay("/slow", 1.5)
    now = timezone.now().replace(microsecond=0)
    impatient = make_job(service.user, target=target.url("/slow"), timeout_seconds=1, retry_max=5,
                         retry_base_seconds=1, retry_cap_seconds=2)
    for i in range(3):
        run = make_run(impatient, now - timedelta(minutes=i), status=S.QUEUED, queued_at=now)
        assert run_execute(run_id=run.pk) == "retry_scheduled"
        Run.objects.filter(pk=run.pk).update(status=S.SKIPPED, finished_at=timezone.now())
    assert not TargetBreaker.objects.filter(host=target_host(target.url("/slow")), failures__gt=0).exists()
    bystander = make_job(other_service.user, target=target.url("/fast"), name="bystander")
    run = make_run(bystander, now, status=S.QUEUED, queued_at=now)
    assert run_execute(run_id=run.pk) == "succeeded"

    with override_settings(SCHEDULER_BREAKER_MIN_TIMEOUT=1):
        for i in range(3, 5):
            run = make_run(impatient, now - timedelta(minutes=i), status=S.QUEUED, queued_at=now)
            assert run_execute(run_id=run.pk) == "retry_scheduled"
            Run.objects.filter(pk=run.pk).update(status=S.SKIPPED, finished_at=timezone.now())
    assert breaker(target.url("/slow")).state == B.OPEN
