"""A call never holds its neighbours' outcomes, nor another service's runs: real
scanner and Celery worker processes, PostgreSQL, Redis, loopback targets.

- A fast job and a slow one on one host share a run message: the fast run's outcome
  lands at its own answer, while the slow call is still in flight (runs.flights).
- Service alpha's calls to hosts that hang do not hold the worker: with one worker
  child, service beta's run due after them is still claimed on time.
"""
from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs.services import job_create, service_account_ensure
from runs.models import Run
from tests.integration.conftest import Stack, wait_for
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status
HANG = 25.0  # seconds a hanging endpoint takes


@pytest.fixture
def hanging() -> Iterator[list[LoopbackTarget]]:
    servers = [LoopbackTarget().start() for _ in range(3)]  # three hosts (ports): the bulkhead is per host
    for server in servers:
        server.delay("/hang", HANG)
    yield servers
    for server in servers:
        server.stop()


def one_off(owner: Any, name: str, url: str, at: Any, **fields: Any) -> int:
    values = {"name": name, "run_at": at, "target": url, "retry_max": 0, "timeout_seconds": 60}
    values.update(fields)
    return job_create(owner=owner, fields=values).pk


def run_of(job_id: int) -> Run:
    return Run.objects.get(job_id=job_id)


def test_a_fast_runs_outcome_lands_at_its_answer_while_its_batchs_slow_call_goes_on(
    stack: Stack, target: LoopbackTarget
) -> None:
    target.delay("/slow", HANG)
    owner, _ = service_account_ensure(name="neighbours")
    at = (timezone.now() + timedelta(seconds=6)).replace(microsecond=0)
    slow = one_off(owner, "slow", target.url("/slow"), at)
    fast = one_off(owner, "fast", target.url("/fast"), at)
    stack.scanner("scanner-a")
    stack.worker("worker-a", concurrency=1)

    done = wait_for(lambda: run_of(fast).status == S.SUCCEEDED and run_of(fast), 60, interval=0.05,
                    what="the fast run to succeed")
    assert run_of(slow).status == S.RUNNING  # its call has HANG seconds to go
    [answer] = target.calls("/fast")
    assert done.finished_at.timestamp() - answer.at < 1.0, (done.finished_at, answer.at)


def test_one_services_hanging_hosts_do_not_hold_the_worker_from_another_services_run(
    stack: Stack, target: LoopbackTarget, hanging: list[LoopbackTarget]
) -> None:
    alpha, _ = service_account_ensure(name="alpha")
    beta, _ = service_account_ensure(name="beta")
    at = (timezone.now() + timedelta(seconds=6)).replace(microsecond=0)
    for i, server in enumerate(hanging):
        one_off(alpha, f"hang-{i}", server.url("/hang"), at)
    quick = one_off(beta, "quick", target.url("/quick"), at + timedelta(seconds=2))
    stack.scanner("scanner-a")
    stack.worker("worker-a", concurrency=1, SCHEDULER_WORKER_DETACH="1")

    done = wait_for(lambda: run_of(quick).status == S.SUCCEEDED and run_of(quick), HANG + 40, interval=0.05,
                    what="beta's run to succeed")
    # Alpha's three calls were all reached, and hang still, while beta's ran on time.
    assert all(server.calls("/hang") for server in hanging)
    assert done.started_at - done.due_at < timedelta(seconds=3), (done.due_at, done.started_at)
    assert done.finished_at < min(timezone.now(), at + timedelta(seconds=HANG))


def test_a_hanging_notice_webhook_does_not_hold_the_worker_from_another_services_run(
    stack: Stack, target: LoopbackTarget, tmp_path: Any
) -> None:
    """Dead runs of service alpha are told to a webhook that hangs: the notices are sent
    from the worker process's own notices thread, never from the child that takes run
    messages, so beta's run is claimed on time with one worker child."""
    from runs import notices
    from runs.models import Notice
    from tests.factories import make_job, make_run
    from tests.webhook import HttpsWebhook

    webhook = HttpsWebhook(tmp_path / "tls").start()
    try:
        webhook.delay("/hang", HANG)
        alpha, _ = service_account_ensure(name="alpha")
        beta, _ = service_account_ensure(name="beta")
        for i in range(3):
            job = make_job(alpha, name=f"dies-{i}", notify=webhook.url("/hang"))
            run = make_run(job, timezone.now() - timedelta(minutes=1), status=S.DEAD, attempt=1,
                           finished_at=timezone.now())
            notices.notice_add(job=job, kind="dead", run=run, reason="HTTP 500")
        at = (timezone.now() + timedelta(seconds=10)).replace(microsecond=0)
        quick = one_off(beta, "quick", target.url("/quick"), at)
        stack.scanner("scanner-a")
        stack.worker("worker-a", concurrency=1, SCHEDULER_TLS_CA_FILE=webhook.cert)

        wait_for(lambda: webhook.calls("/hang"), 40, interval=0.1, what="the notice webhook to be called")
        done = wait_for(lambda: run_of(quick).status == S.SUCCEEDED and run_of(quick), HANG + 40, interval=0.05,
                        what="beta's run to succeed")
        assert done.started_at - done.due_at < timedelta(seconds=3), (done.due_at, done.started_at)
        # And the webhook was still hanging on the first notice then.
        assert Notice.objects.filter(status="pending").exists()
    finally:
        webhook.stop()
