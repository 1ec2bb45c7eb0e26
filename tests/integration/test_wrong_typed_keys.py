"""A key the Redis transport uses, holding the wrong kind of value, does not stop
the scheduler's worker (scheduler_project/redis_transport.py): real scanner and
Celery worker processes on a private redis-server, PostgreSQL, a loopback target.

On 75cfded a publish to a queue named `unacked_index` turned kombu's sorted set into
a list: the worker exited with "Unrecoverable error: WRONGTYPE", and again at each
restart until the key was deleted by hand. Each name here is set to a wrong type,
the first before the worker starts, the rest while it runs; after each a run due
then still succeeds, the worker is still up, and the key was moved aside to
`<key>.wrongtype.<ms>` (nothing deleted)."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone

from bench.soak_stack import PrivateRedis
from jobs.services import job_create, service_account_ensure
from runs.models import Run
from tests.integration.conftest import Stack, wait_for
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status

# (key, how it is made the wrong type): kombu's unacked hash, index and mutex, the
# run queue's list and its exchange's binding sets.
def before_start(queue: str) -> list[tuple[str, str]]:
    """Read when a worker starts (its queue's bindings) or at its first message."""
    return [
        ("unacked_index", "list"),
        (f"_kombu.binding.{queue}", "string"),
        (f"_kombu.binding_permanent.{queue}", "hash"),
    ]


def while_running(queue: str) -> list[tuple[str, str]]:
    """Read as the worker runs: its unacked messages, their restore, its queue."""
    return [
        ("unacked", "string"),
        ("unacked_mutex", "list"),
        (queue, "string"),  # the run queue: `runs` by default, the test's own name here
    ]


def spoil(client: redis.Redis, key: str, kind: str) -> None:
    client.delete(key)
    if kind == "list":
        client.rpush(key, "not kombu's")
    elif kind == "hash":
        client.hset(key, "not", "kombu's")
    else:
        client.set(key, "not kombu's")


def run_now(owner: Any, name: str, url: str) -> int:
    at = (timezone.now() + timedelta(seconds=1)).replace(microsecond=0)
    return job_create(owner=owner, fields={"name": name, "run_at": at, "target": url, "retry_max": 0}).pk


def test_the_worker_sets_a_wrong_typed_key_aside_and_goes_on(
    stack: Stack, private_redis: PrivateRedis, target: LoopbackTarget
) -> None:
    stack.env.update(CELERY_BROKER_URL=private_redis.url, SCHEDULER_BULKHEAD_REDIS_URL=private_redis.url,
                     SCHEDULER_TASK_BROKER_URL=private_redis.url)
    queue = stack.env.get("SCHEDULER_RUN_QUEUE", "runs")
    client = redis.Redis.from_url(private_redis.url)
    owner, _ = service_account_ensure(name="keys")

    def a_run_succeeds(after: str) -> None:
        job = run_now(owner, f"after-{after}", target.url(f"/after/{after}"))
        wait_for(lambda: Run.objects.get(job_id=job).status == S.SUCCEEDED, 40, interval=0.1,
                 what=f"a run after {after} held the wrong type")

    def moved_aside(key: str, kind: str) -> None:
        # The unacked mutex is read by the restore of unacked messages, every 10 s.
        aside = wait_for(lambda: [k.decode() for k in client.keys(f"{key}.wrongtype.*")], 15, interval=0.2,
                         what=f"{key} (a {kind}) moved aside")
        assert client.type(aside[0]) == {"list": b"list", "hash": b"hash"}.get(kind, b"string")

    try:
        for key, kind in before_start(queue):  # it used to die at each restart
            spoil(client, key, kind)
        stack.scanner("scanner-a")
        worker = stack.worker("worker-a", concurrency=1)
        a_run_succeeds("start")
        for key, kind in before_start(queue):
            moved_aside(key, kind)
        for key, kind in while_running(queue):
            spoil(client, key, kind)
            a_run_succeeds(key)
            moved_aside(key, kind)
            assert worker.alive(), f"the worker exited after {key} was made a {kind}"
    finally:
        client.close()
    assert worker.alive()
