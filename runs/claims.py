"""Every fenced statement, and nowhere else.

Each is one statement whose WHERE checks the expected state (and the fence),
followed by a row-count or RETURNING check. A holder whose lease was taken over
has a lower fence than the run's, so none of its writes can match.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, TypeVar

from django.conf import settings
from django.db import IntegrityError, OperationalError, connection, transaction
from django.db.models import BooleanField, Case, DateTimeField, ExpressionWrapper, F, Max, Q, QuerySet, Value, When
from django.db.models.expressions import Expression, RawSQL
from django.utils import timezone

from runs.models import ON_ROW_CLAIMED, ON_ROW_QUEUED, OPEN_KEPT_FOR, OPEN_KEPT_FOR_SQL, Run, with_status

S = Run.Status

# The claim: running, a fresh lease, fence plus one, attempt plus one -- only if
# nobody holds a live lease (queued, or running with a lease that ran out), the
# run is not held, and it is due. Raw SQL because the ORM cannot say RETURNING on
# update. {now} and {until} are the store's clock (see store_clock_sql), never a
# worker's: a run the scanner queued ahead of its due time (SCHEDULER_LOOKAHEAD)
# cannot start early, however far ahead the worker's own clock runs.
CLAIM_SQL = """
UPDATE runs
   SET status = 'running',
       fence = fence + 1,
       attempt = attempt + 1,
       lease_owner = %s,
       lease_expires_at = {until},
       started_at = COALESCE(started_at, {now}),
       on_row = on_row | 4,
       on_row_claimed_at = {now},
       on_row_worker = %s,
       queued_at = {sent}
 WHERE id = %s
   AND held = %s
   AND due_at <= {now}
   AND (status = 'queued' OR (status = 'running' AND lease_expires_at < {now}))
   AND (on_row & 4) = 0
RETURNING fence, attempt, started_at, on_row_claimed_at
"""
# The claim puts its `claimed` entry on the row (runs.timeline: bit 4, ON_ROW_CLAIMED).
# A run whose row still carries an earlier claim's entry (a lease that ran out and is
# taken over directly, with no event between) is not taken by it: claim_many turns
# that entry into a row (runs.events.settle) and claims again.
assert ON_ROW_CLAIMED == 4
# The deliberate bug (see _fence_checks_disabled): any running run can be claimed.
CLAIM_SQL_WITHOUT_LEASE_CHECK = CLAIM_SQL.replace(
    "(status = 'queued' OR (status = 'running' AND lease_expires_at < {now}))",
    "(status = 'queued' OR (status = 'running' AND (lease_expires_at < {now} OR lease_expires_at IS NOT NULL)))",
)
assert CLAIM_SQL_WITHOUT_LEASE_CHECK != CLAIM_SQL


def _fence_checks_disabled() -> bool:
    """A deliberate bug, for the soak's self-test only (tests/reliability/test_soak.py).

    With it the claim ignores a live lease and finish/schedule_retry ignore the
    fence, so a superseded holder's outcome is recorded: the soak must catch
    that. Both variables must be set, and only the tests set SCHEDULER_TESTING.
    """
    return os.environ.get("SCHEDULER_TESTING") == "1" and os.environ.get("SCHEDULER_TEST_DISABLE_FENCE") == "1"


def _holder(run_id: int, fence: int) -> Q:
    # The WHERE of every outcome write: this run, still running, under this fence.
    if _fence_checks_disabled():
        return Q(pk=run_id, status=S.RUNNING)
    return Q(pk=run_id, fence=fence, status=S.RUNNING)


@dataclass(frozen=True)
class Claim:
    run_id: int
    fence: int
    attempt: int
    worker: str
    # The run's first claim (kept across retries and lease take-overs): when it went
    # in flight, for the overlap policy (runs.nextrun.job_next_runs).
    started_at: datetime | None = None
    # This claim's own time, the store's clock in its statement (the row's `claimed`
    # entry): what is written beside the claim is stamped no earlier than it.
    claimed_at: datetime | None = None


def _as_datetime(value: object) -> datetime | None:
    # PostgreSQL hands back an aware datetime; the embedded SQLite file, its text form.
    if value is None:
        return None
    parsed = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=dt_timezone.utc)


def _db_time(value: datetime) -> object:
    # Raw SQL needs the backend's own form of a datetime (SQLite stores naive UTC text).
    return connection.ops.adapt_datetimefield_value(value)


# ------------------------------------------------------------- the store's clock
#
# Every lease is written and compared in one clock, the store's: a worker, a
# scanner and the API run on different machines whose clocks drift apart, and a
# lease written in one clock and read in another is taken over early (or late) by
# the skew. On PostgreSQL the statement reads the clock itself; the embedded
# SQLite mode is one machine, whose clock is the store's.


def _clock_in_the_database() -> bool:
    """Whether the store's clock is the database server's (PostgreSQL) or this
    process's (the embedded SQLite file: one machine). The one place a test that
    mocks the clock (tests/runs/test_stateful.py) points the store's clock at its
    own: every lease and due time goes through store_now and store_clock_sql."""
    return connection.vendor == "postgresql"


def store_now() -> datetime:
    """The store's clock, for the times a process compares with lease times
    (the scan's `now`, the worker's admission and heartbeat): one cheap read."""
    if not _clock_in_the_database():
        return timezone.now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        value: datetime = cursor.fetchone()[0]
    return value


def store_clock_offset() -> tuple[datetime, float]:
    """The store's clock now, and how many seconds it is ahead of this process's
    (negative: behind), from one store_now() read halfway between two local ones.
    A worker waits for a run's due time on its own clock plus this offset, so the
    wait is right on a machine whose clock is off; the claim's own check (CLAIM_SQL:
    `due_at <= {now}`) is what keeps a run from starting early if it is still wrong."""
    before = time.time()
    now = store_now()
    after = time.time()
    return now, now.timestamp() - (before + after) / 2


def store_clock_sql(plus: timedelta = timedelta(0)) -> tuple[str, list[object]]:
    """SQL for the store's clock plus `plus`, and its parameters. STATEMENT_TIMESTAMP:
    one instant per statement, so a batch's leases all end together."""
    if _clock_in_the_database():
        return ("(STATEMENT_TIMESTAMP() + %s)", [plus]) if plus else ("STATEMENT_TIMESTAMP()", [])
    return "%s", [_db_time(timezone.now() + plus)]


class StoreClock(Expression):
    """store_clock_sql as an ORM expression: `.update(lease_expires_at=StoreClock(lease))`,
    `.filter(lease_expires_at__lt=StoreClock())`."""

    output_field = DateTimeField()

    def __init__(self, plus: timedelta = timedelta(0)) -> None:
        super().__init__()
        self.plus = plus

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[object]]:
        return store_clock_sql(self.plus)


def _claim_sql(template: str, lease: timedelta) -> tuple[str, list[object], list[object]]:
    """The claim statement in the store's clock: the SQL, the lease end's parameters
    and the clock's (read three times after the lease end: started_at, then the due
    check and the lease check, which come after the id and held parameters)."""
    now_sql, now_params = store_clock_sql()
    until_sql, until_params = store_clock_sql(lease)
    return template.format(now=now_sql, until=until_sql), until_params, now_params


def _moved_away(error: BaseException) -> bool:
    return getattr(getattr(error, "__cause__", None), "sqlstate", None) == "40001" and (
        "moved to another partition" in str(error)
    )


def _partition_made_meanwhile(error: BaseException) -> bool:
    """A row routed to the history's default partition just as a time partition for its
    key was attached (runs.partitions.make): the statement routed by the partitions it
    started with, and the default's constraint, changed by the attach, now refuses the
    row. Made again, the write routes it to the new partition."""
    return getattr(getattr(error, "__cause__", None), "sqlstate", None) == "23514" and (
        "violates partition constraint" in str(error)
    )


T = TypeVar("T")

# How often a write whose row was moved under it is made again (each time another
# transaction moved one of its rows and committed: a batch meets a few at most).
MOVED_TRIES = 5


def again_if_moved(write: Callable[..., T]) -> Callable[..., T]:
    """Make `write` again, in a savepoint of its own, when a row it waited for was moved
    between the store's partitions by the transaction it waited for (migration runs
    0015: ending a run moves it into the history, a requeue moves it back).

    The same when a time partition for a row's key was attached while the write was
    routing the row to the history's default partition (_partition_made_meanwhile).

    In one table the waiting statement re-checked its WHERE against the row's new
    version; across partitions PostgreSQL raises "tuple to be locked was already moved
    to another partition due to concurrent update" (SQLSTATE 40001) instead. The
    transaction that moved it has committed, so the write made again reads the row
    where it is now and decides as before: a heartbeat or a claim of a run that ended
    takes nothing (tests/runs/test_moved_rows.py).

    Inside a transaction each try is a savepoint; outside one, `write` must be one
    statement or a transaction of its own (each try then leaves nothing behind), so
    that a claim stays one statement with no transaction around it."""

    @functools.wraps(write)
    def made_again(*args: Any, **kwargs: Any) -> T:
        for tries_left in range(MOVED_TRIES - 1, -1, -1):
            try:
                with transaction.atomic() if connection.in_atomic_block else nullcontext():
                    return write(*args, **kwargs)
            except (OperationalError, IntegrityError) as e:
                if not tries_left or not (_moved_away(e) or _partition_made_meanwhile(e)):
                    raise
        raise AssertionError("unreachable")

    return made_again


def claim(*, run_id: int, worker: str, lease: timedelta) -> Claim | None:
    """Take the run's lease. None means someone else has it, or it is not due yet
    by the store's clock (see claim_many)."""
    found = claim_many(run_ids=[run_id], worker=worker, lease=lease)
    return found[0] if found else None


def claim_many(*, run_ids: list[int], worker: str, lease: timedelta, sent_at: datetime | None = None) -> list[Claim]:
    """The claim for a batch of runs, one statement: the runs someone else holds,
    that are no longer queued, or that are not due yet by the store's clock, are
    simply not returned. `sent_at`: when the message the runs came in was published
    (the scanner's clock, in the message); a claimed run's `queued_at` becomes it,
    so a running run says which copy of its message started it (claimed_up_to)."""
    return claim_many_clocked(run_ids=run_ids, worker=worker, lease=lease, sent_at=sent_at)[0]


def claim_many_clocked(
    *, run_ids: list[int], worker: str, lease: timedelta, sent_at: datetime | None = None
) -> tuple[list[Claim], datetime]:
    """claim_many, and the store's clock that its first statement checked due times
    against (read in that statement on PostgreSQL, so a wave of claims costs one
    statement): a run it did not take that is due after that clock may only have been
    early."""
    if not run_ids:
        return [], store_now()
    taken, clock = _claim_ids(run_ids, worker, lease, sent_at)
    left = set(run_ids) - {c.run_id for c in taken}
    if left:
        again = _settle_claimed(sorted(left))
        if again:
            taken += _claim_ids(again, worker, lease, sent_at)[0]
    return taken, clock


# The claim wrapped so that it answers one row even when it takes nothing: its clock
# ({now}, the same parameters as the claim's own), with the claimed rows beside it.
CLOCKED_CLAIM_SQL = """
WITH c AS ({claim})
SELECT c.id, c.fence, c.attempt, c.started_at, c.on_row_claimed_at, clock.now
  FROM (SELECT {now} AS now) AS clock LEFT JOIN c ON TRUE
"""


@again_if_moved  # one statement
def _claim_ids(run_ids: list[int], worker: str, lease: timedelta, sent_at: datetime | None = None
               ) -> tuple[list[Claim], datetime]:
    template = CLAIM_SQL_WITHOUT_LEASE_CHECK if _fence_checks_disabled() else CLAIM_SQL
    # Without a send time queued_at stays; with one, it is the message's word: never
    # later than the store's clock.
    if sent_at is None:
        template, sent = template.replace("{sent}", "queued_at"), []
    elif connection.vendor == "postgresql":
        template, sent = template.replace("{sent}", "LEAST(%s::timestamptz, {now})"), [sent_at, *store_clock_sql()[1]]
    else:
        template, sent = template.replace("{sent}", "%s"), [sent_at]
    if connection.vendor == "postgresql":
        # One array, not a placeholder a run: the statement's text is the same for every
        # batch, so the driver splits it once (a query of hundreds of placeholders is
        # parsed again on every call, a fair share of a worker's time at full load).
        # The open runs' partition by name (runs.models.OPEN_KEPT_FOR_SQL).
        template = template.replace("WHERE id = %s", f"WHERE id = ANY(%s::bigint[]) AND kept_for = {OPEN_KEPT_FOR_SQL}")
        ids: list[object] = [list(run_ids)]
    else:
        template = template.replace("WHERE id = %s", "WHERE id IN ({})".format(", ".join(["%s"] * len(run_ids))))
        ids = list(run_ids)
    template = template.replace("RETURNING fence, attempt", "RETURNING id, fence, attempt")
    assert "RETURNING id, fence, attempt, started_at" in template
    # PostgreSQL: one statement, the claim and the clock it checked due times against
    # (read last). The embedded SQLite file: the store's clock is this process's.
    clocked = connection.vendor == "postgresql"
    if clocked:
        template = CLOCKED_CLAIM_SQL.format(claim=template.strip(), now="{now}")
    else:
        clock = store_now()
    sql, until, now = _claim_sql(template, lease)
    with connection.cursor() as cursor:
        cursor.execute(sql, [worker, *until, *now, *now, worker, *sent, *ids, False, *now, *now, *(now if clocked else [])])
        rows = cursor.fetchall()
    if clocked:
        clock = _as_datetime(rows[0][5])
        rows = [r for r in rows if r[0] is not None]
    assert clock is not None
    return [
        Claim(run_id=int(r[0]), fence=int(r[1]), attempt=int(r[2]), worker=worker, started_at=_as_datetime(r[3]),
              claimed_at=_as_datetime(r[4]))
        for r in rows
    ], clock


def _settle_claimed(run_ids: list[int]) -> list[int]:
    """Of runs the claim did not take, those whose row still carries an earlier claim's
    entry: that entry (and the row's others) written as rows, so they can be claimed."""
    from runs import events

    with transaction.atomic():
        free = Q(status=S.QUEUED) | Q(status=S.RUNNING, lease_expires_at__lt=StoreClock())
        if _fence_checks_disabled():
            free = Q(status__in=(S.QUEUED, S.RUNNING))
        carrying = Run.objects.filter(free, pk__in=run_ids).values_list("pk", "on_row")
        ids = [pk for pk, bits in carrying if bits & ON_ROW_CLAIMED]
        events.write_settled(ids)
    return ids


@dataclass(frozen=True)
class Outcome:
    """What a holder writes when its call is over: a terminal status, or back to
    `scheduled` with a later due_at (a retry)."""

    run_id: int
    fence: int
    status: str  # succeeded, dead, or scheduled (a retry)
    now: datetime
    error: str = ""
    due_at: datetime | None = None  # for a retry
    # The timeline entries this outcome puts on the row (Run.on_row bits), and their facts.
    on_row: int = 0
    answer: int | None = None
    duration_ms: int | None = None


# A batch of outcomes in one statement (PostgreSQL): each row only under its fence,
# only while the run is still running. RETURNING says which holders were current.
OUTCOMES_SQL = """
UPDATE runs AS r
   SET status = v.status,
       kept_for = CASE WHEN v.status IN ({open_statuses}) THEN {open} ELSE r.scheduled_for END,
       finished_at = v.finished_at,
       due_at = COALESCE(v.due_at, r.due_at),
       last_error = v.error,
       lease_owner = '',
       lease_expires_at = NULL,
       queued_at = CASE WHEN v.status = 'scheduled' THEN NULL ELSE r.queued_at END,
       on_row = r.on_row | CASE WHEN r.fence = v.fence THEN v.on_row ELSE 0 END,
       on_row_answer = v.answer,
       on_row_duration_ms = v.duration_ms
  FROM unnest(%s::bigint[], %s::bigint[], %s::varchar[], %s::timestamptz[], %s::timestamptz[], %s::text[],
              %s::smallint[], %s::smallint[], %s::integer[])
       AS v(id, fence, status, finished_at, due_at, error, on_row, answer, duration_ms)
 WHERE r.id = v.id AND r.fence = v.fence AND r.status = 'running' AND r.kept_for = {open}
RETURNING r.id, r.fence = v.fence
""".format(open=OPEN_KEPT_FOR_SQL, open_statuses=", ".join(f"'{s}'" for s in Run.OPEN))  # runs.models.kept_for_of
# The entries go on the row only under the row's own fence (r.fence = v.fence, always
# true where the fence is checked): an on-row entry says the row's fence, so a write
# the deliberate bug lets through under an older one is told by rows (its own fence).
# The batch comes as one array a column (unnest): the same text for every batch.


def record_outcomes(outcomes: list[Outcome]) -> set[int]:
    """Write each outcome under its fence; returns the runs whose write landed.
    A run missing from the answer had its lease taken over: a stale holder."""
    return record_outcomes_on_row(outcomes)[0]


@again_if_moved
def record_outcomes_on_row(outcomes: list[Outcome]) -> tuple[set[int], set[int]]:
    """record_outcomes, and the runs whose outcome put its timeline entries on the row
    (Outcome.on_row: only under the row's own fence)."""
    if not outcomes:
        return set(), set()
    if connection.vendor != "postgresql":
        landed, on_row = set(), set()
        for o in outcomes:
            placed = _record_one(o)
            if placed is not None:
                landed.add(o.run_id)
                if placed:
                    on_row.add(o.run_id)
        return landed, on_row
    sql = OUTCOMES_SQL
    if _fence_checks_disabled():
        sql = sql.replace("r.fence = v.fence AND ", "")
    columns: list[list[object]] = [[] for _ in range(9)]
    for o in outcomes:
        finished = None if o.status == S.SCHEDULED else o.now
        for column, value in zip(columns, (o.run_id, o.fence, o.status, finished, o.due_at, o.error[:2000],
                                           o.on_row, o.answer, o.duration_ms)):
            column.append(value)
    params: list[object] = list(columns)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = cursor.fetchall()
    wanted = {o.run_id for o in outcomes if o.on_row}
    return {int(row[0]) for row in rows}, {int(row[0]) for row in rows if row[1] and int(row[0]) in wanted}


def _record_one(o: Outcome) -> bool | None:
    """None: a stale holder; else whether its entries went on the row."""
    if o.status == S.SCHEDULED:
        assert o.due_at is not None
        return False if schedule_retry(run_id=o.run_id, fence=o.fence, due_at=o.due_at, error=o.error) else None
    if o.on_row and _fence_checks_disabled() and not Run.objects.filter(pk=o.run_id, fence=o.fence).exists():
        o = Outcome(o.run_id, o.fence, o.status, o.now, error=o.error)  # the bug's write: told by rows
    if not finish(run_id=o.run_id, fence=o.fence, status=o.status, now=o.now, error=o.error, on_row=o.on_row,
                  answer=o.answer, duration_ms=o.duration_ms):
        return None
    return bool(o.on_row)


def may_claim(run: Run, now: datetime) -> bool:
    """The claim's condition, read without writing: whether to try at all. The
    claim itself still decides (someone may get there between the two). `now`
    is the store's clock (store_now), the one the lease was written in. The due
    time is not looked at: a run queued ahead of it is waited for, then claimed
    (runs.services.run_execute_many)."""
    if run.held:
        return False
    if run.status == S.QUEUED:
        return True
    if run.status != S.RUNNING:
        return False
    return _fence_checks_disabled() or (run.lease_expires_at is not None and run.lease_expires_at < now)


def detach_many(*, fences: dict[int, int]) -> list[int]:
    """Overlap `allow`: the runs (run id -> the fence each was just claimed under) are
    no longer their jobs' waiting runs (runs.models.JOBS_OPEN_RUN), so each job's next
    run can be made beside them (runs.services._detach_claimed). Returns the runs
    detached; not one whose holder is not that fence, a backfill, or one detached
    already. Two statements for them all: one statement a run cost the soak under
    load's workers 21% of their time (2026-12-01, 135 runs/s, every load job an
    allow-job)."""
    if not fences:
        return []
    holders = Q()
    for run_id, fence in fences.items():
        holders |= _holder(run_id, fence)
    with transaction.atomic():  # the caller's transaction, as a rule (a savepoint then)
        ids = list(
            Run.objects.filter(holders, is_backfill=False, detached=False)
            .select_for_update(of=("self",))
            .order_by("pk")
            .values_list("pk", flat=True)
        )
        if ids:
            Run.objects.filter(pk__in=ids, kept_for=OPEN_KEPT_FOR).update(detached=True)
    return ids


@again_if_moved
def heartbeat(*, run_id: int, fence: int, lease: timedelta) -> bool:
    """Extend the lease, in the store's clock. False means the lease was taken over
    (or the run ended)."""
    return (
        Run.objects.filter(pk=run_id, fence=fence, status=S.RUNNING).update(lease_expires_at=StoreClock(lease))
        == 1
    )


@again_if_moved
def finish(
    *, run_id: int, fence: int, status: str, now: datetime, error: str = "", on_row: int = 0,
    answer: int | None = None, duration_ms: int | None = None,
) -> bool:
    """Record a terminal outcome under the lease's fence. False: a stale holder.
    `on_row`: the timeline entries (Run.on_row bits) it puts on the row, with their facts."""
    return (
        Run.objects.filter(_holder(run_id, fence)).update(
            status=status,
            finished_at=now,
            last_error=error[:2000],
            lease_owner="",
            lease_expires_at=None,
            on_row=F("on_row").bitor(on_row),
            on_row_answer=answer,
            on_row_duration_ms=duration_ms,
        )
        == 1
    )



@again_if_moved
def schedule_retry(*, run_id: int, fence: int, due_at: datetime, error: str) -> bool:
    """Back to scheduled with a later due_at: the retry is a row, not a message."""
    return (
        Run.objects.filter(_holder(run_id, fence)).update(
            status=S.SCHEDULED,
            due_at=due_at,
            last_error=error[:2000],
            lease_owner="",
            lease_expires_at=None,
            queued_at=None,
        )
        == 1
    )


def defer(*, run_id: int, due_at: datetime) -> bool:
    """Back to scheduled, unclaimed, for a run the worker may not call yet (its
    target's bulkhead is full or its breaker is open). Only a run nobody holds a
    live lease on, the claim's own condition; fence and attempt are untouched,
    so waiting spends no try. False: someone claimed it, or holds its row, now."""
    return run_id in defer_many(due={run_id: due_at})


def defer_many(*, due: dict[int, datetime]) -> dict[int, tuple[datetime | None, datetime]]:
    """`defer` for many runs in two statements, each run to its own `due_at`; returns
    the runs deferred, each with its `queued_at` as it was and the store's clock of
    the statement that locked it (both read under the row lock: the deferral's event
    is stamped between them, runs.services._defer_many). A row another transaction
    holds (a worker claiming it, a scan publishing it again) is skipped, not waited
    for: it is not this worker's to defer."""
    if not due:
        return {}
    nobody_holds_it = Q(status=S.QUEUED) | Q(status=S.RUNNING, lease_expires_at__lt=StoreClock())
    with transaction.atomic():
        found = {
            pk: (queued_at, locked_at)
            for pk, queued_at, locked_at in Run.objects.filter(
                nobody_holds_it, pk__in=list(due), held=False, kept_for=OPEN_KEPT_FOR)
            .select_for_update(skip_locked=True, of=("self",))
            .order_by("pk")
            .annotate(locked_at=StoreClock())
            .values_list("pk", "queued_at", "locked_at")
        }
        if found:
            Run.objects.filter(pk__in=list(found), kept_for=OPEN_KEPT_FOR).update(
                status=S.SCHEDULED,
                due_at=Case(*[When(pk=pk, then=Value(due[pk])) for pk in found], output_field=DateTimeField()),
                queued_at=None, lease_owner="", lease_expires_at=None,
            )
    return found


# How far past the store's clock a run in flight can be due: it was queued when due by
# then plus the look-ahead (scanners.scan: lock_due's horizon), and its due time does not
# change while it is in flight (a retry, a requeue or a rescheduling makes it waiting
# again first). runs_due_idx_open holds the waiting runs and those in flight together
# (migration runs 0017, so that neither the queueing nor the claim writes an index
# entry): a read of runs in flight names this bound, and reads the runs due by then,
# not every open run of its partitions. The slack covers the clock read between the
# scanner's horizon and the statement. A look-ahead lowered since a run was queued
# delays its recovery by at most the old look-ahead, until it is due by the new one.
IN_FLIGHT_SLACK = timedelta(seconds=1)


def in_flight_due_bound() -> timedelta:
    """What a read of runs in flight adds to the store's clock: every run in flight is
    due by then."""
    return timedelta(seconds=settings.SCHEDULER_LOOKAHEAD) + IN_FLIGHT_SLACK


def in_flight(up_to: datetime | None = None) -> Q:
    """Runs that can be in flight, said so that runs_due_idx_open (partition, due_at,
    held) serves the read as one range a partition: due by in_flight_due_bound, held or
    not (a queued run can be held); with `up_to`, due by then too (the highest of the
    scanner's ceilings over the partitions read, scanners.wakeups.Ceilings)."""
    bound = Q(due_at__lte=StoreClock(in_flight_due_bound()))
    return bound if up_to is None else bound & Q(due_at__lte=up_to)


# The ceilings of a scanner's reads of runs in flight (scanners.wakeups.Ceilings): in
# each partition, the highest (due time, id) a run in flight there can have, as its
# scanner knows it. runs_due_idx_open orders waiting runs and runs in flight together,
# by due time; in a backlog the waiting runs due are all above the last run the scanner
# took, so a read bounded by it reads the runs in flight and not the backlog (which a
# read bounded by the clock alone read whole, three times a second: docs/performance.md).
# NO_CEILING: not known, read up to in_flight_due_bound; NONE_IN_FLIGHT: the partition
# has no run in flight.
NO_CEILING = (datetime.max.replace(tzinfo=dt_timezone.utc), 2**63 - 1)
NONE_IN_FLIGHT = (datetime(1, 1, 1, tzinfo=dt_timezone.utc), 0)


def _key_arrays(partitions: list[int], keys: "dict[int, tuple[datetime, int]] | None",
                missing: tuple[datetime, int]) -> list[object]:
    """The (partition, due_at, id) arrays of a read a partition at a time from a key each."""
    found = [(keys or {}).get(p, missing) for p in partitions]
    return [list(partitions), [k[0] for k in found], [k[1] for k in found]]


def ceiling_params(partitions: list[int], ceilings: "dict[int, tuple[datetime, int]] | None") -> list[object]:
    """The (partition, up_to_at, up_to_id) arrays of the probe's reads of runs in flight."""
    return _key_arrays(partitions, ceilings, NO_CEILING)


def ceiling_up_to(partitions: list[int], ceilings: "dict[int, tuple[datetime, int]] | None") -> datetime | None:
    """One due time every run in flight of these partitions is due by, as far as the
    ceilings know (their highest); None when one of them is not known."""
    if not ceilings or any(p not in ceilings for p in partitions):
        return None
    return max(ceilings[p][0] for p in partitions)


def _lock_ids(query: "QuerySet[Run]", limit: int) -> list[int]:
    # Rows another scanner is already handling are skipped, not waited for
    # (SQLite has no row locks; its IMMEDIATE transactions serialize instead).
    assert connection.in_atomic_block, "recovery statements run inside the scan's transaction"
    return list(query.select_for_update(skip_locked=True, of=("self",)).values_list("pk", flat=True)[:limit])


def release_expired_leases(*, partitions: list[int], now: datetime, limit: int,
                           up_to: datetime | None = None) -> list[int]:
    """Running runs whose lease ran out (dead or frozen worker) go back to queued.
    "Ran out" by the store's clock, in the statement; `now` is only written down.

    The run keeps its fence: the next claim raises it, which is what shuts the
    old holder out.
    """
    ran_out = Q(lease_expires_at__lt=StoreClock())
    ids = _lock_ids(
        Run.objects.filter(ran_out, in_flight(up_to), with_status(S.RUNNING), partition__in=partitions).order_by(
            "lease_expires_at"
        ),
        limit,
    )
    if ids:
        Run.objects.filter(pk__in=ids, kept_for=OPEN_KEPT_FOR).update(
            status=S.QUEUED, queued_at=now, lease_owner="", lease_expires_at=None)
    return ids


# How many times SCHEDULER_REQUEUE_AFTER a queued run waits, at most, between two
# copies of its message (touch_unclaimed).
REPUBLISH_BACKOFF_CAP = 8


def touch_unclaimed(
    *, partitions: list[int], now: datetime, older_than: timedelta, limit: int, before: datetime | None = None,
    up_to: datetime | None = None,
) -> list[int]:
    """Queued runs no worker claimed in time: their message may be lost, publish again.
    "In time" counts from the later of when the run was queued and when it is due: a
    run queued ahead of its due time (SCHEDULER_LOOKAHEAD) is waited for by the
    worker holding its message, so its time to be claimed starts at its due time.
    The oldest first, at most `limit`: the scanner's republish budget
    (scanners.scan.republish_budget), so a backlog is not sent twice. `before`: only
    runs queued before it too (scanners.scan._republish: what the workers have reached)."""
    cut = now - older_than if before is None else min(now - older_than, before)
    # Each copy waits at least as long as the run had waited when it was last sent
    # (queued_at - due_at), up to REPUBLISH_BACKOFF_CAP x older_than: copies of a run
    # at 1, 2, 4, 8 ... x older_than after it came due, so a backlog the cut
    # misjudges costs a few copies a run, not one every older_than.
    backed_off = Q(queued_at__lt=now - older_than * REPUBLISH_BACKOFF_CAP) | Q(
        next_copy_at__lt=now
    )
    ids = _lock_ids(
        Run.objects.filter(in_flight(up_to), with_status(S.QUEUED), partition__in=partitions, queued_at__lt=cut, due_at__lt=cut)
        .alias(next_copy_at=ExpressionWrapper(
            F("queued_at") + (F("queued_at") - F("due_at")), output_field=DateTimeField()
        ))
        .filter(backed_off)
        .order_by("queued_at"),
        limit,
    )
    if ids:
        Run.objects.filter(pk__in=ids, kept_for=OPEN_KEPT_FOR).update(queued_at=now)
    return ids


def claimed_up_to(*, partitions: list[int], since: datetime, up_to: datetime | None = None) -> datetime | None:
    """How far through what was published the workers have got: the latest
    `queued_at` among these partitions' runs running now or finished since `since`,
    which the claim set to the publish time of the message that started each
    (claim_many's `sent_at`; a message from before that rule, or handed back by a
    worker, leaves it at the time of the run's last copy). None: no run is running
    and none finished since `since`, the workers have taken none of these
    partitions' messages lately. Finished runs count too: the load's calls take
    milliseconds, and at 135 runs/s in the soak there were often no running runs at
    the moment of a scan, which put the republish back on its plain cut. Two reads:
    runs_due_idx_open's runs due by in_flight_due_bound and runs_finished_idx's since `since`
    (SCHEDULER_REQUEUE_AFTER's worth of outcomes)."""
    mine = Run.objects.filter(partition__in=partitions)
    found = [
        mine.filter(in_flight(up_to), with_status(S.RUNNING)).aggregate(latest=Max("queued_at"))["latest"],
        mine.filter(finished_at__gte=since).aggregate(latest=Max("queued_at"))["latest"],
    ]
    known = [t for t in found if t is not None]
    return max(known) if known else None


# The oldest due runs over a scanner's partitions: one short range read of
# runs_due_idx per partition (each stops at the limit), merged by due_at. A plain
# `partition IN (...) ORDER BY due_at` cannot use the index for the order and
# sorts every due row: 90 ms per read with 100,000 due, against 6 ms this way
# (docs/performance.md). Unlocked: the outer query re-checks and locks.
DUE_IDS_SQL = """
SELECT d.id
  FROM unnest(%s::integer[], %s::timestamptz[], %s::bigint[]) AS p(part, after_at, after_id)
 CROSS JOIN LATERAL (
       SELECT r.id, r.due_at
         FROM runs r
        WHERE r.partition = p.part AND (r.due_at, r.id) > (p.after_at, p.after_id)
          AND r.stage = 'waiting' AND NOT r.held AND r.due_at <= %s
          AND r.kept_for = {open}
        ORDER BY r.due_at, r.id
        LIMIT %s) d
 ORDER BY d.due_at, d.id
 LIMIT %s
""".format(open=OPEN_KEPT_FOR_SQL)

# Where a scanner's reads of waiting runs start in each partition: after the last run
# (due time, id) its scans took there (scanners.scan.scan_once's floors). runs_due_idx_open holds
# the waiting runs and those in flight together (migration runs 0017), the ones in
# flight due first: without it each read walked every run in flight of its partitions,
# up to SCHEDULER_MAX_QUEUED, on every probe and scan. None: from the start.
NO_FLOOR = NONE_IN_FLIGHT  # the lowest (due time, id) there is


def floor_params(partitions: list[int], after: "dict[int, tuple[datetime, int]] | None") -> list[object]:
    """The (partition, after_at, after_id) arrays of DUE_IDS_SQL and the probe's due part."""
    return _key_arrays(partitions, after, NO_FLOOR)


def waiting_due(now: datetime) -> "QuerySet[Run]":  # what a due read takes
    return Run.objects.filter(with_status(S.SCHEDULED), held=False, due_at__lte=now)


def lock_due(*, partitions: list[int], now: datetime, limit: int,
             after: "dict[int, tuple[datetime, int]] | None" = None) -> "QuerySet[Run]":
    """The scanner's question: waiting_due in my partitions, oldest first, at most
    `limit`; in each partition after `after`'s (due time, id) (PostgreSQL; SQLite reads
    from the start). Locked: a second scanner (a frozen one that still believes it owns
    them) skips them."""
    assert connection.in_atomic_block, "the due read runs inside the scan's transaction"
    due = waiting_due(now)
    if connection.vendor == "postgresql":
        # `= ANY(ARRAY(...))`, not `IN (...)`: the ids come as one array, looked up
        # by primary key, which the planner never turns into a scan of the table.
        due = due.filter(RawSQL(f'"runs"."id" = ANY(ARRAY({DUE_IDS_SQL}))',
                                (*floor_params(list(partitions), after), now, limit, limit),
                                output_field=BooleanField()))
    else:  # the embedded SQLite file: small, and no LATERAL
        due = due.filter(partition__in=partitions)
    return _locked(due, limit)


def lock_listed(*, ids: list[int], now: datetime, limit: int) -> "QuerySet[Run]":
    """lock_due for runs read beforehand (scanners.shares.read_due_skipping): those of
    `ids` still due, scheduled and not held, locked; one another transaction holds is not."""
    assert connection.in_atomic_block, "the due read runs inside the scan's transaction"
    due = waiting_due(now)
    if connection.vendor == "postgresql":  # one array, as lock_due's
        due = due.filter(RawSQL('"runs"."id" = ANY(%s::bigint[])', (list(ids),), output_field=BooleanField()))
    else:
        due = due.filter(pk__in=ids)
    return _locked(due, limit)


def _locked(due: "QuerySet[Run]", limit: int) -> "QuerySet[Run]":
    # `locked_at`: this statement's store clock; a live scan stamps its batch no earlier.
    return due.order_by("due_at", "id").select_for_update(skip_locked=True, of=("self",)).annotate(
        locked_at=StoreClock())[:limit]


def count_queued(*, partitions: list[int], up_to: datetime | None = None) -> int:
    """Runs queued and not yet claimed in these partitions (read among the runs due by
    in_flight_due_bound in runs_due_idx_open: at most SCHEDULER_MAX_QUEUED queued,
    those running and the waiting runs due by then)."""
    return Run.objects.filter(in_flight(up_to), with_status(S.QUEUED), partition__in=partitions).count()


def mark_queued(*, run_ids: list[int], now: datetime, on_row: bool = False) -> int:
    """Scheduled to queued; `on_row`: the `queued` entry is on the row (runs.timeline),
    its event not written as a row."""
    if not run_ids:
        return 0
    if not on_row:
        return Run.objects.filter(pk__in=run_ids, status=S.SCHEDULED, kept_for=OPEN_KEPT_FOR).update(
            status=S.QUEUED, queued_at=now)
    return Run.objects.filter(pk__in=run_ids, status=S.SCHEDULED, kept_for=OPEN_KEPT_FOR).update(
        status=S.QUEUED, queued_at=now, on_row=F("on_row").bitor(ON_ROW_QUEUED), on_row_queued_at=now
    )
