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

And a second: a key the transport reads or writes that holds the wrong kind of
value (`WRONGTYPE`) is moved aside, not fatal. kombu keeps its unacked messages
in `unacked` (a hash) and `unacked_index` (a sorted set), its bindings in
`_kombu.binding.*` (sets), a queue in a list of the queue's name: a publish by
anyone to a queue named `unacked_index` turned that sorted set into a list, and
every worker on the server exited ("Unrecoverable error: WRONGTYPE"), again at
each restart, until the key was deleted by hand. Here the worker renames such a
key to `<key>.wrongtype.<ms>` (kept for whoever made it: nothing is deleted),
logs an error naming it, and goes on: the operation is made again once, or, for
the blocking read of the queues, the next read is. The scheduler refuses such
queue names for task jobs (jobs.validators.queue_refusal); this is for keys it
did not make.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis as redis_py
from kombu.transport import redis, virtual

logger = logging.getLogger("scheduler.broker")
T = TypeVar("T")


def wrong_type(exc: BaseException) -> bool:
    return isinstance(exc, redis_py.ResponseError) and "WRONGTYPE" in str(exc)  # a pipeline names its command first


def set_aside(client: Any, keys: Iterable[tuple[str, str]]) -> list[str]:
    """Rename each of `keys` ((name, the Redis type the transport keeps there)) that
    holds another type to `<name>.wrongtype.<ms>`; the names moved."""
    moved = []
    for key, kind in keys:
        found = client.type(key)
        found = found.decode() if isinstance(found, bytes) else str(found)
        if found in ("none", kind):
            continue
        aside = f"{key}.wrongtype.{int(time.time() * 1000)}"
        try:
            client.rename(key, aside)
        except redis_py.ResponseError:  # gone meanwhile (another worker moved it)
            continue
        logger.error("the broker key %r held a %s where the worker keeps a %s: moved to %r, the worker goes on",
                     key, found, kind, aside)
        moved.append(key)
    return moved


def again_if_wrong_type(acquire: Callable[[], Any], keys: list[tuple[str, str]], operation: Callable[[], T],
                        then: Callable[[], T] | None = None) -> T:
    """`operation`; on WRONGTYPE, the keys it uses that hold the wrong type are moved
    aside (set_aside, on a client from `acquire`) and `then` runs (by default the
    operation again, on the fresh keys)."""
    try:
        return operation()
    except redis_py.ResponseError as exc:
        if not wrong_type(exc):
            raise
        with acquire() as client:
            set_aside(client, keys)
    return (then or operation)()


def _empty() -> Any:
    raise redis.Empty()


class QoS(redis.QoS):
    def _own_keys(self) -> list[tuple[str, str]]:
        return [(self.unacked_index_key, "zset"), (self.unacked_key, "hash"), (self.unacked_mutex_key, "string")]

    def _again_if_wrong_type(self, operation: Callable[[], T]) -> T:
        return again_if_wrong_type(self.channel.conn_or_acquire, self._own_keys(), operation)

    def append(self, message: Any, delivery_tag: Any) -> None:
        self._again_if_wrong_type(lambda: super(QoS, self).append(message, delivery_tag))

    def restore_visible(self, *args: Any, **kwargs: Any) -> Any:
        # The mutex is taken with SET NX: a key of another type there is no error, only a
        # mutex that looks held for good (no restore ever again). Called every few
        # seconds, not per message: one TYPE each time.
        with self.channel.conn_or_acquire() as client:
            set_aside(client, [(self.unacked_mutex_key, "string")])
        return self._again_if_wrong_type(lambda: super(QoS, self).restore_visible(*args, **kwargs))

    def restore_unacked(self, *args: Any, **kwargs: Any) -> Any:
        return self._again_if_wrong_type(lambda: super(QoS, self).restore_unacked(*args, **kwargs))

    def ack(self, delivery_tag: Any) -> None:
        try:
            self._again_if_wrong_type(lambda: super(QoS, self).ack(delivery_tag))
        except Exception:
            virtual.QoS.ack(self, delivery_tag)  # the credit back; the error still reported
            raise

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            self._again_if_wrong_type(lambda: super(QoS, self).reject(delivery_tag, requeue=requeue))
        except Exception:
            virtual.QoS.ack(self, delivery_tag)
            raise


class Channel(redis.Channel):
    QoS = QoS

    def _queue_keys(self, queues: Iterable[str]) -> list[tuple[str, str]]:
        return [(self._q_for_pri(queue, pri), "list") for queue in queues for pri in self.priority_steps]

    def _brpop_read(self, **options: Any) -> Any:
        # The read's reply was an error: the connection is idle again, and the next
        # tick's read finds the queues' keys as lists (or none).
        return again_if_wrong_type(self.conn_or_acquire, self._queue_keys(self._active_queues),
                                   lambda: super(Channel, self)._brpop_read(**options), then=_empty)

    def _get(self, queue: str, *args: Any, **kwargs: Any) -> Any:
        return again_if_wrong_type(self.conn_or_acquire, self._queue_keys([queue]),
                                   lambda: super(Channel, self)._get(queue, *args, **kwargs), then=_empty)

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        again_if_wrong_type(self.conn_or_acquire, self._queue_keys([queue]),
                            lambda: super(Channel, self)._put(queue, message, **kwargs))

    def _size(self, queue: str) -> int:
        return again_if_wrong_type(self.conn_or_acquire, self._queue_keys([queue]),
                                   lambda: super(Channel, self)._size(queue))

    def _binding_keys(self, exchange: str) -> list[tuple[str, str]]:
        keys = [(self.keyprefix_queue % (exchange,), "set")]
        permanent = getattr(self, "keyprefix_binding_permanent", None)
        if permanent:
            keys.append((permanent % (exchange,), "set"))
        return keys

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        again_if_wrong_type(self.conn_or_acquire, self._binding_keys(exchange),
                            lambda: super(Channel, self)._queue_bind(exchange, routing_key, pattern, queue))

    def get_table(self, exchange: str) -> Any:
        return again_if_wrong_type(self.conn_or_acquire, self._binding_keys(exchange),
                                   lambda: super(Channel, self).get_table(exchange))


class Transport(redis.Transport):
    Channel = Channel
