"""One service's share of a scanner's queue (SCHEDULER_SERVICE_QUEUED), and the run
queue's two lanes.

The scan reads due runs in due order, and SCHEDULER_MAX_QUEUED bounds what waits in the
broker: without a share, one service's burst (a backfill, thousands of one-offs due at
one instant) filled that room, and every other service's run due a moment later waited
until the whole burst had been queued. Past its share, a scan steps over a service's
due runs (ServiceShares, runs.claims.lock_due's `skip_owners`), from the share floors
(ShareFloors), and the others' are queued in the same scan. In the broker, a service's
runs past its first message's worth go on the slow lane (SLOW_LANE), read after every
other service's messages.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

from django.conf import settings
from django.db import connection
from django.db.models import Count, Max, Min

from jobs.models import Job
from runs import claims
from runs.models import OPEN_KEPT_FOR_SQL, Run, with_status


# A service's runs queued past its first this many (SCHEDULER_DISPATCH_BATCH, or its
# share if that is less) go on the run queue's slow lane (SLOW_LANE).
def fast_lane_runs() -> int:
    return max(1, min(settings.SCHEDULER_DISPATCH_BATCH, settings.SCHEDULER_SERVICE_QUEUED))


# The broker priority of the slow lane's messages. kombu's Redis transport keeps a list
# per priority step and a worker's read takes the lowest step first: the messages of a
# service with a message's worth already queued wait behind every other service's
# (priority 0, Celery's default). RabbitMQ honours it only on a queue declared with
# x-max-priority, and the embedded broker not at all: there, one lane.
SLOW_LANE = 9


# The due read for a scan that leaves out the services holding their share of the
# queue (scanners.scan.scan_once, SCHEDULER_SERVICE_QUEUED): the same walk of each
# partition in due order, stepping over those services' runs, so that another service's
# run due a moment after a burst of theirs is read now, not after the whole burst. It
# names each run's partition and due time: the scan's share floors move over what it
# read and took, never past a run it read and could not lock (lock_listed).
DUE_KEYS_SKIPPING_SQL = claims.DUE_IDS_SQL.replace("SELECT d.id\n", "SELECT d.id, d.due_at, d.partition\n").replace(
    "SELECT r.id, r.due_at\n", "SELECT r.id, r.due_at, r.partition\n").replace(
    "AND r.kept_for = {open}".format(open=OPEN_KEPT_FOR_SQL),
    "AND r.kept_for = {open}\n"
    "          AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = r.job_id AND j.owner_id = ANY(%s::integer[]))"
    .format(open=OPEN_KEPT_FOR_SQL))
assert DUE_KEYS_SKIPPING_SQL.count("NOT EXISTS") == 1 and DUE_KEYS_SKIPPING_SQL.count("d.partition") == 1


def read_due_skipping(*, partitions: list[int], now: datetime, limit: int,
                      after: "dict[int, tuple[datetime, int]] | None", skip_owners: list[int]
                      ) -> list[tuple[int, datetime, int]]:
    """lock_due's read, unlocked, leaving out the jobs of `skip_owners` (services that
    hold their share of the queue): the (partition, due time, id) of each, in due
    order. lock_listed then locks those it can."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(DUE_KEYS_SKIPPING_SQL,
                           (*claims.floor_params(list(partitions), after), now, list(skip_owners), limit, limit))
            return [(part, due_at, pk) for pk, due_at, part in cursor.fetchall()]
    rows = (claims.waiting_due(now).filter(partition__in=partitions)
            .exclude(job__owner_id__in=skip_owners).order_by("due_at", "id")
            .values_list("partition", "due_at", "id")[:limit])
    return list(rows)


def count_queued_by_owner(*, partitions: list[int], up_to: datetime | None = None) -> dict[int, int]:
    """count_queued, by the service (the owner of the job) each run is of."""
    rows = (Run.objects.filter(claims.in_flight(up_to), with_status(Run.Status.QUEUED), partition__in=partitions)
            .values_list("job__owner_id").annotate(n=Count("id")).order_by())
    return {owner: n for owner, n in rows}


# How often the share floors are dropped in the scanner's timed floor drops
# (ShareFloors.dropped_for_locks).
SHARE_FLOORS_DROP_EVERY = 60.0


# How long a scanner trusts its answer to "does more than one service have jobs"
# (several_services): a second service's first jobs are shared out at most this late.
SERVICES_KNOWN_FOR = 5.0


@dataclass
class _Services:
    several: bool = True
    asked_at: float | None = None


_services = _Services()


def several_services() -> bool:
    """Whether jobs of more than one service are in the store (two index probes of
    jobs_owner_idx, asked again every SERVICES_KNOWN_FOR seconds). A service alone has
    no neighbour to give way to: its scans neither count by service nor step over its
    runs (a count a scan, and a walk over its backlog after each share-floor drop)."""
    now = time.monotonic()
    if _services.asked_at is None or now - _services.asked_at >= SERVICES_KNOWN_FOR:
        span = Job.objects.aggregate(lo=Min("owner_id"), hi=Max("owner_id"))
        _services.several, _services.asked_at = span["lo"] != span["hi"], now
    return _services.several


def forget_services() -> None:
    """several_services asks the store again at its next call (tests)."""
    _services.asked_at = None


@dataclass
class ServiceShares:
    """The runs each service has queued in a scan's partitions, while one may hold its
    share (SCHEDULER_SERVICE_QUEUED) or be past its fast lane (fast_lane_runs). Read
    only when the queue holds a fast lane's worth in all (below that no service can be
    past either) and the store holds more than one service's jobs (several_services);
    otherwise the scan reads (and publishes) as it always did."""

    share: int = 0
    queued: dict[int, int] = field(default_factory=dict)

    @classmethod
    def read(cls, parts: list[int], up_to: datetime | None, waiting: int) -> "ServiceShares":
        share = settings.SCHEDULER_SERVICE_QUEUED
        if share <= 0 or not several_services():
            return cls()
        if waiting < fast_lane_runs():
            return cls(share=share)
        return cls(share=share, queued=count_queued_by_owner(partitions=parts, up_to=up_to))

    def full(self) -> list[int]:
        """The services that hold their share now."""
        return sorted(owner for owner, n in self.queued.items() if n >= self.share) if self.share else []

    def took(self, queued: list[Run]) -> set[int]:
        """Counts `queued` (just queued, in due order) in; returns those of them that go
        on the slow lane: past their service's fast lane."""
        slow: set[int] = set()
        if self.share:
            lane = fast_lane_runs()
            for run in queued:
                before = self.queued.get(run.job.owner_id, 0)
                if before >= lane:
                    slow.add(run.pk)
                self.queued[run.job.owner_id] = before + 1
        return slow


@dataclass
class ShareFloors:
    """Where a due read that steps over the services holding their share of the queue
    (ServiceShares) starts in each partition: after the last run such a read took there,
    or the horizon it read to. Their runs wait below it, so the scanner's floors cannot
    move there; without these, every such read stepped over the whole of their backlog
    again. Valid for one set of services stepped over and any set that holds it (another
    set starts afresh); lowered wherever the scanner's floors are (the scanner command's
    _lower_floors: a run turning waiting behind them is notified the same way), dropped
    with them when notifications may have been missed, and every
    SHARE_FLOORS_DROP_EVERY (dropped_for_locks)."""

    skipping: list[int] = field(default_factory=list)
    at: dict[int, tuple[datetime, int]] = field(default_factory=dict)
    cleared_at: float = 0.0  # time.monotonic() of the last dropped_for_locks that cleared them

    def after(self, skipping: list[int],
              floors: "dict[int, tuple[datetime, int]] | None") -> dict[int, tuple[datetime, int]]:
        if not set(self.skipping) <= set(skipping):
            self.at = {}  # a service no longer stepped over: its runs below them wait
        self.skipping = list(skipping)
        merged = dict(floors or {})
        for part, key in self.at.items():
            merged[part] = max(merged.get(part, claims.NO_FLOOR), key)
        return merged

    def lower(self, part: int, key: tuple[datetime, int]) -> None:
        if part in self.at and key < self.at[part]:
            self.at[part] = key

    def clear(self) -> None:
        self.at = {}

    def dropped_for_locks(self, now: float) -> None:
        """Cleared every SHARE_FLOORS_DROP_EVERY seconds (time.monotonic), called at the
        scanner's timed floor drop. A stepping read never moves them past a run it could
        not lock, but the floors they start from (`after`'s) may have passed one that a
        plain read's lock skipped: such a run is read again by the next stepping read
        after this. Not at every floor drop: each clear costs the next stepping read a
        walk over the whole of the stepped-over services' backlog (a 50,000-run burst:
        a second or two of the store's CPU)."""
        if now - self.cleared_at >= SHARE_FLOORS_DROP_EVERY:
            self.at, self.cleared_at = {}, now


