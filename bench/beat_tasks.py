"""The probe task for the `beat` scenario, and a publish counter for the beat process.

Loaded by the worker (`-I bench.beat_tasks`) and by beat (`CELERY_IMPORTS`).
Each publish and each execution is counted in Redis with its latest time.
"""
from __future__ import annotations

import time

import redis
from celery import shared_task
from celery.signals import after_task_publish
from django.conf import settings

_redis = redis.Redis.from_url(settings.CELERY_BROKER_URL)


@shared_task(name="bench.beat_probe", ignore_result=True)
def beat_probe() -> None:
    pipe = _redis.pipeline()
    pipe.incr("beat-executed")
    pipe.set("beat-executed-last", time.time())
    pipe.execute()


@after_task_publish.connect
def _count_publish(sender: str | None = None, **kwargs: object) -> None:
    if sender == "bench.beat_probe":
        pipe = _redis.pipeline()
        pipe.incr("beat-dispatched")
        pipe.set("beat-dispatched-last", time.time())
        pipe.execute()


def figures() -> dict[str, float]:
    values = _redis.mget("beat-dispatched", "beat-dispatched-last", "beat-executed", "beat-executed-last")
    names = ("dispatched", "dispatched_last", "executed", "executed_last")
    return {n: float(v) if v is not None else 0.0 for n, v in zip(names, values)}


def reset() -> None:
    _redis.delete("beat-dispatched", "beat-dispatched-last", "beat-executed", "beat-executed-last")
