"""A broker restart under load, CI-safe: RabbitMQ closes every connection of the
scheduler's own vhost from the broker side (`rabbitmqctl close_all_connections
--vhost`), what a restart of the broker does to its clients, while a steady stream
of one-off runs flows from two scanners through two workers to a counting target.
The machine's RabbitMQ itself is never stopped.

Every run still starts and none is applied twice (tests/reliability/outages.py's
verdict); the time until runs flow again is the time from the close to the first
call of a run that a scanner published after it (both ends reconnected: the
scanners' publishing connections and the workers' consuming ones).
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest
from django.db import close_old_connections

from runs.models import Run
from tests.counting_target import CountingTarget
from tests.integration.conftest import Stack, wait_for
from tests.rabbitmq import RabbitVhost, rabbit_vhost_or_skip
from tests.reliability import outages
from tests.factories import timelines_of

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
CLOSES = 2


@pytest.fixture
def rabbit() -> Iterator[RabbitVhost]:
    with rabbit_vhost_or_skip("sched-fault") as vhost:
        yield vhost


@pytest.fixture
def counting() -> Iterator[CountingTarget]:
    server = CountingTarget().start()
    yield server
    server.stop()


def flowing_again(run_ids: list[int], target: CountingTarget, since: float) -> float | None:
    """Seconds from `since` to the first call of a run queued after `since`."""
    close_old_connections()
    lo = datetime.fromtimestamp(since, timezone.utc)
    ids = [run_id for run_id, found in timelines_of(run_ids).items() if any(e.type == "queued" and e.at > lo
                                                                             for e in found)]
    queued_after = {run.idempotency_key for run in Run.objects.filter(pk__in=list(ids))}
    arrivals = [at for key, _, at in target.received() if key in queued_after and at > since]
    return min(arrivals) - since if arrivals else None


def test_when_rabbitmq_closes_every_scheduler_connection_under_load_every_run_still_starts_once(
    stack: Stack, rabbit: RabbitVhost, counting: CountingTarget
) -> None:
    stack.env["CELERY_BROKER_URL"] = rabbit.url  # the bulkhead follows: database
    for key in ("SCHEDULER_BULKHEAD", "SCHEDULER_BULKHEAD_REDIS_URL", "SCHEDULER_TASK_BROKER_URL"):
        stack.env.pop(key, None)
    scanners = [stack.scanner("scanner-a"), stack.scanner("scanner-b")]
    stack.worker("worker-a")
    stack.worker("worker-b")
    wait_for(lambda: outages.split(scanners), 30, what="the two scanners to split the partitions")
    run_ids = outages.one_offs(counting.url(), first_in=2, seconds=22, per_second=4)

    recovered: list[float] = []
    closed: list[int] = []
    for round_ in range(CLOSES):
        wait_for(lambda n=len(counting.applied()): len(counting.applied()) >= n + 24, 40,
                 what="runs to flow (six seconds of them)")
        before = rabbit.connections()
        at = time.time()
        rabbit.close_connections(f"broker restart {round_ + 1} (test)")
        closed.append(len(before))
        took = wait_for(lambda a=at: flowing_again(run_ids, counting, a), 60,
                        what="a run published after the close to reach the target")
        recovered.append(took)

    wait_for(lambda: outages.all_succeeded(run_ids), 90, what="every run to succeed", interval=0.5)
    close_old_connections()
    lateness = sorted(
        first - run.scheduled_for.timestamp()
        for run in Run.objects.filter(pk__in=run_ids)
        for first in [min((at for key, _, at in counting.received() if key == run.idempotency_key), default=None)]
        if first is not None
    )
    print(f"rabbitmq closed {closed} connections: runs flow again after "
          f"{', '.join(f'{t:.2f}' for t in recovered)} s; {len(run_ids)} runs, first call after due: "
          f"median {lateness[len(lateness) // 2]:.2f} s, max {lateness[-1]:.2f} s")
    found = outages.verdict(run_ids, counting, once_per_key=False)
    assert outages.problems(found) == {}, found
    # No message was lost at a close: no run waited for SCHEDULER_REQUEUE_AFTER to be published again
    # (a publish cut off is retried, confirmed; a message a worker had not acked is delivered again).
    assert outages.events_between(run_ids, "requeued", 0, time.time()) == []
    assert all(n >= 4 for n in closed), closed  # both scanners' and both workers' connections were closed
    assert len(run_ids) == 88 and found["runs"] == 88
