"""The history's upkeep: partitions made ahead, runs past the retention pruned.

The scanner holding partition 0 publishes `runs.keep_run_partitions` (runs.tasks) every
`every()`; `python manage.py run_partitions` does the same by hand. See runs.partitions.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection
from django.utils import timezone

from runs import partitions

logger = logging.getLogger(__name__)

OFF = ("off", "never", "")
UPKEEP_LOCK = 0x52554E53  # pg_try_advisory_lock key of the upkeep ("RUNS")


@dataclass
class Kept:
    made: list[partitions.Span] = field(default_factory=list)
    missing: list[partitions.Span] = field(default_factory=list)
    pruned_runs: int = 0
    pruned_events: int = 0
    dropped: list[str] = field(default_factory=list)
    skipped: bool = False  # another upkeep held the lock


def retention() -> timedelta | None:
    """SCHEDULER_RUN_RETENTION: how long a finished run is kept (None: for ever)."""
    from jobs.schedule import parse_duration

    text = settings.SCHEDULER_RUN_RETENTION
    if isinstance(text, str) and text.strip().lower() in OFF:
        return None
    value = parse_duration(text, longest=timedelta(days=3660))
    if value <= timedelta(0):
        raise ValueError(f"{text!r} is no retention: give a duration like 90d, or off")
    return value


def every() -> float:
    """Seconds between two upkeeps: a quarter of a partition's width, at most 10 minutes."""
    return max(5.0, min(600.0, partitions.width().total_seconds() / 4))


def keep(now: datetime | None = None) -> Kept:
    """Make the partitions due ahead, say loudly which are still missing, and prune
    what is past the retention; nothing if another upkeep is at it (`skipped`)."""
    now = now or timezone.now()
    kept = Kept()
    with _alone() as alone:
        if alone:
            _keep(now, kept)
        else:
            kept.skipped = True
    return kept


@contextmanager
def _alone() -> Iterator[bool]:
    """One upkeep at a time: a slow one (a big first prune) must not have the next
    ones the scanner publishes pile up behind its locks. A session advisory lock on
    PostgreSQL (released here, or with the connection)."""
    if connection.vendor != "postgresql":
        yield True
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_lock(%s)", [UPKEEP_LOCK])
        had = cursor.fetchone()[0]
    try:
        yield had
    finally:
        if had:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_unlock(%s)", [UPKEEP_LOCK])


def _keep(now: datetime, kept: Kept) -> None:
    from runs.ops import prune_runs

    if partitions.in_use():
        kept.made = partitions.make_ahead(now)
        kept.missing = partitions.missing(now)
        if kept.missing:
            logger.error(
                "no run partition for %s: finished runs of those times go to runs_history, "
                "and prune_runs deletes them row by row",
                ", ".join(map(str, kept.missing)),
            )
    keep_for = retention()
    if keep_for is not None:
        result = prune_runs(older_than=keep_for, now=now, actor="retention (SCHEDULER_RUN_RETENTION)", via="command",
                            whole_partitions_only=True)
        kept.pruned_runs, kept.pruned_events = result.runs, result.events
        kept.dropped = list(result.dropped)
