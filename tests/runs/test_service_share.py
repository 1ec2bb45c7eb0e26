"""A service's share of a worker process's calls (SCHEDULER_SERVICE_CALLS).

A detached worker (SCHEDULER_WORKER_DETACH) hands its calls still in flight to the
process's writer and takes its next message. A service whose calls hang would then
fill the process's call pool with its own calls, message after message. Past its
share of calls in flight for longer than SHARE_SLOW_FOR, its further runs wait a
moment (`service_share_wait`, no try spent) while other services' runs are called.

The worker's path for real: loopback HTTP targets, PostgreSQL (detaching is for
PostgreSQL: the embedded SQLite file waits for its calls), batches on threads as
worker children run them. SHARE_SLOW_FOR is shortened: the clock is all that is
mocked.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from runs import breakers, flights, services
from runs.models import Run
from runs.services import run_execute_many
from tests.runs.calls import events_of, queued_now, wait_for_status
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.django_db(transaction=True)]
S = Run.Status
HANG = 4.0  # seconds the hanging endpoint takes to answer


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    server.delay("/hang", HANG)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _postgresql_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if connection.vendor != "postgresql":
        pytest.skip("detached calls are a PostgreSQL worker's")
    # The process's writer and beat threads end soon after the last call, closing their connections.
    monkeypatch.setattr(flights, "IDLE_SECONDS", 0.3)
    yield
    assert services.process_flights().drain(HANG + 10)
    time.sleep(1.0)


def detached(runs: list[Run]) -> dict[int, str]:
    """One message's batch as a detached worker child runs it, on a thread of its own."""
    out: dict[int, str] = {}

    def child() -> None:
        try:
            out.update(run_execute_many(run_ids=[r.pk for r in runs], worker="w-share", detach=True))
        finally:
            connection.close()

    thread = threading.Thread(target=child)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    return out


@pytest.mark.parametrize("share", [2, 3])
def test_past_its_share_of_slow_calls_a_services_next_run_waits_and_anothers_is_called(
    service: Any, other_service: Any, target: LoopbackTarget, settings: Any, monkeypatch: pytest.MonkeyPatch,
    share: int,
) -> None:
    settings.SCHEDULER_SERVICE_CALLS = share
    monkeypatch.setattr(services, "SHARE_SLOW_FOR", 0.2)
    hanging = [queued_now(service.user, f"hang-{i}", target.url("/hang")) for i in range(2)]
    assert detached(hanging) == {r.pk: "calling" for r in hanging}
    time.sleep(0.4)  # both in flight for longer than SHARE_SLOW_FOR
    assert all(Run.objects.get(pk=r.pk).status == S.RUNNING for r in hanging)

    third = queued_now(service.user, "third", target.url("/quick"))
    neighbour = queued_now(other_service.user, "neighbour", target.url("/quick"))
    detached([third, neighbour])

    # The other service's run is called at once, whatever the share.
    assert wait_for_status(neighbour, {S.SUCCEEDED}, 2.0).status == S.SUCCEEDED
    waited = wait_for_status(third, {S.SUCCEEDED}, 2.0)
    if share == 2:
        # The service has its two slow calls in flight: its third run waits, spending no try.
        assert waited.status == S.SCHEDULED, waited.status
        assert waited.attempt == 0
        assert [d.get("share") for t, d in events_of(waited) if t == "service_share_wait"] == [2]
        assert waited.due_at > third.due_at  # a moment later
        assert len(target.calls("/quick")) == 1  # the neighbour's only
    else:
        # Under its share, its third run is called like anyone's.
        assert waited.status == S.SUCCEEDED, waited.status
        assert len(target.calls("/quick")) == 2
    for run in hanging:
        assert wait_for_status(run, {S.SUCCEEDED}, HANG + 5).status == S.SUCCEEDED


@pytest.mark.parametrize("trouble", [True, False])
def test_a_detached_batch_to_a_host_in_trouble_hands_its_calls_over_at_once(
    service: Any, target: LoopbackTarget, monkeypatch: pytest.MonkeyPatch, trouble: bool,
) -> None:
    """A host whose breaker counts failures (its last call timed out) is expected to
    hang again: its batch's child hands the call to the writer at once instead of
    waiting DETACH_AFTER (lengthened here past the call, so that waiting shows as the
    call's own outcome), and takes its next message. Another host's batch waits."""
    monkeypatch.setattr(flights, "DETACH_AFTER", HANG + 2)
    run = queued_now(service.user, "hangs", target.url("/hang"))
    if trouble:
        host = services.target_key(run.job)
        breakers.record(host=host, holder=str(run.pk), trouble=True, error="timeout", now=timezone.now())
        assert breakers.counting([host])[host][1] == 1
    outcome = detached([run])[run.pk]
    assert outcome == ("calling" if trouble else "succeeded")
    assert wait_for_status(run, {S.SUCCEEDED}, HANG + 5).status == S.SUCCEEDED
