"""Per-minute counters of what runs did, written where their events are written.

`events.record` / `events.record_many` hand each batch's events here; this turns
them into a few counter rows (RunRollup) and adds them with ONE upsert per batch,
inside the batch's transaction, so the counts commit (or roll back) with the rows
they count. One exception: a worker's claims of one message, made in waves as its
runs come due, are counted together once the last wave has started, in one upsert
of their own (runs.services._Batch.write_started); a worker that dies in between
loses those counts. The dashboard and `/metrics` then read these rows, never a count
over `runs` or `run_events`.

A rollup is a figure, not a fact the scheduler acts on: the upsert runs in a
savepoint and any error there is logged and dropped, so it can never fail the
batch (the batch's isolation is the run's, not the counter's). Keys are sorted,
so two batches take the rows' locks in one order and cannot deadlock on them.

Kinds: `started` (a claim; with the lateness of a run's first start), `succeeded`,
`retry_scheduled`, `dead`, `skipped` (with its reason and job), `cancelled`,
`call` and `call_failed` (per target host, from `target_answered`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone as dt_timezone
from typing import Any

from django.db import connection, transaction

from runs.models import ROLLUP_LAG_EDGES, Run

logger = logging.getLogger(__name__)

# The all-time total of a key lives in the row with this minute (the dashboard reads
# recent minutes; /metrics reads this row).
TOTAL_MINUTE = datetime(1970, 1, 1, tzinfo=dt_timezone.utc)
SHARDS = 8
BUCKETS = len(ROLLUP_LAG_EDGES) + 1
KIND_OF_EVENT = {
    "claimed": "started",
    "succeeded": "succeeded",
    "retry_scheduled": "retry_scheduled",
    "dead": "dead",
    "skipped": "skipped",
    "cancelled": "cancelled",
}
SKIP_REASONS = ("misfire", "overlap", "excluded", "paused")
COUNTERS = ("n", "lag_n", "lag_sum", *(f"b{i}" for i in range(BUCKETS)))
KEY = ("minute", "kind", "reason", "host", "job_id", "shard")


@dataclass
class Tally:
    n: int = 0
    lag_n: int = 0
    lag_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * BUCKETS)

    def add_lag(self, seconds: float) -> None:
        self.lag_n += 1
        self.lag_sum += seconds
        self.buckets[bucket_of(seconds)] += 1

    def values(self) -> list[Any]:
        return [self.n, self.lag_n, self.lag_sum, *self.buckets]


def bucket_of(seconds: float) -> int:
    for i, edge in enumerate(ROLLUP_LAG_EDGES):
        if seconds <= edge:
            return i
    return BUCKETS - 1


def skip_reason(detail: Mapping[str, Any]) -> str:
    """`skipped` events say why in words ("misfire policy skip", "overlap"...): the reason's key."""
    text = str(detail.get("reason", "")).lower()
    for reason in SKIP_REASONS:
        if reason in text:
            return reason
    return "other"


def minute_of(at: datetime) -> datetime:
    return at.astimezone(dt_timezone.utc).replace(second=0, microsecond=0)


def tally(rows: Iterable[Any], runs: Mapping[int, Run] | None = None) -> dict[tuple[Any, ...], Tally]:
    """The counters a batch of events adds, by key (minute rows and total rows).

    `runs` (the batch's runs as the writer holds them, job loaded) gives a call's host,
    a skip's job and a claim's lateness; a skip without it is looked up (one query)."""
    runs = runs or {}
    rows = [e for e in rows if e.type in KIND_OF_EVENT or e.type == "target_answered"]
    if not rows:
        return {}
    missing = [e.run_id for e in rows if e.type == "skipped" and e.run_id not in runs]
    job_of = dict(Run.objects.filter(pk__in=missing).values_list("pk", "job_id")) if missing else {}
    shard = os.getpid() % SHARDS
    found: dict[tuple[Any, ...], Tally] = {}

    def bump(at: datetime, kind: str, reason: str = "", host: str = "", job_id: int = 0) -> Tally:
        for minute in (minute_of(at), TOTAL_MINUTE):
            one = found.setdefault((minute, kind, reason, host, job_id, shard), Tally())
            one.n += 1
        return found[(TOTAL_MINUTE, kind, reason, host, job_id, shard)]

    for e in rows:
        run = runs.get(e.run_id)
        if e.type == "target_answered":
            host = _host(run)
            bump(e.at, "call", host=host)
            status = e.detail.get("status")
            if status is None or not 200 <= int(status) < 300:
                bump(e.at, "call_failed", host=host)
            continue
        kind = KIND_OF_EVENT[e.type]
        if kind == "skipped":
            job_id = run.job_id if run is not None else job_of.get(e.run_id, 0)
            bump(e.at, kind, reason=skip_reason(e.detail), job_id=job_id or 0)
            continue
        bump(e.at, kind)
        if kind == "started" and run is not None and run.started_at is None and run.due_at <= e.at:
            # A run's first start, on or after its due time (a retry's or requeue's due
            # time moved past its first start: left out, as the histogram always did).
            lag = (e.at - run.due_at).total_seconds()
            for minute in (minute_of(e.at), TOTAL_MINUTE):
                found[(minute, kind, "", "", 0, shard)].add_lag(lag)
    return found


def _host(run: Run | None) -> str:
    if run is None:
        return ""
    from jobs.validators import target_key

    try:
        return target_key(run.job)[:300]
    except Exception:  # noqa: BLE001 - a figure's label, never a reason to fail
        return ""


def add(found: Mapping[tuple[Any, ...], Tally]) -> None:
    """One upsert for the batch, in a savepoint of the caller's transaction; outside
    one, the upsert alone (one statement, its own transaction). An error is logged,
    never raised."""
    if not found:
        return
    try:
        if connection.in_atomic_block:
            with transaction.atomic():
                _upsert(found)
        else:
            _upsert(found)
    except Exception:  # noqa: BLE001 - a counter must never fail the batch it counts
        logger.warning("run rollups: %d counter rows not written", len(found), exc_info=True)


# Runs a scanner found only when it dropped its floors on its periodic timer: each one
# a run that turned waiting behind a floor with no wake-up from the store (a missing
# trigger, or a row a scan's lock stepped over). /metrics shows the total.
FLOOR_DROP_FOUND = "floor_drop_found"


def add_count(kind: str, n: int) -> None:
    """A counter of the scheduler's own (not a run event's), in its all-time row."""
    if n > 0:
        add({(TOTAL_MINUTE, kind, "", "", 0, os.getpid() % SHARDS): Tally(n=n)})


def merge(into: dict[tuple[Any, ...], Tally], found: Mapping[tuple[Any, ...], Tally]) -> None:
    """Add `found`'s counters to `into`'s (a batch's claims, written together: add)."""
    for key, more in found.items():
        mine = into.setdefault(key, Tally())
        mine.n += more.n
        mine.lag_n += more.lag_n
        mine.lag_sum += more.lag_sum
        mine.buckets = [a + b for a, b in zip(mine.buckets, more.buckets)]


def tally_quietly(rows: Iterable[Any], runs: Mapping[int, Run] | None = None) -> dict[tuple[Any, ...], Tally]:
    """tally, with an error logged and nothing counted (as note does)."""
    try:
        return tally(rows, runs)
    except Exception:  # noqa: BLE001 - a counter must never fail the batch it counts
        logger.warning("run rollups: could not count a batch of events", exc_info=True)
        return {}


def note(rows: Iterable[Any], runs: Mapping[int, Run] | None = None) -> None:
    add(tally_quietly(rows, runs))


def _upsert(found: Mapping[tuple[Any, ...], Tally]) -> None:
    ops = connection.ops
    columns = (*KEY, *COUNTERS)
    one = "(" + ", ".join(["%s"] * len(columns)) + ")"
    params: list[Any] = []
    for key in sorted(found, key=lambda k: (k[0], *k[1:])):
        minute, *rest = key
        params += [ops.adapt_datetimefield_value(minute), *rest, *found[key].values()]
    sets = ", ".join(f"{c} = run_rollups.{c} + excluded.{c}" for c in COUNTERS)
    sql = (
        f"INSERT INTO run_rollups ({', '.join(columns)}) VALUES {', '.join([one] * len(found))} "
        f"ON CONFLICT ({', '.join(KEY)}) DO UPDATE SET {sets}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
