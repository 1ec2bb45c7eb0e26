"""The runs history in partitions by time (PostgreSQL; issue 18, docs/performance.md
"Issue 18, step 6").

Migration runs 0015 makes `runs` `PARTITION BY RANGE (kept_for)`: `runs_open` holds
every open run (key `9999-12-31`), and the DEFAULT partition `runs_history` every
ended run no other partition takes. An ended run's key is its scheduled time, so a
partition [start, end) of the history holds the ended runs scheduled in that span.

- **Made ahead.** `make_ahead` makes the partition of now and the
  SCHEDULER_RUN_PARTITIONS_AHEAD after it, SCHEDULER_RUN_PARTITION_WIDTH each (a day
  by default, aligned to 2000-01-01 UTC). The scanner holding partition 0 publishes it
  (`runs.keep_run_partitions`), and `python manage.py run_partitions` runs it by hand.
  A new partition takes what `runs_history` already holds of its span (runs whose
  time was beyond the partitions made so far: a cancelled far-future run), moved
  under the lock that ATTACH takes anyway, so that ATTACH finds the default empty of
  it. `missing` says which spans from now on have no partition: the upkeep logs them
  as an error and the command's `--check` fails on them.
- **Dropped whole.** `drop_older_than(cutoff)` (prune_runs)
  drops a partition whose span ended before the cutoff and whose runs all finished
  before it (the partition's `runs_finished_idx`: a late run that ended after the
  cutoff keeps its whole partition until it is old enough; a row with no
  `finished_at` counts as finished at its scheduled time). Its runs' events and
  notices go first, read by the runs' id range and the partition's key. Open runs
  are never in such a partition, so CONTRACT.md's rule (never an open run) holds by
  construction. The retention upkeep prunes rows of the default partition alone
  (`prune_default`): deleting a time partition's rows one by one, every upkeep, is
  the load this design removes (a 30-minute run at 985 runs/s fell behind under it).
  The `prune_runs` command, after its drops, deletes every old run left by rows.

Locks. Making a partition takes SHARE UPDATE EXCLUSIVE on `runs` (claims and outcomes
go on) and ACCESS EXCLUSIVE on `runs_history` (an outcome moving a run of a time no
partition takes waits for it). Dropping one takes ACCESS EXCLUSIVE on `runs` for its
last step (a check on an index and the DROP): the hot path waits milliseconds. Each
waits at most LOCK_TIMEOUT for its lock and is tried again next time.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

logger = logging.getLogger(__name__)

EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
# How long a DDL step waits for its lock. While it waits, the run statements that
# come after it wait behind it: kept short, and tried again at the next upkeep.
LOCK_TIMEOUT = "500ms"
LOCK_NOT_HAD = ("55P03", "40P01")  # lock_timeout; a deadlock, this side chosen to give way
PREFIX = "runs_p"



def _columns() -> str:
    """Every column of runs but the generated `stage` (the store computes it), from
    the model: a column added later moves with the rows too."""
    from runs.models import Run

    return ", ".join(f.column for f in Run._meta.concrete_fields if not getattr(f, "generated", False))


# A partition's runs' rows in run_events or notices (alias e): the runs' id range reads
# the table's run index, and the partition's key checks each row.
OF_PARTITION = "e.run_id BETWEEN %s AND %s AND EXISTS (SELECT 1 FROM {table} r WHERE r.id = e.run_id)"


@dataclass(frozen=True)
class Span:
    name: str
    start: datetime
    end: datetime

    def __str__(self) -> str:
        return f"[{self.start:%Y-%m-%dT%H:%MZ}, {self.end:%Y-%m-%dT%H:%MZ})"


@dataclass(frozen=True)
class Dropped:
    name: str
    runs: int
    events: int


def in_use() -> bool:
    """Whether `runs` is partitioned here (PostgreSQL after migration runs 0015)."""
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass('runs')")
        row = cursor.fetchone()
    return row is not None and row[0] == "p"


def width() -> timedelta:
    from jobs.schedule import parse_duration

    value = parse_duration(settings.SCHEDULER_RUN_PARTITION_WIDTH, longest=timedelta(days=366))
    if value < timedelta(minutes=1) or value.total_seconds() % 60:
        raise ValueError(f"SCHEDULER_RUN_PARTITION_WIDTH must be whole minutes, 1m or more, not {value}")
    return value


def span_at(when: datetime, size: timedelta | None = None) -> Span:
    """The partition span holding `when`: [start, start + width), aligned to EPOCH."""
    size = size or width()
    start = EPOCH + size * ((when - EPOCH) // size)
    return Span(name=f"{PREFIX}{start:%Y%m%d_%H%M}", start=start, end=start + size)


def spans() -> list[Span]:
    """The history's time partitions, oldest first (not runs_open, not runs_history)."""
    with connection.cursor() as cursor:
        cursor.execute(
            r"""SELECT c.relname, b.m[1]::timestamptz, b.m[2]::timestamptz
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                 CROSS JOIN LATERAL (SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                                         'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS m) b
                 WHERE i.inhparent = 'runs'::regclass AND c.relname <> 'runs_open' AND b.m IS NOT NULL
                 ORDER BY 2"""
        )
        return [Span(name, start, end) for name, start, end in cursor.fetchall()]


def missing(now: datetime, ahead: int | None = None) -> list[Span]:
    """The spans from now's to `ahead` after it that no partition covers."""
    ahead = settings.SCHEDULER_RUN_PARTITIONS_AHEAD if ahead is None else ahead
    size = width()
    have = spans()
    first = span_at(now, size)
    wanted = [span_at(first.start + size * i, size) for i in range(ahead + 1)]
    return [w for w in wanted if not any(h.start < w.end and w.start < h.end for h in have)]


def make_ahead(now: datetime, ahead: int | None = None) -> list[Span]:
    """Make the missing partitions of now's span and the `ahead` after it."""
    made = []
    for span in missing(now, ahead):
        try:
            make(span)
        except Exception as exc:  # noqa: BLE001 - a lock not had in time: next upkeep
            if not _lock_not_had(exc):
                raise
            logger.warning("run partition %s not made (%s): tried again next time", span.name, exc)
            break
        made.append(span)
    return made


# The history's own indexes, which runs_open has not (migration runs 0017): each names
# `stage`, which the queueing and the claim change, and an open run's update is HOT only
# where no index names a column it changes. ATTACH builds the partitioned ones; these
# are built on each new partition before it.
HISTORY_INDEXES = [
    ("runs_status_idx", "(stage, id DESC) WHERE NOT stage = 'succeeded'"),
    ("runs_dead_unhandled_idx", "(id) WHERE handled_at IS NULL AND stage = 'dead'"),
]


def _lock_not_had(exc: BaseException) -> bool:
    return getattr(getattr(exc, "__cause__", None), "sqlstate", None) in LOCK_NOT_HAD


def make(span: Span) -> None:
    """Make one partition of the history, taking its span's rows out of the default."""
    table = connection.ops.quote_name(span.name)
    start, end = _literal(span.start), _literal(span.end)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute("LOCK TABLE runs IN SHARE UPDATE EXCLUSIVE MODE")
        cursor.execute("LOCK TABLE runs_history IN ACCESS EXCLUSIVE MODE")
        cursor.execute(
            f"CREATE TABLE {table} (LIKE runs INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS)"
        )
        # A valid CHECK of the span spares ATTACH its scan of the new table.
        cursor.execute(
            f"ALTER TABLE {table} ADD CONSTRAINT {span.name}_span CHECK (kept_for >= {start} AND kept_for < {end})"
        )
        columns = _columns()
        cursor.execute(
            f"""WITH moved AS (DELETE FROM runs_history WHERE kept_for >= {start} AND kept_for < {end}
                               RETURNING {columns})
                INSERT INTO {table} ({columns}) SELECT {columns} FROM moved"""
        )
        moved = cursor.rowcount
        for name, definition in HISTORY_INDEXES:
            cursor.execute(f"CREATE INDEX {name}{span.name[len('runs'):]} ON {table} {definition}")
        cursor.execute(f"ALTER TABLE runs ATTACH PARTITION {table} FOR VALUES FROM ({start}) TO ({end})")
        cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT {span.name}_span")
        _name_indexes(cursor, span.name)
    logger.info("made run partition %s [%s, %s), %d run(s) moved in", span.name, span.start, span.end, moved)


def _name_indexes(cursor, child: str) -> None:
    """The partition's indexes take their parent index's name and the partition's
    (runs_pkey_p20261206_0000), as migration 0015 names runs_open's, so that a plan
    says which index it read."""
    suffix = child[len("runs"):]
    cursor.execute(
        """SELECT ci.relname, pi.relname || %s
             FROM pg_inherits inh
             JOIN pg_class ci ON ci.oid = inh.inhrelid
             JOIN pg_class pi ON pi.oid = inh.inhparent
             JOIN pg_index x ON x.indexrelid = ci.oid
            WHERE x.indrelid = to_regclass(%s)""",
        [suffix, child],
    )
    for name, wanted in cursor.fetchall():
        if name != wanted:
            cursor.execute(
                f"ALTER INDEX {connection.ops.quote_name(name)} RENAME TO {connection.ops.quote_name(wanted)}"
            )


def droppable(cutoff: datetime) -> list[Span]:
    """The partitions whose span ended by the cutoff and whose runs all finished
    before it (one probe of each one's runs_finished_idx)."""
    found = []
    for span in spans():
        if span.end > cutoff:
            break
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {connection.ops.quote_name(span.name)} "
                           "WHERE finished_at >= %s)", [cutoff])
            if not cursor.fetchone()[0]:
                found.append(span)
    return found


def counted(spans_: list[Span]) -> tuple[int, int]:
    """(runs, events) in these partitions: what dropping them would delete."""
    runs = events = 0
    with connection.cursor() as cursor:
        for span in spans_:
            table = connection.ops.quote_name(span.name)
            cursor.execute(f"SELECT count(*), min(id), max(id) FROM {table}")
            n, low, high = cursor.fetchone()
            runs += n
            if n:
                cursor.execute(f"SELECT count(*) FROM run_events e WHERE {OF_PARTITION.format(table=table)}",
                               [low, high])
                events += cursor.fetchone()[0]
    return runs, events


DEFAULT_OLD_IDS = """SELECT id FROM runs_history WHERE status = ANY(%s) AND finished_at < %s
                     ORDER BY finished_at LIMIT %s"""


def prune_default(cutoff: datetime, terminal: list[str], batch: int, *, dry_run: bool = False) -> tuple[int, int]:
    """The row path, for the default partition alone (runs of times no partition
    covers): finished runs that finished before the cutoff, with their events and
    notices, `batch` runs a transaction. Returns (runs, events). The upkeep prunes no
    time partition by rows: its runs go when all of them are past the cutoff (drop)."""
    if dry_run:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM runs_history WHERE status = ANY(%s) AND finished_at < %s",
                           [terminal, cutoff])
            runs = cursor.fetchone()[0]
            cursor.execute("SELECT count(*) FROM run_events WHERE run_id IN (SELECT id FROM runs_history "
                           "WHERE status = ANY(%s) AND finished_at < %s)", [terminal, cutoff])
            return runs, cursor.fetchone()[0]
    runs = events = 0
    while True:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute(DEFAULT_OLD_IDS, [terminal, cutoff, batch])
            ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return runs, events
            cursor.execute("DELETE FROM run_events WHERE run_id = ANY(%s)", [ids])
            events += cursor.rowcount
            cursor.execute("DELETE FROM notices WHERE run_id = ANY(%s)", [ids])
            # The status again in the DELETE itself: a requeue locks the run, so it
            # cannot reopen it between the read and here, but be sure.
            cursor.execute("DELETE FROM runs_history WHERE id = ANY(%s) AND status = ANY(%s)", [ids, terminal])
            runs += cursor.rowcount


def drop_older_than(cutoff: datetime) -> list[Dropped]:
    """Drop each partition whose span ended at or before the cutoff and whose runs all
    finished before it; a partition it cannot lock in time is left for next time."""
    dropped = []
    for span in spans():
        if span.end > cutoff:
            break
        try:  # drop() probes whether all its runs finished before the cutoff
            done = drop(span, cutoff)
        except Exception as exc:  # noqa: BLE001 - a lock not had in time: next time
            if not _lock_not_had(exc):
                raise
            logger.warning("run partition %s not dropped (%s): tried again next time", span.name, exc)
            continue
        if done is not None:
            dropped.append(done)
    return dropped


def drop(span: Span, cutoff: datetime) -> Dropped | None:
    """Drop one partition if all its runs finished before the cutoff (None if not)."""
    table = connection.ops.quote_name(span.name)
    finished_late = f"SELECT 1 FROM {table} WHERE finished_at >= %s"
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute(f"SELECT EXISTS ({finished_late}), count(*), min(id), max(id) FROM {table}", [cutoff])
        late, runs, low, high = cursor.fetchone()
        if late:
            return None
        events = 0
        if runs:
            # A run's events and notices go with it (the ORM's cascade, here by set).
            cursor.execute(f"DELETE FROM run_events e WHERE {OF_PARTITION.format(table=table)}", [low, high])
            events = cursor.rowcount
            cursor.execute(f"DELETE FROM notices e WHERE {OF_PARTITION.format(table=table)}", [low, high])
        # Nothing enters the partition once `runs` is ours: a run of this span that
        # ended meanwhile (its finished_at after the cutoff) is seen here, and the
        # whole transaction (its deletes too) is given up for next time.
        cursor.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
        cursor.execute(f"SELECT EXISTS ({finished_late}) OR count(*) <> %s FROM {table}", [cutoff, runs])
        if cursor.fetchone()[0]:
            transaction.set_rollback(True)
            return None
        cursor.execute(f"DROP TABLE {table}")
    logger.info("dropped run partition %s [%s, %s): %d run(s), %d event(s)", span.name, span.start, span.end,
                runs, events)
    return Dropped(span.name, runs, events)


def _literal(value: datetime) -> str:
    return f"'{value.astimezone(UTC).isoformat()}'::timestamptz"
