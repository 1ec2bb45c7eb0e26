"""The bulkhead: at most SCHEDULER_TARGET_CONCURRENCY calls in flight to one target
host (as written in the URL, port included), across all workers.

A slot has a holder and a lease like a run's: the call's heartbeat extends it, so
a slot whose worker died frees itself when it runs out. Two stores, one meaning:

- Redis (the production layout, where Redis is already the broker): one sorted
  set per host, member = holder, score = lease expiry. Taking slots for a whole
  batch of runs is one Lua script (drop the expired, count, add up to the free
  number), so it is atomic across workers and costs one round trip.
- The database (the embedded layout, or SCHEDULER_BULKHEAD=database): a row per
  slot in `target_slots`; the unique (host, slot) pair makes taking one an
  insert that either wins or fails, on PostgreSQL and SQLite alike.

Slot times are in the store's clock (docs/reliability.md, "Clock skew"):
the worker's `now` comes from runs.claims.store_now, once per batch and per
heartbeat, so in Redis too every score is in PostgreSQL's clock, whichever
worker wrote it. Redis's own TIME would be a second clock, and a slot's times
meet the run's (`wait_until` turns a slot's age into a run's `due_at`).

A worker that finds no free slot does not wait: it puts the run back to
`scheduled` a moment later (runs.services), so the worker is free for runs to
other targets, and the run spends no try.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Protocol

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Max
from redis.exceptions import RedisError

from runs.models import TargetSlot

logger = logging.getLogger("scheduler.bulkhead")


@dataclass(frozen=True)
class Slot:
    pk: int | str  # the row's id (database) or the holder (Redis)
    host: str
    holder: str


def limit() -> int:
    return max(1, int(settings.SCHEDULER_TARGET_CONCURRENCY))


class Store(Protocol):
    def take(self, host: str, holders: list[str], now: datetime, lease: timedelta) -> list[Slot]: ...
    def extend(self, slots: list[Slot], now: datetime, lease: timedelta) -> list[Slot]: ...
    def release(self, slots: list[Slot]) -> None: ...
    def in_flight(self, hosts: list[str] | None, now: datetime) -> dict[str, int]: ...
    def youngest(self, host: str, now: datetime) -> datetime | None: ...


class DatabaseStore:
    """A row per slot in `target_slots`."""

    def take(self, host: str, holders: list[str], now: datetime, lease: timedelta) -> list[Slot]:
        # Slots whose holder stopped extending them (died, froze) are free again.
        TargetSlot.objects.filter(host=host, expires_at__lt=now).delete()
        taken = set(TargetSlot.objects.filter(host=host).values_list("slot", flat=True))
        free = [n for n in range(limit()) if n not in taken]
        slots: list[Slot] = []
        wanted = list(holders)
        for number in free:
            if not wanted:
                break
            try:
                with transaction.atomic():
                    row = TargetSlot.objects.create(
                        host=host, slot=number, holder=wanted[0], taken_at=now, expires_at=now + lease
                    )
            except IntegrityError:
                continue  # another worker took this one between our read and our insert
            slots.append(Slot(pk=row.pk, host=host, holder=wanted.pop(0)))
        return slots

    def extend(self, slots: list[Slot], now: datetime, lease: timedelta) -> list[Slot]:
        kept = []
        for slot in slots:
            if TargetSlot.objects.filter(pk=slot.pk, holder=slot.holder).update(expires_at=now + lease) == 1:
                kept.append(slot)
        return kept

    def release(self, slots: list[Slot]) -> None:
        for slot in slots:
            TargetSlot.objects.filter(pk=slot.pk, holder=slot.holder).delete()

    def in_flight(self, hosts: list[str] | None, now: datetime) -> dict[str, int]:
        rows = TargetSlot.objects.filter(expires_at__gte=now)
        if hosts is not None:
            rows = rows.filter(host__in=hosts)
        return {row["host"]: row["n"] for row in rows.values("host").annotate(n=Count("id"))}

    def youngest(self, host: str, now: datetime) -> datetime | None:
        return TargetSlot.objects.filter(host=host, expires_at__gte=now).aggregate(t=Max("taken_at"))["t"]


# KEYS[1] the host's set; ARGV: now, expiry, limit, ttl_ms, holders...
# Returns the holders that got a slot.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local free = tonumber(ARGV[3]) - redis.call('ZCARD', KEYS[1])
local granted = {}
for i = 5, #ARGV do
  if free <= 0 then break end
  if redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[i]) == 1 then
    free = free - 1
    granted[#granted + 1] = ARGV[i]
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return granted
"""
# KEYS[1] the host's set; ARGV: expiry, holders... Only slots still held are extended.
_EXTEND = """
local kept = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i])
    kept[#kept + 1] = ARGV[i]
  end
end
return kept
"""


class RedisStore:
    """One sorted set per host: member = holder, score = the slot's lease expiry (unix)."""

    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        self._take = self.client.register_script(_TAKE)
        self._extend = self.client.register_script(_EXTEND)

    @staticmethod
    def key(host: str) -> str:
        return f"{settings.SCHEDULER_BULKHEAD_PREFIX}{host}"

    def take(self, host: str, holders: list[str], now: datetime, lease: timedelta) -> list[Slot]:
        if not holders:
            return []
        ttl_ms = int(lease.total_seconds() * 1000) * 2 + 1000
        granted = self._take(
            keys=[self.key(host)], args=[now.timestamp(), (now + lease).timestamp(), limit(), ttl_ms, *holders]
        )
        return [Slot(pk=h.decode(), host=host, holder=h.decode()) for h in granted]

    def extend(self, slots: list[Slot], now: datetime, lease: timedelta) -> list[Slot]:
        kept: list[Slot] = []
        for host, group in _by_host(slots).items():
            names = {s.holder: s for s in group}
            alive = self._extend(keys=[self.key(host)], args=[(now + lease).timestamp(), *names])
            kept += [names[h.decode()] for h in alive]
        return kept

    def release(self, slots: list[Slot]) -> None:
        groups = _by_host(slots)
        if not groups:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for host, group in groups.items():
                pipe.zrem(self.key(host), *[s.holder for s in group])
            pipe.execute()

    def in_flight(self, hosts: list[str] | None, now: datetime) -> dict[str, int]:
        if hosts is None:
            prefix = settings.SCHEDULER_BULKHEAD_PREFIX
            hosts = [k.decode()[len(prefix):] for k in self.client.scan_iter(match=f"{prefix}*", count=1000)]
        if not hosts:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for host in hosts:
                pipe.zcount(self.key(host), f"({now.timestamp()}", "+inf")
            counts = pipe.execute()
        return {host: int(n) for host, n in zip(hosts, counts) if n}

    def youngest(self, host: str, now: datetime) -> datetime | None:
        # The latest expiry belongs to the slot taken (or extended) last.
        top = self.client.zrange(self.key(host), -1, -1, withscores=True)
        if not top or top[0][1] < now.timestamp():
            return None
        lease = timedelta(seconds=settings.SCHEDULER_LEASE_SECONDS)
        return datetime.fromtimestamp(top[0][1], tz=now.tzinfo) - lease


def _by_host(slots: list[Slot]) -> dict[str, list[Slot]]:
    groups: dict[str, list[Slot]] = {}
    for slot in slots:
        groups.setdefault(slot.host, []).append(slot)
    return groups


@lru_cache(maxsize=4)
def _store(kind: str, url: str) -> Store:
    return RedisStore(url) if kind == "redis" else DatabaseStore()


def store() -> Store:
    """SCHEDULER_BULKHEAD: `redis` (the default when the broker is Redis) or `database`."""
    kind = settings.SCHEDULER_BULKHEAD
    url = settings.SCHEDULER_BULKHEAD_REDIS_URL if kind == "redis" else ""
    return _store(kind, url)


# ------------------------------------------------------------------ the interface


def take_many(*, host: str, holders: list[str], now: datetime, lease: timedelta) -> list[Slot]:
    """Free slots for as many of `holders` as the host has room for, in their order."""
    return store().take(host, holders, now, lease)


def take(*, host: str, holder: str, now: datetime, lease: timedelta) -> Slot | None:
    """A free slot for `host`, or None when all of them are in flight."""
    got = take_many(host=host, holders=[holder], now=now, lease=lease)
    return got[0] if got else None


def extend_many(slots: list[Slot], *, now: datetime, lease: timedelta) -> list[Slot]:
    """From the calls' heartbeat; returns the slots still held (a lapsed one may be someone else's)."""
    return store().extend(slots, now, lease) if slots else []


def extend(slot: Slot, *, now: datetime, lease: timedelta) -> bool:
    return bool(extend_many([slot], now=now, lease=lease))


def release_many(slots: list[Slot]) -> None:
    if slots:
        store().release(slots)


def release(slot: Slot) -> None:
    release_many([slot])


def in_flight(hosts: list[str] | None = None, *, now: datetime) -> dict[str, int] | None:
    """Live slots per host, for the API, the admin and /metrics; None when the slot
    store is Redis and Redis does not answer (restarting, say): those pages show the
    count as unknown and the rest as usual, instead of failing whole (the soak under
    load found /api/breakers/ answering 500 while Redis restarted). The database
    store has no such case: with the database down the page has nothing to show."""
    try:
        return store().in_flight(hosts, now)
    except RedisError as exc:
        logger.warning("bulkhead slots unknown: the slot store did not answer (%s)", exc)
        return None


def wait_until(now: datetime, host: str | None = None) -> datetime:
    """When a run that found no free slot tries again.

    About as long as the youngest call in flight to the host has been running: a
    call that started a moment ago (a healthy host in a burst) is likely to end
    soon, one that has hung for seconds is not. At most SCHEDULER_BULKHEAD_WAIT,
    jittered so that the waiting runs do not all come back in the same scan.
    """
    wait = float(settings.SCHEDULER_BULKHEAD_WAIT)
    if host is not None:
        youngest = store().youngest(host, now)
        if youngest is not None:
            wait = min(wait, max(0.05, (now - youngest).total_seconds()))
    return now + timedelta(seconds=wait * random.uniform(0.5, 1.5))
