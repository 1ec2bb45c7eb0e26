"""The runs history in partitions by time (PostgreSQL; issue 18, docs/performance.md,
"The store at scale: the due read, retention, growth").

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
- **Events alongside.** `run_events` is partitioned by its run's scheduled time
  (migration runs 0019) with the same spans: each partition of the history has a
  twin, `run_events_p...`, made and dropped with it, and `run_events_default` takes
  the events of times no partition covers.
- **Dropped whole.** `drop_older_than(cutoff)` (prune_runs)
  drops a partition whose span ended before the cutoff and whose runs all finished
  before it (the partition's `runs_finished_idx`: a late run that ended after the
  cutoff keeps its whole partition until it is old enough; a row with no
  `finished_at` counts as finished at its scheduled time), and its events' twin with
  it. Its runs' notices go first, read by the runs' id range and the partition's key.
  Open runs are never in such a partition, so prune_runs' rule (never an open run)
  holds by construction for the runs. An open run of the span (a job paused for
  longer than the retention, a backfill of an old time) has its events in the twin:
  they are moved to the default first (`drop`: the twin detached, their rows copied
  back into `run_events`), so its timeline stays whole. The retention upkeep prunes
  rows of the default partition alone (`prune_default`): deleting a time partition's
  rows one by one, every upkeep, is the load this design removes (a 30-minute run at
  985 runs/s fell behind under it).
  The `prune_runs` command, after its drops, deletes every old run left by rows.

Locks. Making a partition takes SHARE UPDATE EXCLUSIVE on `runs` (claims and outcomes
go on) and ACCESS EXCLUSIVE on `runs_history` (an outcome moving a run of a time no
partition takes waits for it), then the same on `run_events` and its default.
Dropping one takes SHARE on `runs` for an instant first (a barrier: every run written
before it is committed, so the read of the span's open runs that follows misses none),
then ACCESS EXCLUSIVE on `runs` for its last step (a check on an index, the open runs
written since the barrier, the DROPs): the hot path waits milliseconds. Each waits at
most LOCK_TIMEOUT for its lock and is tried again next time.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.db import connection, transaction

from runs.models import OPEN_KEPT_FOR_SQL

logger = logging.getLogger(__name__)

EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
# How long a DDL step waits for its lock. While it waits, the run statements that
# come after it wait behind it: kept short, and tried again at the next upkeep.
LOCK_TIMEOUT = "500ms"
LOCK_NOT_HAD = ("55P03", "40P01")  # lock_timeout; a deadlock, this side chosen to give way
PREFIX = "runs_p"
EVENTS = "run_events"
EVENT_COLUMNS = "id, run_id, at, scheduled_for, type, detail"



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

    @property
    def events(self) -> str:
        """Its twin of run_events: runs_p20261206_0000 -> run_events_p20261206_0000."""
        return EVENTS + self.name[len("runs"):]


@dataclass(frozen=True)
class Dropped:
    name: str
    runs: int
    events: int


def in_use(table: str = "runs") -> bool:
    """Whether `runs` is partitioned here (PostgreSQL after migration runs 0015);
    `run_events` after migration runs 0019."""
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [table])
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


def spans(parent: str = "runs") -> list[Span]:
    """The history's time partitions, oldest first (not runs_open, not the default);
    of run_events with `parent=EVENTS`, named as their runs twins are."""
    with connection.cursor() as cursor:
        cursor.execute(
            r"""SELECT c.relname, b.m[1]::timestamptz, b.m[2]::timestamptz
                  FROM pg_inherits i
                  JOIN pg_class c ON c.oid = i.inhrelid
                 CROSS JOIN LATERAL (SELECT regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                                         'FROM \(''([^'']+)''\) TO \(''([^'']+)''\)') AS m) b
                 WHERE i.inhparent = to_regclass(%s) AND c.relname <> 'runs_open' AND b.m IS NOT NULL
                 ORDER BY 2""",
            [parent],
        )
        rows = cursor.fetchall()
    return [Span("runs" + name[len(parent):], start, end) for name, start, end in rows]


def _overlaps(span: Span, have: list[Span]) -> bool:
    return any(h.start < span.end and span.start < h.end for h in have)


def missing(now: datetime, ahead: int | None = None) -> list[Span]:
    """The spans from now's to `ahead` after it that no partition covers, of runs or
    of run_events."""
    ahead = settings.SCHEDULER_RUN_PARTITIONS_AHEAD if ahead is None else ahead
    size = width()
    have, events = spans(), spans(EVENTS)
    first = span_at(now, size)
    wanted = [span_at(first.start + size * i, size) for i in range(ahead + 1)]
    twins = in_use(EVENTS)
    return [w for w in wanted if not _overlaps(w, have) or (twins and not _overlaps(w, events))]


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
    """Make one partition of the history and its events' twin (whichever is missing),
    taking their span's rows out of the defaults."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute("LOCK TABLE runs IN SHARE UPDATE EXCLUSIVE MODE")
        if not _overlaps(span, spans()):
            cursor.execute("LOCK TABLE runs_history IN ACCESS EXCLUSIVE MODE")
            moved = _make_one(cursor, "runs", "runs_history", span.name, span, "kept_for", _columns(),
                              HISTORY_INDEXES)
            logger.info("made run partition %s [%s, %s), %d run(s) moved in", span.name, span.start, span.end,
                        moved)
        if in_use(EVENTS) and not _overlaps(span, spans(EVENTS)):
            cursor.execute(f"LOCK TABLE {EVENTS} IN SHARE UPDATE EXCLUSIVE MODE")
            cursor.execute(f"LOCK TABLE {EVENTS}_default IN ACCESS EXCLUSIVE MODE")
            moved = _make_one(cursor, EVENTS, f"{EVENTS}_default", span.events, span, "scheduled_for",
                              EVENT_COLUMNS, [])
            logger.info("made run events partition %s, %d event(s) moved in", span.events, moved)


def _make_one(cursor, parent: str, default: str, name: str, span: Span, key: str, columns: str,
              indexes: list[tuple[str, str]]) -> int:
    """Make `name`, a partition of `parent` for `span`, with what `default` holds of it."""
    table = connection.ops.quote_name(name)
    start, end = _literal(span.start), _literal(span.end)
    cursor.execute(
        f"CREATE TABLE {table} (LIKE {parent} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS)"
    )
    # A valid CHECK of the span spares ATTACH its scan of the new table.
    cursor.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name}_span CHECK ({key} >= {start} AND {key} < {end})")
    cursor.execute(
        f"""WITH moved AS (DELETE FROM {default} WHERE {key} >= {start} AND {key} < {end} RETURNING {columns})
            INSERT INTO {table} ({columns}) SELECT {columns} FROM moved"""
    )
    moved = cursor.rowcount
    for index, definition in indexes:
        cursor.execute(f"CREATE INDEX {index}{name[len(parent):]} ON {table} {definition}")
    cursor.execute(f"ALTER TABLE {parent} ATTACH PARTITION {table} FOR VALUES FROM ({start}) TO ({end})")
    cursor.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}_span")
    _name_indexes(cursor, name, parent)
    return moved


def _name_indexes(cursor, child: str, parent: str = "runs") -> None:
    """The partition's indexes take their parent index's name and the partition's
    (runs_pkey_p20261206_0000), as migration 0015 names runs_open's, so that a plan
    says which index it read."""
    suffix = child[len(parent):]
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
    """(runs, events) in these partitions and their twins: what dropping them would
    delete (the twins' events of open runs are kept: drop moves them out)."""
    runs = events = 0
    twins = {s.name for s in spans(EVENTS)}
    with connection.cursor() as cursor:
        for span in spans_:
            table = connection.ops.quote_name(span.name)
            cursor.execute(f"SELECT count(*), min(id), max(id) FROM {table}")
            n, low, high = cursor.fetchone()
            runs += n
            if span.name in twins:
                cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(span.events)} "
                               "WHERE NOT run_id = ANY(%s)", [_open_runs(span)])
                events += cursor.fetchone()[0]
            elif n:
                cursor.execute(f"SELECT count(*) FROM run_events e WHERE {OF_PARTITION.format(table=table)}",
                               [low, high])
                events += cursor.fetchone()[0]
    return runs, events


# Locked as read: a requeue or a retry (runs.ops) locks the run before it reopens it, so
# it waits for this transaction, then finds the run gone; a run it holds is skipped.
DEFAULT_OLD_IDS = """SELECT id FROM runs_history WHERE status = ANY(%s) AND finished_at < %s
                     ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED"""


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
            # The read locked the runs: nothing reopens them before the DELETE.
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


# The span's open runs: those read after the barrier, and any written since it.
OPEN_OF_SPAN = f"""SELECT id FROM runs WHERE kept_for = {OPEN_KEPT_FOR_SQL}
                     AND scheduled_for >= %s AND scheduled_for < %s"""


def drop(span: Span, cutoff: datetime) -> Dropped | None:
    """Drop one partition and its events' twin if all its runs finished before the
    cutoff (None if not). The events of the span's open runs are kept (moved to the
    default): they are found by a read after a barrier, and under the last lock by
    the runs written since that barrier (an index range of the open runs' ids)."""
    table = connection.ops.quote_name(span.name)
    twin = span.name in {s.name for s in spans(EVENTS)}
    finished_late = f"SELECT 1 FROM {table} WHERE finished_at >= %s"
    with connection.cursor() as cursor:  # no barrier for a partition kept anyway
        cursor.execute(f"SELECT EXISTS ({finished_late})", [cutoff])
        if cursor.fetchone()[0]:
            return None
    since = _barrier() if twin else 0
    open_ids = _open_runs(span) if twin else []
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute(f"SELECT EXISTS ({finished_late}), count(*), min(id), max(id) FROM {table}", [cutoff])
        late, runs, low, high = cursor.fetchone()
        if late:
            return None
        events = 0
        if twin:  # counted here, not under the lock below (a scan of the twin)
            cursor.execute(f"SELECT count(*) FROM {connection.ops.quote_name(span.events)}")
            events = cursor.fetchone()[0]
        if runs:
            # A run's notices go with it (the ORM's cascade, here by set); its events
            # too where the span has no twin (one whose making failed, or was dropped
            # by hand: its events then sit in the default).
            if not twin:
                cursor.execute(f"DELETE FROM run_events e WHERE {OF_PARTITION.format(table=table)}", [low, high])
                events = cursor.rowcount
            cursor.execute(f"DELETE FROM notices e WHERE {OF_PARTITION.format(table=table)}", [low, high])
        # Nothing enters the partition once `runs` is ours: a run of this span that
        # ended meanwhile (its finished_at after the cutoff) or was reopened is seen
        # here, and the whole transaction (its deletes too) is given up for next time.
        cursor.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
        cursor.execute(f"SELECT EXISTS ({finished_late}) OR count(*) <> %s FROM {table}", [cutoff, runs])
        if cursor.fetchone()[0]:
            transaction.set_rollback(True)
            return None
        if twin:
            events -= _drop_twin(cursor, span, since, open_ids)
        cursor.execute(f"DROP TABLE {table}")
    logger.info("dropped run partition %s [%s, %s): %d run(s), %d event(s)", span.name, span.start, span.end,
                runs, events)
    return Dropped(span.name, runs, events)


def _barrier() -> int:
    """The runs' id sequence as it stands once every transaction writing runs has
    ended (SHARE on `runs`, held for an instant): a run with an id up to it is
    committed or gone, and a run written later has a higher id (the sequence hands
    ids out in order, one at a time)."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute("LOCK TABLE runs IN SHARE MODE")
        cursor.execute("SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM runs_id_seq")
        return cursor.fetchone()[0]


def _open_runs(span: Span) -> list[int]:
    """The span's open runs (a read of runs_open, no lock held)."""
    with connection.cursor() as cursor:
        cursor.execute(OPEN_OF_SPAN, [span.start, span.end])
        return [row[0] for row in cursor.fetchall()]


def _drop_twin(cursor, span: Span, since: int, open_ids: list[int]) -> int:
    """Drop the span's events partition, under the caller's lock on `runs`, its open
    runs' events moved to the default first. Returns the events kept."""
    twin = connection.ops.quote_name(span.events)
    cursor.execute(f"{OPEN_OF_SPAN} AND (id > %s OR id = ANY(%s))", [span.start, span.end, since, open_ids])
    keep = [row[0] for row in cursor.fetchall()]
    kept = 0
    if keep:
        # Detached, the span is no partition's: its rows copied back go to the default.
        cursor.execute(f"ALTER TABLE {EVENTS} DETACH PARTITION {twin}")
        cursor.execute(f"INSERT INTO {EVENTS} ({EVENT_COLUMNS}) SELECT {EVENT_COLUMNS} FROM {twin} "
                       "WHERE run_id = ANY(%s)", [keep])
        kept = cursor.rowcount
        logger.info("kept %d event(s) of %d open run(s) of %s", kept, len(keep), span.name)
    cursor.execute(f"DROP TABLE {twin}")
    return kept


def _literal(value: datetime) -> str:
    return f"'{value.astimezone(UTC).isoformat()}'::timestamptz"
