"""A circuit breaker per target host (as written in the URL, port included).

closed -> open: SCHEDULER_BREAKER_FAILURES calls in a row found the host in
trouble (no answer, a timeout, 408, 429 or a 5xx). While open, the host's runs are
held: the worker puts them back to `scheduled` until the next probe time, before
claiming them, so holding spends no try (runs.services).
open -> half_open: once the cooldown (SCHEDULER_BREAKER_COOLDOWN, with jitter)
has passed, one run is let through as the probe; the others keep waiting.
half_open -> closed when the probe gets any answer that is not trouble (a 4xx
means the host is up); half_open -> open again, with a new cooldown, when not.

The state lives in the store (`target_breakers`) so every worker sees one
breaker per host, on PostgreSQL and SQLite alike. Each change is one
conditional update, so two workers cannot both open it or both take the probe.
Its times (`next_probe_at`, the probe's lease `probe_until`) are in the store's
clock: the worker's `now` comes from runs.claims.store_now, as for run leases.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db.models import F, Q, QuerySet

from runs import bulkhead
from runs.models import BreakerTransition, TargetBreaker

B = TargetBreaker.State


@dataclass(frozen=True)
class Admission:
    probe: bool = False  # this run is the half-open probe
    hold_until: datetime | None = None  # not now: back to scheduled until then
    state: str = B.CLOSED
    next_probe_at: datetime | None = None


def cooldown() -> timedelta:
    # Jitter, so that the probes of many hosts that failed together do not line up.
    return timedelta(seconds=float(settings.SCHEDULER_BREAKER_COOLDOWN) * random.uniform(0.8, 1.2))


def admit(*, host: str, holder: str, now: datetime, probe_lease: timedelta) -> Admission:
    """May a run to `host` be called now? Read first: a closed breaker costs one read."""
    breaker = TargetBreaker.objects.filter(host=host).first()
    if breaker is None or breaker.state == B.CLOSED:
        return Admission()
    probe_at = breaker.next_probe_at
    if probe_at is not None and now < probe_at:
        # Spread the held runs a little past the probe time: the first one back probes.
        spread = timedelta(seconds=random.uniform(0, 2))
        return Admission(hold_until=probe_at + spread, state=breaker.state, next_probe_at=probe_at)
    free = Q(probe_until__isnull=True) | Q(probe_until__lt=now)
    due = Q(next_probe_at__isnull=True) | Q(next_probe_at__lte=now)  # a failed probe may have just re-opened it
    took = TargetBreaker.objects.filter(free, due, host=host, state__in=(B.OPEN, B.HALF_OPEN)).update(
        state=B.HALF_OPEN, probe_holder=holder, probe_until=now + probe_lease
    )
    if took:
        _transition(host, B.HALF_OPEN, now, probe=holder, probe_owner=_owner_of(holder))
        return Admission(probe=True, state=B.HALF_OPEN)
    # Another run is the probe: ask again soon.
    return Admission(hold_until=bulkhead.wait_until(now), state=B.HALF_OPEN, next_probe_at=probe_at)


def not_closed(hosts: list[str]) -> set[str]:
    """Of these hosts, those whose breaker is open or half-open: one read per batch."""
    return {host for host, (state, _) in counting(hosts).items() if state != B.CLOSED}


def counting(hosts: list[str]) -> dict[str, tuple[str, int]]:
    """Of these hosts, those whose breaker is open or half-open or counts failures:
    (state, failures) each, in one read. A host not in the answer has nothing for a
    success to reset."""
    if not hosts:
        return {}
    rows = TargetBreaker.objects.filter(Q(host__in=hosts), ~Q(state=B.CLOSED) | Q(failures__gt=0))
    return {host: (state, failures) for host, state, failures in rows.values_list("host", "state", "failures")}


def release_probe(*, host: str, holder: str) -> None:
    """A probe that made no call (its claim failed, no slot): let another run probe."""
    TargetBreaker.objects.filter(host=host, state=B.HALF_OPEN, probe_holder=holder).update(
        probe_holder="", probe_until=None
    )


def record(*, host: str, holder: str, trouble: bool, error: str, now: datetime) -> None:
    """What one call found: trouble counts towards opening, anything else closes."""
    if trouble:
        _failure(host, holder, error, now)
    else:
        _success(host, holder, now)


def record_many(*, host: str, found: list[tuple[str, bool, str]], now: datetime | Callable[[], datetime],
                nothing_to_reset: bool = False) -> None:
    """A batch's calls to one host, in order: (holder, trouble, error) each.
    All fine (the common case) costs what one success does, and nothing when the
    worker's read of the breakers (counting, runs.services._BreakerView) found nothing for this host
    (`nothing_to_reset`): a breaker closed with no failures counted. `now` may be a
    function, called only when something is written."""
    if not found:
        return
    if not any(trouble for _, trouble, _ in found):
        if not nothing_to_reset:
            _success(host, found[-1][0], now() if callable(now) else now)
        return
    now = now() if callable(now) else now
    for holder, trouble, error in found:
        record(host=host, holder=holder, trouble=trouble, error=error, now=now)


def _success(host: str, holder: str, now: datetime) -> None:
    # Usually no row matches (closed, no failures): the common path writes nothing.
    closed = TargetBreaker.objects.filter(host=host).exclude(state=B.CLOSED).update(
        state=B.CLOSED, failures=0, opened_at=None, next_probe_at=None, probe_holder="", probe_until=None
    )
    if closed:
        _transition(host, B.CLOSED, now, by=holder, by_owner=_owner_of(holder))
    else:
        TargetBreaker.objects.filter(host=host, failures__gt=0).update(failures=0)


def _owner_of(holder: str) -> int | None:
    """The user whose run holds `holder` ("<run id>/<worker>", runs.services), if any."""
    from runs.models import Run

    run_id = holder.split("/", 1)[0]
    if not run_id.isdigit():
        return None
    return Run.objects.filter(pk=int(run_id)).values_list("job__owner_id", flat=True).first()


def _failure(host: str, holder: str, error: str, now: datetime) -> None:
    owner = _owner_of(holder)
    TargetBreaker.objects.bulk_create([TargetBreaker(host=host)], ignore_conflicts=True)
    TargetBreaker.objects.filter(host=host).update(
        failures=F("failures") + 1, last_failure_at=now, last_error=error[:500], last_error_owner_id=owner
    )
    # The failure text is kept apart from the reason, with its owner: rows show it to
    # that service and staff only.
    said = {"last_error": error[:200], "owner": owner}
    again = TargetBreaker.objects.filter(host=host, state=B.HALF_OPEN, probe_holder=holder)
    if again.update(state=B.OPEN, next_probe_at=now + cooldown(), probe_holder="", probe_until=None):
        _transition(host, B.OPEN, now, reason="the probe failed", **said)
        return
    threshold = max(1, int(settings.SCHEDULER_BREAKER_FAILURES))
    trip = TargetBreaker.objects.filter(host=host, state=B.CLOSED, failures__gte=threshold)
    if trip.update(state=B.OPEN, opened_at=now, next_probe_at=now + cooldown()):
        _transition(host, B.OPEN, now, reason=f"{threshold} failures in a row", **said)


def _transition(host: str, state: str, now: datetime, **detail: Any) -> None:
    breaker_id = TargetBreaker.objects.filter(host=host).values_list("pk", flat=True).first()
    if breaker_id is not None:
        BreakerTransition.objects.create(breaker_id=breaker_id, at=now, state=state, detail=detail)


# --------------------------------------------------------------------------- reads


def shown_state(breaker: TargetBreaker, now: datetime) -> str:
    """Open past its probe time reads as half_open: the next run is let through."""
    if breaker.state == B.OPEN and breaker.next_probe_at is not None and breaker.next_probe_at <= now:
        return B.HALF_OPEN
    return breaker.state


def breakers_for(user: Any) -> QuerySet[TargetBreaker]:
    """The breakers `user` may see: staff all; a service those of the hosts its own
    jobs call (hosts are shared between services, so scoping is by host)."""
    from jobs.models import Job
    from jobs.validators import target_key

    rows = TargetBreaker.objects.order_by("host")
    if getattr(user, "is_staff", False):
        return rows
    targets = Job.objects.filter(owner=user).only("target", "task", "queue")
    return rows.filter(host__in={target_key(job) for job in targets})


def row(
    breaker: TargetBreaker, now: datetime, in_flight: int | None, history: int = 10, viewer: Any = None
) -> dict[str, Any]:
    """One breaker as shown to `viewer`: staff (or None, the admin) see every failure's
    text; a service sees the host's state, and failure text from its own runs only."""
    return {
        "host": breaker.host,
        "state": shown_state(breaker, now),
        "failures": breaker.failures,
        "opened_at": breaker.opened_at,
        "next_probe_at": breaker.next_probe_at,
        "last_failure_at": breaker.last_failure_at,
        "last_error": breaker.last_error if _sees_text(viewer, breaker.last_error_owner_id) else "",
        "in_flight": in_flight,
        "history": [
            {"at": t.at, "state": t.state, "detail": shown_detail(t.detail, viewer)}
            for t in breaker.transitions.all()[:history]
        ],
    }


def _sees_text(viewer: Any, owner_id: int | None) -> bool:
    return viewer is None or getattr(viewer, "is_staff", False) or (owner_id is not None and owner_id == viewer.pk)


# A transition's holders ("<run id>/<worker host/pid/thread>"): whose run it was is kept
# beside each (`<key>_owner`), read by shown_detail only.
HOLDER_KEYS = ("probe", "by")


def shown_detail(detail: dict[str, Any], viewer: Any) -> dict[str, Any]:
    """A transition's detail without the owners' ids, and without another service's
    text. A holder (the probe, the run that closed it) shows to staff whole; to a
    service as its own run's id when the run was its own, never the worker's host and
    process; another service's not at all."""
    shown = {k: v for k, v in detail.items() if k != "owner" and not k.endswith("_owner")}
    for key in HOLDER_KEYS:
        if key not in detail or _sees_text(viewer, None):
            continue
        holder = str(detail[key]).split("/", 1)[0]
        if holder.isdigit() and _sees_text(viewer, detail.get(f"{key}_owner")):
            shown[key] = f"run_{holder}"
        else:
            shown.pop(key)
    if "last_error" in detail and not _sees_text(viewer, detail.get("owner")):
        shown.pop("last_error")
    elif "owner" not in detail and not _sees_text(viewer, None) and isinstance(detail.get("reason"), str):
        # Written before failure text was kept apart: "...; last: <text>", "...: <text>".
        shown["reason"] = detail["reason"].split("; last:", 1)[0].split(": ", 1)[0]
    return shown


def breaker_states(now: datetime | None = None) -> list[dict[str, Any]]:
    """Every host's breaker, for the admin's system page (staff: all hosts)."""
    from runs.claims import store_now

    now = now or store_now()  # slot leases and probe times are in the store's clock
    breakers = list(TargetBreaker.objects.order_by("host").prefetch_related("transitions"))
    busy = bulkhead.in_flight([b.host for b in breakers], now=now)
    return [row(b, now, None if busy is None else busy.get(b.host, 0)) for b in breakers]
