"""A no-op Celery task on the bench's broker, for the round-trip ceiling (`bench/run.py limits`)."""
from __future__ import annotations

import os

import redis
from celery import Celery

app = Celery("bench_noop", broker=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/8"))
app.conf.task_ignore_result = True
app.conf.worker_prefetch_multiplier = 4
app.conf.task_default_queue = "bench-noop"
_counter = redis.Redis.from_url(app.conf.broker_url)


@app.task(name="bench.noop")
def noop() -> None:
    _counter.incr("bench-noop-done")


def done_count() -> int:
    return int(_counter.get("bench-noop-done") or 0)


def reset() -> None:
    _counter.delete("bench-noop-done")
