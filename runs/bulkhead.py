"""The bulkhead: at most SCHEDULER_TARGET_CONCURRENCY calls in flight to one target
host (as written in the URL, port included), across all workers.

A slot is a row in `target_slots`; the unique (host, slot) pair makes taking one a
single insert that either wins or fails, on PostgreSQL and SQLite alike, with no
lock held while the call runs. A slot has a lease like a run's: the call's
heartbeat extends it, so a slot whose worker died frees itself when it runs out.

A worker that finds no free slot does not wait: it puts the run back to
`scheduled` a moment later (runs.services), so the worker is free for runs to
other targets, and the run spends no try.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count, Max

from runs.models import TargetSlot


@dataclass(frozen=True)
class Slot:
    pk: int
    host: str
    holder: str


def limit() -> int:
    return max(1, int(settings.SCHEDULER_TARGET_CONCURRENCY))


def take(*, host: str, holder: str, now: datetime, lease: timedelta) -> Slot | None:
    """A free slot for `host`, or None when all of them are in flight."""
    # Slots whose holder stopped extending them (died, froze) are free again.
    TargetSlot.objects.filter(host=host, expires_at__lt=now).delete()
    taken = set(TargetSlot.objects.filter(host=host).values_list("slot", flat=True))
    for number in range(limit()):
        if number in taken:
            continue
        try:
            with transaction.atomic():
                row = TargetSlot.objects.create(
                    host=host, slot=number, holder=holder, taken_at=now, expires_at=now + lease
                )
        except IntegrityError:
            continue  # another worker took this one between our read and our insert
        return Slot(pk=row.pk, host=host, holder=holder)
    return None


def extend(slot: Slot, *, now: datetime, lease: timedelta) -> bool:
    """From the call's heartbeat. False: the slot ran out and may be someone else's."""
    return TargetSlot.objects.filter(pk=slot.pk, holder=slot.holder).update(expires_at=now + lease) == 1


def release(slot: Slot) -> None:
    TargetSlot.objects.filter(pk=slot.pk, holder=slot.holder).delete()


def in_flight(hosts: list[str] | None = None, *, now: datetime) -> dict[str, int]:
    """Live slots per host, for the API and the admin."""
    rows = TargetSlot.objects.filter(expires_at__gte=now)
    if hosts is not None:
        rows = rows.filter(host__in=hosts)
    return {row["host"]: row["n"] for row in rows.values("host").annotate(n=Count("id"))}


def wait_until(now: datetime, host: str | None = None) -> datetime:
    """When a run that found no free slot tries again.

    About as long as the youngest call in flight to the host has been running: a
    call that started a moment ago (a healthy host in a burst) is likely to end
    soon, one that has hung for seconds is not. At most SCHEDULER_BULKHEAD_WAIT,
    jittered so that the waiting runs do not all come back in the same scan.
    """
    wait = float(settings.SCHEDULER_BULKHEAD_WAIT)
    if host is not None:
        youngest = TargetSlot.objects.filter(host=host, expires_at__gte=now).aggregate(t=Max("taken_at"))["t"]
        if youngest is not None:
            wait = min(wait, max(0.05, (now - youngest).total_seconds()))
    return now + timedelta(seconds=wait * random.uniform(0.5, 1.5))
