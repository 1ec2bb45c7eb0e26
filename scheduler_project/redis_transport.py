"""Kombu's Redis transport, with one fix: an ack that fails still frees the
worker's prefetch credit.

kombu 5.7's Redis `QoS.ack` first removes the message from Redis's `unacked`
index and only then forgets it locally (the virtual QoS's ack). When that first
step fails on a broken connection (Redis restarting), the message stays counted
as delivered, and each such message holds one of the worker's prefetch slots for
good. A Redis restart under load, with every slot full and every ack failing,
leaves the worker with no credit: it never asks Redis for a message again, logs
nothing after "Couldn't ack", and consumes nothing until it is restarted. The
soak under load found it (2026-12-01: a worker took no message for the rest of
the soak after a Redis restart 13 s in); a plain Celery worker with kombu's own
transport does the same (tests/reliability/test_restarts.py).

Here a failed ack (or reject) still forgets the message, then raises as before,
so Celery logs "Couldn't ack" as it did. If Redis kept the message (persistence
on), it stays in the `unacked` hash and comes back after the visibility timeout:
one more copy of a run message, which the claim refuses once the run is taken
(runs.claims). The settings use this transport for `redis://` broker URLs.
"""
from __future__ import annotations

from typing import Any

from kombu.transport import redis, virtual


class QoS(redis.QoS):
    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except Exception:
            virtual.QoS.ack(self, delivery_tag)  # the credit back; the error still reported
            raise

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except Exception:
            virtual.QoS.ack(self, delivery_tag)
            raise


class Channel(redis.Channel):
    QoS = QoS


class Transport(redis.Transport):
    Channel = Channel
