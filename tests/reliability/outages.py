"""What the ensemble and partition tests share: a steady stream of one-off runs to
an idempotent counting target, the scanners' ownership read from their own
`partitions [...] at <unix time>` lines, and the verdict (missed, applied twice,
scanned twice, the project's invariants) over the runs the test made.
"""
from __future__ import annotations

import re
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from django.db import close_old_connections

from bench.harness import Proc
from bench.soak import recorded_applied_twice
from jobs.services import job_create, service_account_ensure
from runs import invariants
from runs.models import Run
from tests.counting_target import CountingTarget
from tests.factories import timelines_of

ALL = frozenset(range(16))
LINE = re.compile(r"^partitions \[([\d, ]*)\] at ([\d.]+)\s*$", re.M)


def one_offs(url: str, *, first_in: float, seconds: int, per_second: int = 2) -> list[int]:
    """One-off jobs due from `first_in` seconds from now, `per_second` each second for
    `seconds` seconds: their ids spread over every partition. Returns the run ids."""
    owner, _ = service_account_ensure(name="outages", email="owner@example.test")
    start = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(seconds=int(first_in) + 1)
    tag = uuid.uuid4().hex[:6]
    jobs = [job_create(owner=owner, fields={"name": f"outage-{tag}-{s}-{k}", "run_at": start + timedelta(seconds=s),
                                           "target": url})
            for s in range(seconds) for k in range(per_second)]
    return list(Run.objects.filter(job__in=jobs).values_list("pk", flat=True))


def ownership(proc: Proc) -> list[tuple[float, frozenset[int]]]:
    return [(float(at), frozenset(int(p) for p in parts.split(",") if p.strip()))
            for parts, at in LINE.findall(proc.output())]


def owned(proc: Proc) -> frozenset[int]:
    found = ownership(proc)
    return found[-1][1] if found else frozenset()


def split(procs: Iterable[Proc]) -> bool:
    """Every scanner holds some, together all, none the same."""
    sets = [owned(p) for p in procs]
    return all(sets) and frozenset().union(*sets) == ALL and sum(map(len, sets)) == len(ALL)


def first_line_after(proc: Proc, since: float, predicate: Any) -> float | None:
    return next((at for at, parts in ownership(proc) if at >= since and predicate(parts)), None)


def _changes(procs: Iterable[Proc]) -> list[tuple[float, str, frozenset[int]]]:
    return sorted((at, p.name, parts) for p in procs for at, parts in ownership(p))


def overlaps(procs: Iterable[Proc]) -> list[str]:
    """Partitions two scanners held at once, by their own lines. A scanner scans only
    what its latest poll returned, and prints each change before scanning it, so these
    lines bound when it may have scanned what: disjoint lines, no partition scanned by two."""
    current: dict[str, frozenset[int]] = {}
    found = []
    for at, name, parts in _changes(procs):
        current[name] = parts
        for other, theirs in current.items():
            if other != name and parts & theirs:
                found.append(f"at {at:.3f} {name} took {sorted(parts & theirs)} while {other} held them")
    return found


def uncovered(procs: Iterable[Proc], since: float, until: float) -> list[tuple[float, float]]:
    """The spans within [since, until] when some partition had no scanner holding it."""
    current: dict[str, frozenset[int]] = {}
    spans: list[tuple[float, float]] = []
    gap_from: float | None = None
    started = False
    for at, name, parts in _changes(procs):
        if at > until:
            break
        if at >= since and not started:
            started = True
            if frozenset().union(*current.values()) != ALL:
                gap_from = since
        current[name] = parts
        if not started:
            continue
        covered = frozenset().union(*current.values()) == ALL
        if not covered and gap_from is None:
            gap_from = at
        elif covered and gap_from is not None:
            spans.append((gap_from, at))
            gap_from = None
    if not started and frozenset().union(*current.values()) != ALL:
        gap_from = since
    return spans + ([(gap_from, until)] if gap_from is not None else [])


def events_between(run_ids: list[int], type_: str, start: float, end: float) -> list[tuple[int, datetime]]:
    close_old_connections()
    lo, hi = (datetime.fromtimestamp(t, timezone.utc) for t in (start, end))
    # The timelines as the API reads them (runs.timeline: rows and the entries on the run rows).
    return [(run_id, e.at) for run_id, found in timelines_of(run_ids).items() for e in found
            if e.type == type_ and lo <= e.at <= hi]


def all_succeeded(run_ids: list[int]) -> bool:
    close_old_connections()
    return Run.objects.filter(pk__in=run_ids, status=Run.Status.SUCCEEDED).count() == len(run_ids)


def status_counts(run_ids: list[int]) -> dict[str, int]:
    close_old_connections()
    return dict(Counter(Run.objects.filter(pk__in=run_ids).values_list("status", flat=True)))


def verdict(run_ids: list[int], target: CountingTarget, *, once_per_key: bool) -> dict[str, Any]:
    """Missed, applied twice (by the target's count and by the store's record),
    queued twice, and the project's invariants, over the test's runs. With
    `once_per_key`, a key the target was sent more than once counts as a repeat
    too (when no worker lost a call, nothing should have been sent again)."""
    close_old_connections()
    runs = list(Run.objects.filter(pk__in=run_ids))
    timeline: dict[int, list[tuple[datetime, str, dict[str, Any]]]] = defaultdict(list)
    for run_id, found in timelines_of(run_ids).items():
        timeline[run_id] += [(e.at, e.type, e.detail or {}) for e in found]
    applied = target.applied()
    sent = target.calls_per_key()
    violations = (invariants.one_open_run_per_job() + invariants.kept_for_rule() + invariants.timelines(run_ids)
                  + invariants.due_runs_settled(cutoff=datetime.now(timezone.utc))
                  + invariants.succeeded_runs_applied(applied, run_ids))
    return {
        "runs": len(runs),
        "missed": [r.public_id for r in runs if r.status != Run.Status.SUCCEEDED],
        "applied_twice": invariants.effects_applied_once(applied),
        "recorded_applied_twice": recorded_applied_twice(timeline),
        "queued_twice": [f"run_{pk} queued while queued: " + ", ".join(f"{at:%H:%M:%S.%f} {t}" for at, t, _ in events)
                         for pk, events in timeline.items() if queued_while_queued(events)],
        "sent_twice": [f"{key} sent {n} times" for key, n in sent.items() if n > 1] if once_per_key else [],
        "invariant_violations": violations,
    }


def queued_while_queued(events: list[tuple[datetime, str, dict[str, Any]]]) -> bool:
    """A `queued` with no step out of `queued` since the one before it (a claim, a
    deferral by the bulkhead or a breaker, a lease taken back): two scans queued it.
    A run deferred after its claim is queued again, once, legitimately."""
    last = ""
    for _, type_, _ in events:
        if type_ == "queued" and last == "queued":
            return True
        if type_ in invariants.LIFECYCLE_EVENTS and type_ != "requeued":
            last = type_
    return False


def problems(found: dict[str, Any]) -> dict[str, Any]:
    """The verdict's findings, without the empty ones: {} when nothing went wrong."""
    return {k: v for k, v in found.items() if k != "runs" and v}
