"""The run lifecycle: create, claim, call, record the outcome and the next run.

Retries are rows (a run back to `scheduled` with a later `due_at`), never
broker-side retries: the database is the truth, queues are hints.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection, transaction
from django.db.models import OuterRef, Subquery

from jobs import schedule
from jobs.models import Job
from jobs.public_ids import format_id
from jobs.validators import check_resolved_target, target_key
from runs import breakers, bulk, bulkhead, claims, delivery, events, flights, notices, publishing, rollups
from runs.claims import Claim
from runs.delivery import CallResult, _PerProcess
from runs.models import (
    JOBS_OPEN_RUN, ON_ROW_ANSWERED, ON_ROW_SCHEDULED, ON_ROW_SUCCEEDED, OPEN_KEPT_FOR, Run,
    ended_newest_first,
)
from runs.signals import job_paused, run_dead

logger = logging.getLogger("scheduler.runs")
S = Run.Status


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


def lease_length() -> timedelta:
    return timedelta(seconds=settings.SCHEDULER_LEASE_SECONDS)


def is_held(job: Job) -> bool:
    """A held run is not scanned: its job is paused (or its target host is; see runs.holds)."""
    from runs.holds import target_is_paused

    return job.paused or target_is_paused(job)


def run_create(
    *, job: Job, scheduled_for: datetime, now: datetime, is_backfill: bool = False, reason: str = ""
) -> Run:
    window = timedelta(seconds=job.window_seconds)
    due_at = schedule.spread_due_at(job.pk, scheduled_for, window)
    run = Run.objects.create(
        job=job,
        scheduled_for=scheduled_for,
        due_at=due_at,
        partition=job.partition,
        held=is_held(job),
        is_backfill=is_backfill,
        # Its `scheduled` entry is on the row (runs.timeline), unless it has a reason.
        created_at=now,
        on_row=0 if reason else ON_ROW_SCHEDULED,
        on_row_due_at=None if reason else due_at,
    )
    detail = {"reason": reason} if reason else {}
    events.record_many([_scheduled_event(run, now, detail)])
    return run


def run_next_create(*, job: Job, now: datetime) -> Run | None:
    """The job's next run (kept for callers of the old name): see job_next_run."""
    return job_next_run(job=job, now=now)


# --------------------------------------------------------------------------- the next run
#
# "What is this job's next run?" is answered here and nowhere else: the worker's
# outcome, an edit, a resume, a job's creation (and the scanner's misfire path) all
# call job_next_run / job_next_runs, from the job as it is inside the writing
# transaction, its row locked.

# The rows that say how far a job's timetable has got: its time was lived through,
# whether the run happened (succeeded, dead) or was missed (a misfire's `skipped`
# row). A cancelled row never does: an edit or a delete cancelled it before its time,
# so the time was not lived through. Extra runs (backfills, run-now, dead runs
# requeued) never do either: the job's own timetable goes on without them.
COUNTED = (S.SUCCEEDED, S.DEAD, S.SKIPPED)
# A job whose next times are all taken (by extra runs) gets no next run past this many tries.
MAX_TAKEN_TIMES = 100


# What a call sends (its content), and nothing an outcome decides from: the outcome
# write's lock leaves it unread (jobs_lock(content=False)); a field of it read there
# anyway is fetched when read, so leaving it out can cost time, never a wrong answer.
CALL_CONTENT = ("headers", "secret_headers", "secret_header_names", "payload", "args", "kwargs")


def jobs_lock(job_ids: Iterable[int], *, nowait: bool = False, content: bool = True) -> dict[int, Job]:
    """The jobs as they are now, their rows locked until the transaction ends.

    FOR NO KEY UPDATE: it waits for (and makes wait) an edit, a pause, a resume or a
    delete of the same job, but not the foreign-key checks of runs being inserted
    for it. In id order, so two transactions locking some of the same jobs cannot
    deadlock. A job missing from the answer no longer exists.

    `nowait`: raise (django.db.OperationalError) at once if another transaction
    holds one of them, for a caller that already holds run rows (the scanner):
    waiting there could deadlock with an edit, which locks the job, then its runs.
    `content=False`: the jobs without CALL_CONTENT (the outcome write: not reading and
    decoding those columns for every job of every batch).
    """
    assert connection.in_atomic_block, "a job's lock lasts its transaction"
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    locked = Job.objects.select_for_update(no_key=True, nowait=nowait).filter(pk__in=ids).order_by("pk")
    if not content:
        locked = locked.defer(*CALL_CONTENT)
    return {job.pk: job for job in locked}


# A `skipped` row of a time on an excluded date says so in its last_error (and its
# event's detail says reason `excluded`).
EXCLUDED_PREFIX = "excluded:"


def job_next_run_time(job: Job, *, latest: datetime | None, since: datetime | None, now: datetime) -> datetime | None:
    """When the job's next normal run is due by its timing alone (the one rule):
    job_next_run_plan's time. None: a recurring job past its ends_at (no time left)."""
    return job_next_run_plan(job, latest=latest, since=since, now=now).time


def job_next_run_plan(job: Job, *, latest: datetime | None, since: datetime | None, now: datetime) -> schedule.NextTime:
    """When the job's next normal run is due by its timing alone (the one rule), and
    the excluded times passed over on the way (each gets a `skipped` row).

    A one-off: its `run_at`. A recurring job: the first time of its timetable
    (jobs.schedule.Timetable: a cron expression, a list of them, or an `every`;
    none before starts_at or after ends_at; none on an excluded date) strictly after
    the *after instant*, which is the latest of

    - `latest`: the latest `scheduled_for` of the job's counted runs (COUNTED: not
      cancelled, not extra), the run that has just ended included, and
    - `since`, or the job's `timing_changed_at`: the instant its timing was last
      changed (an edit's new schedule starts from the edit, never earlier, also
      when the run in flight during the edit ends after it),

    and `now` when there is neither (a new job). So after an edit
    `0 0 1 1 *` -> `*/5 * * * *` the next run follows the new schedule from the
    edit, or from the end of the run that was in flight during the edit; never from
    the cancelled 1 January run. A time in the past is still the next time: it is
    due at once, and the scanner's misfire policy decides if it is late.
    Past ends_at the time is None (the job is then `completed`).

    Excluded times: the first SCHEDULER_EXCLUDE_MAX_SKIPPED of them are returned
    for rows; the rest are counted only (schedule.next_time).
    """
    if not job.is_recurring:
        assert job.run_at is not None
        return schedule.NextTime(time=job.run_at)
    marks = [t for t in (latest, since, job.timing_changed_at) if t is not None]
    after = max(marks) if marks else now
    return schedule.next_time(job.timetable(), after, keep=settings.SCHEDULER_EXCLUDE_MAX_SKIPPED)


def job_next_run(
    *, job: Job, now: datetime, since: datetime | None = None, reason: str = "", nowait: bool = False
) -> Run | None:
    """Lock the job, then decide and create its next normal run (see job_next_runs).

    Returns the job's open normal run if it already has one, the new (or reopened)
    run, or None: deleted, or a one-off whose time has had its run (the job is
    then `completed`). Its own transaction, or the caller's; `nowait` as in jobs_lock.
    """
    with transaction.atomic():
        locked = jobs_lock([job.pk], nowait=nowait).get(job.pk)
        if locked is None:
            return None
        existing = Run.objects.filter(JOBS_OPEN_RUN, job=locked).first()
        if existing is not None:
            return existing
        created, found = job_next_runs(jobs=[locked], now=now, since=since, reason=reason)
        events.record_many(found)
        return created.get(locked.pk)


def job_next_runs(
    *,
    jobs: list[Job],
    now: datetime,
    since: datetime | None = None,
    reason: str = "",
    in_flight: dict[int, Flight] | None = None,
    claimed: dict[int, datetime] | None = None,
) -> tuple[dict[int, Run], list[events.Event]]:
    """The next normal run of each job, for jobs that have none open (a run of
    theirs has just ended, or the waiting one was cancelled by an edit).

    `jobs` must be locked by this transaction (jobs_lock) and read under that lock:
    the answer follows the job as it is now, not as a worker read it before a call
    (paused: the run is created held; deleted: no run; one-off <-> cron: the new
    timing). The times come from job_next_run_time. Inserted together (COPY); a
    time that already has a row costs that job only: a cancelled row there is
    opened again, any other row (an extra run, or a run that happened) covers that
    time, so a recurring job moves on to its next cron time, and a one-off is
    `completed`. Returns the new run by job id, and their `scheduled` events (for
    the caller to write with its own).

    `in_flight` (the outcome write only): for a job whose run has just ended, that
    run and when it was first claimed (its `started_at`). The times that passed
    from then to `now` passed while the run was in flight: they are the job's
    overlap policy's (_overlap_plan), not the misfire policy's.

    `claimed` (the claim of an overlap-`allow` job's run only, _detach_claimed): the
    `scheduled_for` of the job's run claimed just now, counted as the job's latest
    time (it has not ended, so it is not COUNTED yet): the next run is the job's next
    time after it.
    """
    live = [job for job in jobs if job.state != Job.State.DELETED]
    done = _one_offs_done([job for job in live if not job.is_recurring])
    _complete(done, now)
    live = [job for job in live if job.pk not in done]
    if not live:
        return {}, []
    latest = _latest_counted([job.pk for job in live if job.is_recurring])
    for pk, t in (claimed or {}).items():  # overlap allow: the run claimed just now counts
        latest[pk] = max(t, latest.get(pk, t))
    plans = {job.pk: job_next_run_plan(job, latest=latest.get(job.pk), since=since, now=now) for job in live}
    ended = {pk for pk, plan in plans.items() if plan.time is None}  # past ends_at
    _complete(ended, now)
    live = [job for job in live if job.pk not in ended]
    excluded = excluded_times_skip([(job, plans[job.pk]) for job in live], now)
    if not live:
        return {}, excluded
    held = _held_jobs(live)
    rows, skipped, ended_in_flight = [], [], set()
    for job in live:
        when = plans[job.pk].time
        assert when is not None  # jobs past ends_at were completed above
        flight = (in_flight or {}).get(job.pk)
        made_by = flight.run_id if flight is not None else None
        if flight is None or not job.is_recurring or when > now or when < flight.started_at:
            rows.append(_open_row(job, when, job.pk in held, now=None if reason else now, made_by=made_by))
            continue
        plan = _overlap_plan(job, first=when, since=since, now=now)
        skipped += _skip_overlapped(job, plan, flight, now)
        skipped += excluded_times_skip([(job, found) for found in plan.excluded], now)
        if plan.next_time is None:  # the times that passed in flight were its last (ends_at)
            ended_in_flight.add(job.pk)
            continue
        rows.append(_open_row(job, plan.next_time, job.pk in held, due_now=now if plan.buffered else None,
                              now=None if reason else now, made_by=made_by))
    _complete(ended_in_flight, now)
    inserted, refused = bulk.insert_open_runs(rows)
    created = {r.job_id: r for r in inserted}
    jobs_by_id = {job.pk: job for job in live}
    for row in refused:
        run = _place_after_clash(jobs_by_id[row.job_id], row, now)
        if run is not None:
            created[run.job_id] = run
    detail = {"reason": reason} if reason else {}
    found = excluded + [
        _scheduled_event(r, now, detail)
        for r in created.values()
    ]
    return created, skipped + found


def _scheduled_event(run: Run, now: datetime, detail: dict[str, str]) -> events.Event:
    """A new run's `scheduled` event: on its row when the insert put it there."""
    found = events.of(run, "scheduled", now, scheduled_for=delivery.iso_z(run.scheduled_for),
                         due_at=delivery.iso_z(run.due_at), **detail)
    return events.on_row(found) if run.on_row & ON_ROW_SCHEDULED else found


def excluded_times_skip(plans: list[tuple[Job, schedule.NextTime]], now: datetime) -> list[events.Event]:
    """A `skipped` row (reason `excluded`) for each excluded time the plans passed
    over, but a time that already has a row; their `skipped` events, for the caller.
    At most SCHEDULER_EXCLUDE_MAX_SKIPPED a job at once: the last row's event counts
    the others (`excluded_without_row`)."""
    rows: list[Run] = []
    reopened: list[Run] = []
    untold: dict[tuple[int, datetime], int] = {}
    for job, plan in plans:
        if not plan.excluded:
            continue
        taken = {r.scheduled_for: r for r in Run.objects.filter(job=job, scheduled_for__in=plan.excluded)}
        zone = schedule.get_zone(job.timezone)
        for t in plan.excluded:
            why = f"{EXCLUDED_PREFIX} {t.astimezone(zone).date().isoformat()} is one of the job's excluded dates"
            # Written ahead of its time, it ends at its time: retention counts from there,
            # never from the write (a yearly job's row would go before its date came).
            ends = max(now, t)
            if t not in taken:
                rows.append(Run(job=job, scheduled_for=t, due_at=t, partition=job.partition, status=S.SKIPPED,
                                finished_at=ends, last_error=why))
            elif taken[t].status == S.CANCELLED and not taken[t].is_backfill:
                # An edit's cancelled row at this time: it is this time's row again.
                Run.objects.filter(pk=taken[t].pk).update(status=S.SKIPPED, finished_at=ends, last_error=why)
                reopened.append(taken[t])
        if plan.excluded_count > len(plan.excluded):
            untold[(job.pk, plan.excluded[-1])] = plan.excluded_count - len(plan.excluded)
    created = Run.objects.bulk_create(rows) if rows else []
    if created and created[0].pk is None:  # backends without RETURNING on bulk insert
        keys = {(r.job_id, r.scheduled_for) for r in rows}
        found_rows = Run.objects.filter(job_id__in={k[0] for k in keys}, status=S.SKIPPED)
        created = [r for r in found_rows if (r.job_id, r.scheduled_for) in keys]
    by_id = {job.pk: job for job, _ in plans}
    # Told like any skipped run when the job's notify_on asks (runs.notices, digested).
    notices.notices_add(
        notices.notice_row(job=by_id[r.job_id], kind="skipped", run=r, reason="excluded date", now=now)
        for r in [*created, *reopened]
    )
    found = []
    for r in [*created, *reopened]:
        more = untold.get((r.job_id, r.scheduled_for))
        extra = {"excluded_without_row": more} if more else {}
        found.append(events.of(r, "skipped", now, reason="excluded", **extra))
    return found


def _open_row(job: Job, when: datetime, held: bool, due_now: datetime | None = None, *,
              now: datetime | None = None, made_by: int | None = None) -> Run:
    """A next run to insert; with `now`, its `scheduled` entry (at `now`) is on its row;
    `made_by`: the run whose outcome makes it (whose `succeeded` entry names it)."""
    due_at = schedule.spread_due_at(job.pk, when, timedelta(seconds=job.window_seconds))
    if due_now is not None:
        due_at = max(due_at, due_now)
    # With `now`, created_at is given, so its default (a clock read) is not taken and then overwritten.
    on_row = {} if now is None else {"created_at": now, "on_row": ON_ROW_SCHEDULED, "on_row_due_at": due_at}
    return Run(job=job, scheduled_for=when, due_at=due_at, partition=job.partition, held=held,
               on_row_made_by=made_by, **on_row)


# ------------------------------------------------------------------ overlap
#
# A time that passes while the job's run is in flight, from the run's first claim
# (`started_at`) to its outcome, is the overlap policy's: `skip` gives it a `skipped`
# row (reason `overlap`) and the next run is the next future time; `buffer_one` runs
# the latest of them as soon as the run ends (due now: the misfire rule, counted from
# due_at, does not call it late) and skips the others. A time that had passed before
# the claim was missed while nothing could start the job's run: the next run is that
# time, as before, and the scanner's misfire policy decides (the job is behind; the
# overlap policy applies again once it has caught up). See docs/architecture.md.

# The most times one outcome looks at (a run a second in flight for 5.5 hours). Past
# it, the times not looked at are the misfire policy's: the next run is the first of
# them, already passed, and the scanner applies the job's misfire rule to it (rows for
# the latest missed times, the others counted on its `misfired` event), as for times
# missed before the claim. Of the times looked at, the latest
# SCHEDULER_MISFIRE_MAX_SKIPPED get rows and all are counted (`passed_in_flight`).
MAX_OVERLAP_TIMES = 20_000


@dataclass(frozen=True)
class Flight:
    """A job's run whose outcome is being written: in flight since its first claim."""

    run_id: int
    started_at: datetime


@dataclass(frozen=True)
class OverlapPlan:
    next_time: datetime | None  # the job's next run (None: no time left, past ends_at)
    buffered: bool  # buffer_one: next_time has passed, and is due now
    skipped: list[datetime]  # the latest passed times that get a `skipped` row, oldest first
    count: int  # how many passed times are skipped in all (`skipped` may hold fewer)
    capped: bool = False  # MAX_OVERLAP_TIMES looked at: next_time has passed, the misfire policy's
    # The steps from one time to the next that passed over excluded times (each of
    # those gets its `skipped` row, reason `excluded`: excluded_times_skip).
    excluded: list[schedule.NextTime] = field(default_factory=list)


def _overlap_plan(job: Job, *, first: datetime, since: datetime | None, now: datetime) -> OverlapPlan:
    """The times from `first` (the next time, passed while the run was in flight) up
    to `now`, under the job's overlap policy. Each next time is job_next_run_time's."""
    keep = max(settings.SCHEDULER_MISFIRE_MAX_SKIPPED, 0)
    passed: deque[datetime] = deque(maxlen=keep + 1)
    count, when = 0, first
    excluded: list[schedule.NextTime] = []

    def step(after: datetime) -> datetime | None:
        found = job_next_run_plan(job, latest=after, since=since, now=now)
        if found.excluded:
            excluded.append(found)
        return found.time

    while when is not None and when <= now and count < MAX_OVERLAP_TIMES:
        passed.append(when)
        count += 1
        when = step(when)
    # Looked at enough with times still passed: on 1418bea the job went on from now, and
    # the times from here to now had neither a row nor a count (the stateful test found
    # it: a run in flight for a month of an every-two-minutes job).
    capped = when is not None and when <= now
    if job.overlap == Job.Overlap.BUFFER_ONE and not capped:
        latest = passed.pop()
        return OverlapPlan(next_time=latest, buffered=True, skipped=list(passed)[-keep:] if keep else [],
                           count=count - 1, excluded=excluded)
    return OverlapPlan(next_time=when, buffered=False, skipped=list(passed)[-keep:] if keep else [], count=count,
                       excluded=excluded, capped=capped)


def _skip_overlapped(job: Job, plan: OverlapPlan, flight: Flight, now: datetime) -> list[events.Event]:
    """A `skipped` row for each time the plan skips (a time that already has a row,
    an extra run or a cancelled one, keeps it); returns their `skipped` events."""
    if not plan.skipped:
        return []
    taken = set(Run.objects.filter(job=job, scheduled_for__in=plan.skipped).values_list("scheduled_for", flat=True))
    why = f"passed while the job's run was in flight (overlap policy {job.overlap})"
    rows = [
        Run(job=job, scheduled_for=t, due_at=t, partition=job.partition, status=S.SKIPPED, finished_at=now,
            last_error=why)
        for t in plan.skipped
        if t not in taken
    ]
    created = Run.objects.bulk_create(rows)
    if created and created[0].pk is None:  # backends without RETURNING on bulk insert
        created = list(Run.objects.filter(job=job, scheduled_for__in=[r.scheduled_for for r in rows]))
    # Told like any skipped run when the job's notify_on asks (runs.notices, digested).
    notices.notices_add(notices.notice_row(job=job, kind="skipped", run=r, reason=why, now=now) for r in created)
    return [
        events.of(r, "skipped", now, reason="overlap", policy=job.overlap, in_flight=format_id("run", flight.run_id),
                     passed_in_flight=plan.count, **({"rest_to_misfire_policy": True} if plan.capped else {}))
        for r in created
    ]


def _latest_counted(job_ids: list[int]) -> dict[int, datetime]:
    """Each job's latest counted time: one correlated read per job, walking its
    (job, kept_for, scheduled_for) index back from the newest row
    (runs_one_run_per_time), so it costs the same for a job with ten runs as for one
    with a million. Not a GROUP BY over the jobs' runs: with the status filter
    PostgreSQL can pick the status index and read every finished run of the table.

    A counted run has ended: read in the history's key order (ended_newest_first)."""
    if not job_ids:
        return {}
    latest = ended_newest_first(COUNTED, job_id=OuterRef("pk"), is_backfill=False).values("scheduled_for")[:1]
    found = Job.objects.filter(pk__in=job_ids).annotate(t=Subquery(latest)).values_list("pk", "t")
    return {pk: t for pk, t in found if t is not None}


def _one_offs_done(one_offs: list[Job]) -> set[int]:
    """One-offs whose time has a row that is not cancelled: it has had its run.

    One read by the jobs and by the times, the pairs matched here: not an OR of a
    (job, time) pair a job, which PostgreSQL plans arm by arm over every partition of
    runs: 24 ms of planning for a batch of 200 one-offs, a tenth of a millisecond a run
    at 100,000 one-offs due at once (docs/performance.md, "The 09:00 spike")."""
    if not one_offs:
        return set()
    wanted = {(job.pk, job.run_at) for job in one_offs}
    rows = (
        Run.objects.filter(job_id__in=sorted({pk for pk, _ in wanted}),
                           scheduled_for__in=sorted({at for _, at in wanted if at is not None}))
        .exclude(status=S.CANCELLED)
        .values_list("job_id", "scheduled_for")
    )
    return {job_id for job_id, at in rows if (job_id, at) in wanted}


def _complete(job_ids: set[int], now: datetime) -> None:
    if job_ids:
        Job.objects.filter(pk__in=list(job_ids)).exclude(state=Job.State.DELETED).update(
            state=Job.State.COMPLETED, updated_at=now
        )


def _held_jobs(jobs: list[Job]) -> set[int]:
    """The jobs whose new runs are created held (is_held, for many jobs in one read)."""
    hosts = paused_target_hosts({target_key(job) for job in jobs if not job.paused})
    return {job.pk for job in jobs if job.paused or target_key(job) in hosts}


def _place_after_clash(job: Job, row: Run, now: datetime) -> Run | None:
    """A next run whose insert was refused: the job already has an open run (it is
    the next one), or its time has a row (see job_next_runs). Bounded."""
    when: datetime | None = row.scheduled_for
    for _ in range(MAX_TAKEN_TIMES):
        if when is None:  # no time left: past ends_at
            _complete({job.pk}, now)
            return None
        existing = Run.objects.filter(JOBS_OPEN_RUN, job=job).first()
        if existing is not None:
            return None  # made meanwhile, by a path that holds no lock on the job: it stands
        earlier = Run.objects.select_for_update().filter(job=job, scheduled_for=when).first()
        if earlier is not None and earlier.status == S.CANCELLED:
            # A buffered overlap run keeps its due_at (due now) at its own time.
            keep_due = row.due_at if when == row.scheduled_for else None
            return run_reopen(run=earlier, job=job, now=now, held=row.held, not_before=keep_due,
                              made_by=row.on_row_made_by)
        if earlier is not None and not job.is_recurring:
            _complete({job.pk}, now)
            return None
        if earlier is not None:  # taken: an extra run (or a run that happened) covers it
            plan = job_next_run_plan(job, latest=when, since=None, now=now)
            events.record_many(excluded_times_skip([(job, plan)], now))
            when = plan.time
            continue
        inserted, _ = bulk.insert_open_runs([_open_row(job, when, row.held, now=now if row.on_row else None,
                                                       made_by=row.on_row_made_by)])
        if inserted:
            return inserted[0]
    logger.error("%s: no free time for its next run after %d tries", job.public_id, MAX_TAKEN_TIMES)
    return None


def run_reopen(
    *, run: Run, job: Job, now: datetime, held: bool, not_before: datetime | None = None, made_by: int | None = None
) -> Run:
    """A cancelled run becomes the job's waiting run again (its time is unique per
    job, so schedule A -> B -> A finds A's cancelled row there). Its `scheduled`
    event is the caller's to write. `not_before`: its due_at is no earlier.
    `made_by`: the run whose outcome reopens it (its `succeeded` entry names it)."""
    due_at = schedule.spread_due_at(job.pk, run.scheduled_for, timedelta(seconds=job.window_seconds))
    if not_before is not None:
        due_at = max(due_at, not_before)
    if run.on_row_made_by is not None:
        # The run that made it first still names it from its row: that entry becomes a row.
        events.write_settled([run.on_row_made_by])
    Run.objects.filter(pk=run.pk).update(
        status=S.SCHEDULED, due_at=due_at, held=held, finished_at=None, queued_at=None, is_backfill=False,
        last_error="", on_row_made_by=made_by,
    )
    run.refresh_from_db()
    return run


@dataclass
class Gate:
    """What a run was let through with: a bulkhead slot, and perhaps the breaker's probe."""

    host: str
    holder: str
    slot: bulkhead.Slot
    probe: bool
    called: bool = False


def _release(gates: list[Gate]) -> None:
    try:
        bulkhead.release_many([g.slot for g in gates])
        for gate in gates:
            if gate.probe and not gate.called:
                breakers.release_probe(host=gate.host, holder=gate.holder)
    except Exception:  # the slots and the probes run out by themselves
        logger.warning("could not release %d bulkhead slots", len(gates), exc_info=True)


def run_execute(*, run_id: int, worker: str | None = None) -> str:
    """One run: admit, claim, call, record. Returns the outcome."""
    return run_execute_many(run_ids=[run_id], worker=worker)[run_id]


# Outcomes that have ended are written before a wait for the batch's next wave this
# long or longer; a shorter wait keeps them for the batch's next write (its waves
# are milliseconds apart under a steady stream: a write a wave would cost a
# transaction each).
LAND_BEFORE_WAIT = 0.1
# Runs of a batch queued ahead of their due time (SCHEDULER_LOOKAHEAD) are claimed
# in waves: the first waiting run and those due within CLAIM_WAVE seconds after it,
# once the last of them is due. One claim statement a wave, for at most CLAIM_WAVE
# more start lag for its first run (docs/performance.md).
CLAIM_WAVE = 0.01
# A claim refused because its run was not due yet by the store's clock (this
# process's estimate of that clock was off) is tried again at the due time, this
# many times at most; then the run goes back to `scheduled`, for the scanner.
NOT_DUE_TRIES = 3
# A worker process reads its hosts' breakers once for all its batches' waves (one
# statement, not one a wave or a message), and again for a wave when that read is
# older than this, or does not cover the wave's hosts, or found one of them not closed
# (a half-open breaker's probe is decided on a fresh read), or after this process
# counted a failure. So a breaker another worker opens is seen here this late at most.
BREAKER_READ_FOR = 0.2


@dataclass(frozen=True)
class _BreakerRead:
    seen: dict[str, tuple[str, int]]  # breakers.counting: open, half-open or counting failures
    hosts: frozenset[str]  # the hosts the read covered
    read_at: float  # time.monotonic()


_NO_READ = _BreakerRead(seen={}, hosts=frozenset(), read_at=float("-inf"))


class _BreakerView:
    """A read of some hosts' breakers (breakers.counting): those open, half-open or
    counting failures; a host not in it had nothing to reset when it was read. One a
    worker process (_PROCESS_BREAKERS), shared by its batches: each read is replaced
    whole, so batches on threads of one process see one read or the next, never half."""

    def __init__(self) -> None:
        self._read = _NO_READ

    def not_closed(self, hosts: list[str], all_hosts: Iterable[str] = ()) -> set[str]:
        """Of `hosts`, those not closed; read again first unless the last read covers
        them, is fresh, and found them all closed. `all_hosts`: the batch's, read together."""
        read = self._read
        fresh = time.monotonic() - read.read_at <= BREAKER_READ_FOR
        if not (fresh and read.hosts.issuperset(hosts) and not any(self._open(read, h) for h in hosts)):
            wanted = sorted(set(hosts) | set(all_hosts))
            read = _BreakerRead(seen=breakers.counting(wanted), hosts=frozenset(wanted), read_at=time.monotonic())
            self._read = read
        return {host for host in hosts if self._open(read, host)}

    @staticmethod
    def _open(read: _BreakerRead, host: str) -> bool:
        return host in read.seen and read.seen[host][0] != breakers.B.CLOSED

    def in_trouble(self, host: str) -> bool:
        """The last read found `host`'s breaker open, half-open or counting failures
        (a timeout, no answer, a 5xx since its last good answer)."""
        return host in self._read.seen

    def nothing_to_reset(self, host: str) -> bool:
        read = self._read
        return host in read.hosts and host not in read.seen

    def forget(self) -> None:
        """This process counted a failure: the next wave reads the breakers again."""
        self._read = _NO_READ


_PROCESS_BREAKERS = _BreakerView()


def longest_wait() -> float:
    """The longest a worker waits for a run queued ahead of its due time, in seconds:
    twice the look-ahead, and at least 2 s. A run due later than that (a scanner whose
    SCHEDULER_LOOKAHEAD is longer than this worker's, a clock far off) goes back to
    `scheduled` at its due time instead of holding the worker."""
    return max(2.0, 2 * settings.SCHEDULER_LOOKAHEAD)


def run_execute_many(*, run_ids: list[int], worker: str | None = None, sent_at: datetime | None = None,
                     hand_off: Callable[[Callable[[], None]], bool] | None = None,
                     detach: bool = False) -> dict[int, str]:
    """A batch of runs (one message from the scanner): admit, claim, call the
    targets side by side, record what happened. Returns each run's outcome.

    Runs queued ahead of their due time are waited for here, in due order, and each
    is claimed only once it is due, in waves (_Batch.run); the runs already due are
    one wave. Admission (the target's breaker, then a bulkhead slot) comes just
    before each wave's claim, so nothing is held while waiting, and a run that may
    not be called yet goes back to `scheduled` without its attempt or fence moving:
    waiting spends no try, and holds no worker. The claim is one statement a wave.
    Each call's outcome, with its job's next run, is written when that call ends,
    together with whatever else has ended in this process by then (runs.flights):
    never held for a slower call of the batch. Every write names its run's fence.
    `sent_at`: when the message was published (claims.claim_many). `hand_off`: when
    the batch's first run is not due yet, it is offered the rest of the batch
    (runs.waiters: a thread that waits instead of the worker child); when it takes it,
    this returns at once, those runs "waiting". `detach` (a Celery worker on
    PostgreSQL): once its calls have started, the batch returns, those runs "calling",
    and the process's writer records their outcomes as they end; a hanging target
    holds a thread of the call pool, never the worker child.
    """
    worker = worker or default_worker_id()
    outcomes: dict[int, str] = {}
    # Leases, slots, breakers and due times are all in the store's clock; the offset
    # turns this machine's clock into it for the waits.
    now, offset = claims.store_clock_offset()
    found = {r.pk: r for r in Run.objects.select_related("job").filter(pk__in=run_ids, kept_for=OPEN_KEPT_FOR)}
    candidates = []
    for run_id in dict.fromkeys(run_ids):
        run = found.get(run_id)
        if run is None or not claims.may_claim(run, now):
            outcomes[run_id] = "not_claimed"  # ended, held, or someone holds a live lease: drop it
        else:
            candidates.append(run)
    batch = _Batch(worker=worker, lease=lease_length(), outcomes=outcomes, offset=offset, sent_at=sent_at,
                   landed=flights.Landed(outcomes, inline=True), detach=detach)

    def work() -> None:
        try:
            batch.run(candidates, now)
        finally:
            batch.finish()

    if hand_off is not None and candidates and min(run.due_at for run in candidates) > now:
        answer = {**outcomes, **dict.fromkeys((run.pk for run in candidates), "waiting")}
        if hand_off(work):
            return answer
    work()
    if detach:
        with batch.landed.cond:
            return {**dict.fromkeys((run.pk for run in candidates), "calling"), **outcomes}
    return outcomes


# Calls in flight one service may have in a worker process that have been in flight
# longer than SHARE_SLOW_FOR (runs.flights): past it, its further runs wait
# (`service_share_wait`) while other services' are called. Quick calls never count: a
# service whose calls answer keeps a worker as busy as its runs need.
SHARE_SLOW_FOR = 2.0


def service_share() -> int:
    share = int(getattr(settings, "SCHEDULER_SERVICE_CALLS", 0) or 0)
    return share if share > 0 else max(1, settings.SCHEDULER_WORKER_CALLS // 2)


def _land(group: list[flights.Flight]) -> dict[int, str]:
    """A group of ended calls (runs.flights): the breakers told, then the outcomes and
    the next runs in one transaction (run_record_outcomes)."""
    calls = [f.item[0] for f in group]
    gates = {f.run_id: f.item[1] for f in group}
    told = [c for c in calls if c.request is not None or c.message is not None or c.result is not None]
    for call in told:
        gates[call.run.pk].called = True
    _tell_breakers(told, gates, _PROCESS_BREAKERS)
    return run_record_outcomes(calls)


def _release_flights(group: list[flights.Flight]) -> None:
    _release([f.item[1] for f in group])


_FLIGHTS = _PerProcess(lambda: flights.Flights(land=_land, release=_release_flights, lease=lease_length))


def process_flights() -> flights.Flights:
    """This worker process's calls in flight (runs.flights)."""
    return _FLIGHTS.get()


@dataclass
class _Batch:
    """One message's runs on their way through a worker: admitted, claimed and set
    calling wave by wave as they come due; each outcome recorded as its call ends
    (runs.flights)."""

    worker: str
    lease: timedelta
    outcomes: dict[int, str]
    offset: float  # seconds the store's clock is ahead of this process's
    sent_at: datetime | None = None  # when the message was published (claims.claim_many)
    landed: flights.Landed = field(default_factory=lambda: flights.Landed({}, inline=True))
    detach: bool = False  # hand the calls still in flight to the process's writer after DETACH_AFTER
    breakers: _BreakerView = field(default_factory=lambda: _PROCESS_BREAKERS)
    hosts: set[str] = field(default_factory=set)  # of every run of the batch: one breaker read for all
    # The waves' claims counted (runs.rollups), written once their last wave has started
    # (write_started): one statement a batch, not a savepoint and an upsert a wave.
    started: dict[tuple[object, ...], rollups.Tally] = field(default_factory=dict)

    def write_started(self) -> None:
        """The batch's claim counts, in one statement of their own (a worker that dies
        before it loses them: a figure, never a fact the scheduler acts on)."""
        found, self.started = self.started, {}
        rollups.add(found)

    def store_now(self) -> datetime:
        return datetime.fromtimestamp(time.time() + self.offset, tz=dt_timezone.utc)

    def run(self, runs: list[Run], now: datetime) -> None:
        """Wave by wave, in due order, each once it is due by the store's clock."""
        waiting = sorted(runs, key=lambda r: r.due_at)
        self.hosts = {target_key(run.job) for run in runs}
        tries: dict[int, int] = {}
        given_up: list[Run] = []
        for _ in range(len(runs) * (NOT_DUE_TRIES + 1)):  # a turn takes a wave; a run comes back a few times at most
            if not waiting:
                break
            wave, rest = _next_wave(waiting, now)
            if (wave[-1].due_at - now).total_seconds() > longest_wait():
                break  # these, and every run after them, are not waited for
            waiting = rest
            if (wave[-1].due_at - self.store_now()).total_seconds() >= LAND_BEFORE_WAIT:
                process_flights().land_ready(self.landed)  # what has ended lands before a longer wait
            self.sleep_until(wave[-1].due_at)
            early = self.start(wave, self.store_now())
            if early:
                # Refused as not due yet by the store's clock: this process's idea of it
                # was off. Read it again, and wait by that read for these runs.
                now, self.offset = claims.store_clock_offset()
                time.sleep(max(0.0, (early[-1].due_at - now).total_seconds()))
                for run in early:
                    tries[run.pk] = tries.get(run.pk, 0) + 1
                given_up += [run for run in early if tries[run.pk] > NOT_DUE_TRIES]
                waiting = sorted(waiting + [run for run in early if tries[run.pk] <= NOT_DUE_TRIES],
                                 key=lambda r: r.due_at)
            now = self.store_now()
        # Back to `scheduled`, for the scanner to queue again when due.
        self.outcomes.update(_defer_many([(run, run.due_at, {}) for run in given_up + waiting], now, "not_yet_due"))

    def sleep_until(self, when: datetime) -> None:
        gap = (when - self.store_now()).total_seconds()
        if gap > 0:
            time.sleep(gap)

    def start(self, wave: list[Run], now: datetime) -> list[Run]:
        """Admit, claim and set calling one wave; returns its runs the claim found not
        due yet. The calls go on while the batch waits for its next wave."""
        if self.detach:
            wave = self._within_share(wave, now)
        gates = _admit(wave, self.worker, self.lease, now, self.outcomes,
                       lambda hosts: self.breakers.not_closed(hosts, self.hosts))
        admitted = [run for run in wave if run.pk in gates]
        if not admitted:
            return []
        try:
            taken, claimed_at = _claim_wave(admitted, self.worker, self.lease, self.sent_at, self.started)
        except BaseException:
            _release(list(gates.values()))
            raise
        by_id = {c.run_id: c for c in taken}
        early, calls = [], []
        for run in admitted:
            claim = by_id.get(run.pk)
            if claim is None:
                if run.due_at > claimed_at:
                    early.append(run)
                else:
                    self.outcomes[run.pk] = "not_claimed"  # someone else holds it, or it is no longer queued
                continue
            run.fence, run.attempt = claim.fence, claim.attempt
            calls.append(Call(run=run, claim=claim))
        _release([gates.pop(run.pk) for run in admitted if run.pk not in by_id])
        flying = [flights.Flight(run_id=c.run.pk, owner=c.run.job.owner_id, claim=c.claim, slot=gates[c.run.pk].slot,
                                 item=(c, gates[c.run.pk]), landed=self.landed) for c in calls]
        pool = process_flights()
        pool.start(flying)  # from here each lands on its own, whatever happens to the batch
        try:
            _prepare(calls)
        except BaseException:
            pool.abandon(flying)  # the store's trouble: their leases run out, they are claimed again
            raise
        _start_calls(flying)
        return early

    def _within_share(self, wave: list[Run], now: datetime) -> list[Run]:
        """The wave less the runs of services that already have their share of this
        process's calls in flight for longer than SHARE_SLOW_FOR (service_share): those
        wait a moment, spending no try, while other services' runs are called."""
        share = service_share()
        pool = process_flights()
        room: dict[int | None, int] = {}
        let, held = [], []
        for run in wave:
            owner = run.job.owner_id
            if owner not in room:
                room[owner] = share - pool.of_owner(owner, longer_than=SHARE_SLOW_FOR)
            if room[owner] > 0:
                room[owner] -= 1
                let.append(run)
            else:
                held.append((run, bulkhead.wait_until(now), {"share": share}))
        if held:
            self.outcomes.update(_defer_many(held, now, "service_share_wait"))
        return let

    def finish(self) -> None:
        """The claim counts written; each outcome written as its call ends, until the
        last, or (detached) until flights.DETACH_AFTER has passed with calls still in
        flight: the process's writer lands those (runs.flights)."""
        self.write_started()
        process_flights().land_all(self.landed, detach_after=self._detach_after(),
                                   backlog=delivery.call_pool().backlog)

    def _detach_after(self) -> float | None:
        """Detached: how long this worker child waits for its calls before the process's
        writer takes them over. At once when every host of the batch is in trouble by its
        breaker (its last calls timed out or failed): a host that hangs would hold the
        child DETACH_AFTER for each of its messages, and one service's many such hosts
        held every child of a worker in turn, other services' messages waiting behind."""
        if not self.detach:
            return None
        if self.hosts and all(self.breakers.in_trouble(host) for host in self.hosts):
            return 0.0
        return flights.DETACH_AFTER


def _next_wave(waiting: list[Run], now: datetime) -> tuple[list[Run], list[Run]]:
    """The runs to claim together next (`waiting` in due order), and the rest: every
    run already due at `now` (a backlog goes in one statement, as it always has), or
    else the first one and those due within CLAIM_WAVE after it."""
    first = waiting[0].due_at
    cut = now if first <= now else first + timedelta(seconds=CLAIM_WAVE)
    count = next((i for i, run in enumerate(waiting) if run.due_at > cut), len(waiting))
    return waiting[:count], waiting[count:]


def _admit(runs: list[Run], worker: str, lease: timedelta, now: datetime, outcomes: dict[int, str],
           not_closed_of: Callable[[list[str]], set[str]] = breakers.not_closed) -> dict[int, Gate]:
    """The breaker, then the bulkhead, per target host. Returns the runs let through.
    `not_closed_of`: which of some hosts' breakers are open or half-open (the batch's view)."""
    by_host: dict[str, list[Run]] = {}
    for run in runs:
        by_host.setdefault(target_key(run.job), []).append(run)
    not_closed = not_closed_of(list(by_host))  # usually nothing
    gates: dict[int, Gate] = {}
    for host, group in by_host.items():
        probes: set[int] = set()
        if host in not_closed:
            group, probes = _through_breaker(host, group, worker, lease, now, outcomes)
        holders = [f"{run.pk}/{worker}" for run in group]
        slots = {slot.holder: slot for slot in bulkhead.take_many(host=host, holders=holders, now=now, lease=lease)}
        full: list[tuple[Run, datetime, dict[str, object]]] = []
        for run, holder in zip(group, holders):
            slot = slots.get(holder)
            if slot is not None:
                gates[run.pk] = Gate(host=host, holder=holder, slot=slot, probe=run.pk in probes)
                continue
            if run.pk in probes:
                breakers.release_probe(host=host, holder=holder)
            full.append((run, bulkhead.wait_until(now, host), {"host": host, "limit": bulkhead.limit()}))
        outcomes.update(_defer_many(full, now, "bulkhead_wait"))
    return gates


def _through_breaker(
    host: str, group: list[Run], worker: str, lease: timedelta, now: datetime, outcomes: dict[int, str]
) -> tuple[list[Run], set[int]]:
    """A host whose breaker is open or half-open: the runs it lets through (the probe)."""
    passed, probes = [], set()
    held: list[tuple[Run, datetime, dict[str, object]]] = []
    for run in group:
        holder = f"{run.pk}/{worker}"
        probe_lease = timedelta(seconds=run.job.timeout_seconds) + lease
        admission = breakers.admit(host=host, holder=holder, now=now, probe_lease=probe_lease)
        if admission.hold_until is None:
            passed.append(run)
            if admission.probe:
                probes.add(run.pk)
            continue
        probe_at = delivery.iso_z(admission.next_probe_at) if admission.next_probe_at else None
        held.append((run, admission.hold_until, {"host": host, "state": admission.state, "next_probe_at": probe_at}))
    outcomes.update(_defer_many(held, now, "held_by_breaker"))
    return passed, probes


def _defer_many(deferrals: list[tuple[Run, datetime, dict[str, object]]], now: datetime, reason: str) -> dict[int, str]:
    """Runs back to `scheduled`, each until its own `due_at`, with their events: one
    lock-and-read, one update, one insert for them all (claims.defer_many). Returns
    each run's outcome: `reason`, or "not_claimed" for a run someone else holds now.

    Each event is stamped `now` (the wave's clock), but no later than the store's
    clock of the statement that locked the run and no earlier than the run's
    `queued_at` as read under that lock. A scan may have published the run again
    meanwhile (`requeued`, which sets `queued_at`), and the deferral must not be
    stamped before it. Nor after its own commit: `now` is this process's estimate
    of the store's clock, which can run a few milliseconds ahead, and a scan that
    queues the run again once the deferral has let go of it stamps no earlier than
    its locking statement (scanners.scan.scan_once), so the deferral must come
    first (runs.invariants; a fresh-clone run of tests/reliability/test_restarts.py,
    2026-12-04: `bulkhead_wait` 8 ms after the `queued` that followed it).

    One run at a time (a savepoint, a locked read, an update and an event each), a
    host whose bulkhead was full or whose breaker was open cost its worker about as
    much per held run as a call: the soak under load (2026-12-01, 135 runs/s) had its
    workers spend 91% of their time deferring, one run after another."""
    if not deferrals:
        return {}
    with transaction.atomic():
        prior = claims.defer_many(due={run.pk: due_at for run, due_at, _ in deferrals})
        events.record_many(
            events.of(run, reason, _defer_stamp(now, *prior[run.pk]), due_at=delivery.iso_z(due_at), **detail)
            for run, due_at, detail in deferrals
            if run.pk in prior
        )
    return {run.pk: reason if run.pk in prior else "not_claimed" for run, _, _ in deferrals}


def _defer_stamp(now: datetime, queued_at: datetime | None, locked_at: datetime) -> datetime:
    """A deferral's time (_defer_many): the wave's clock, within what the run's lock
    allows: not after the statement that took it, not before the run's last copy."""
    stamp = min(now, locked_at)
    return stamp if queued_at is None else max(stamp, queued_at)


@dataclass
class Call:
    run: Run
    claim: Claim
    request: delivery.Request | None = None
    message: publishing.TaskMessage | None = None  # a task target's, instead of a request
    refusal: str = ""  # claimed, but must not be called: why
    result: CallResult | None = None


def run_claim_many(*, runs: list[Run], worker: str, lease: timedelta) -> list[Claim]:
    """The claim step of the run path, one transaction: the batch's runs claimed in one
    statement (claims.claim_many: a run someone else holds, or not due yet, is not
    returned), their `claimed` events, and, for an overlap-allow job's run, its job's
    next run (_detach_claimed). `runs` carry their job (select_related), read before
    the claim."""
    return _claim_wave(runs, worker, lease)[0]


def _claim_wave(runs: list[Run], worker: str, lease: timedelta, sent_at: datetime | None = None,
                counts: dict[tuple[object, ...], rollups.Tally] | None = None) -> tuple[list[Claim], datetime]:
    """run_claim_many, and the store's clock the claim checked due times against (read
    in the claim's own statement): a run due after that which was not taken may only
    have been early. `counts`: where the claims' rollups (runs.rollups) are added for
    the caller to write, instead of with the claim (_Batch: once for all its waves)."""
    # One statement, unless something else must be written with it: the claimed events
    # (`counts` not given) or an overlap-allow job's next run. It then needs no
    # transaction of its own (a BEGIN and a COMMIT a wave).
    allow_ids = [r.job_id for r in runs if _may_detach(r, r.job)]
    alone = counts is not None and not allow_ids
    with nullcontext() if alone else transaction.atomic():
        # Overlap allow: those jobs are locked before any run row (the order an edit takes).
        allow_jobs = jobs_lock(allow_ids) if allow_ids else {}
        taken, now = claims.claim_many_clocked(run_ids=[r.pk for r in runs], worker=worker, lease=lease,
                                               sent_at=sent_at)
        runs_by_id = {r.pk: r for r in runs}
        # The claim's clock is at least the due time of every run it took (it checks);
        # on SQLite it is read just before the claim, so the event says no earlier than
        # the due time either.
        # On the row (claims.CLAIM_SQL): counted here, not written.
        claimed = [
            events.on_row(events.event(c.run_id, "claimed", max(now, runs_by_id[c.run_id].due_at), fence=c.fence,
                                       worker=worker, attempt=c.attempt)) for c in taken
        ]
        # `runs` as read before the claim: a first start has no started_at yet.
        if counts is None:
            events.record_many(claimed, runs=runs_by_id)
        else:
            rollups.merge(counts, rollups.tally_quietly(claimed, runs_by_id))
        _detach_claimed([(runs_by_id[c.run_id], c) for c in taken], allow_jobs, now)
    return taken, now


# ------------------------------------------------------------------ overlap allow
#
# An allow-job's run, when it is claimed, stops being the job's waiting run: it is
# marked `detached` (runs_one_open_run_per_job leaves it out) and the job's next run is
# made at once, by the one next-run decision (job_next_runs, the claimed run's time
# counted as the latest), in the claim's transaction and under the job's lock. So the
# job always has exactly one waiting run, and any number of runs in flight beside it.
# A detached run's outcome (its retries, dead list, pause_after_failures) is any run's,
# but makes no next run: it was made at the claim. See docs/architecture.md.


def _may_detach(run: Run, job: Job | None) -> bool:
    """Whether this claimed run of `job` (as it is: locked) is detached at its claim."""
    return (
        job is not None
        and job.overlap == Job.Overlap.ALLOW
        and job.is_recurring  # a one-off has one run: nothing runs beside it
        and job.state != Job.State.DELETED
        and not run.is_backfill
        and not run.detached  # a retry, or a re-claim after a lost lease: still that run
    )


def _detach_claimed(claimed: list[tuple[Run, Claim]], jobs: dict[int, Job], now: datetime) -> None:
    """Overlap allow, at the claim: each claimed run whose job (`jobs`: locked by this
    transaction, read under the lock) is an allow-job is detached and its job's next
    run made. Together under a savepoint; if that fails, each run alone: one run's
    failure costs that run only. Such a run stays its job's waiting run (`detach_failed`
    on its timeline) and its outcome makes the next run, as under `skip`."""
    todo = [(run, claim) for run, claim in claimed if _may_detach(run, jobs.get(run.job_id))]
    if not todo:
        return
    try:
        with transaction.atomic():
            _detach(todo, jobs, now)
        return
    except _STORE_TROUBLE:
        raise
    except Exception as exc:  # noqa: BLE001 - a batch statement is a speed-up, not a unit of failure
        if len(todo) == 1:
            _detach_failed(*todo[0], exc, now)
            return
        logger.warning("detaching %d claimed runs together failed; one by one", len(todo), exc_info=True)
    for run, claim in todo:
        try:
            with transaction.atomic():
                _detach([(run, claim)], jobs, now)
        except _STORE_TROUBLE:
            raise
        except Exception as exc:  # noqa: BLE001 - this run's only
            _detach_failed(run, claim, exc, now)


def _detach_failed(run: Run, claim: Claim, exc: Exception, now: datetime) -> None:
    run.detached = False
    why = f"{type(exc).__name__}: {exc}"[:1000]
    logger.error("run %s: could not make its job's next run at the claim (%s); made at its outcome", run.public_id,
                 why, exc_info=exc)
    events.record(run.pk, "detach_failed", _after_claim(claim, now), fence=claim.fence, reason=why)


def _after_claim(claim: Claim, now: datetime) -> datetime:
    """The time of an event written beside a claim: no earlier than the claim's own
    (`claimed` is stamped by the store's clock in the claim's statement, which may run
    seconds after the wave read `now`: the job locks before it wait for a scan or an
    edit). The soak under load (2026-12-01, 135 runs/s) found `detached` events
    stamped 2.3 s before the `claimed` they follow."""
    return max(now, claim.claimed_at) if claim.claimed_at is not None else now


def _detach(todo: list[tuple[Run, Claim]], jobs: dict[int, Job], now: datetime) -> None:
    done = set(claims.detach_many(fences={run.pk: claim.fence for run, claim in todo}))
    detached = [run for run, _ in todo if run.pk in done]
    if not detached:
        return
    latest: dict[int, datetime] = {}
    for run in detached:
        latest[run.job_id] = max(run.scheduled_for, latest.get(run.job_id, run.scheduled_for))
    created, found = job_next_runs(jobs=list({r.job_id: jobs[r.job_id] for r in detached}.values()), now=now,
                                   claimed=latest)
    at = {run.pk: _after_claim(claim, now) for run, claim in todo}
    for run in detached:
        nxt = created.get(run.job_id)
        then = {"next_run": nxt.public_id, "next_scheduled_for": delivery.iso_z(nxt.scheduled_for)} if nxt else {}
        found.append(events.of(run, "detached", at[run.pk], policy=Job.Overlap.ALLOW.value, **then))
    events.record_many(found)
    for run in detached:
        run.detached = True


def _prepare(calls: list[Call]) -> None:
    """Checks after the claim (tries left, the target's address now), then the request.

    What goes wrong for one run costs that run only: a request that cannot be made
    (a header that cannot be sent, a secret that cannot be decrypted, any other
    exception) is a refusal with its reason; a name that does not resolve is a
    failed call (retried). A database error is the batch's, and goes up.
    """
    resolved: dict[str, _Resolved] = {}
    signers: dict[int, delivery.Signer | None] = {}
    grants: dict[tuple[int, str], str | None] = {}
    for call in calls:
        try:
            if call.run.job.is_task:
                _prepare_task(call, grants)
            else:
                _prepare_one(call, resolved, signers)
        except DatabaseError:
            raise
        except delivery.PreparationError as exc:
            call.refusal = str(exc)
        except Exception as exc:  # its text may hold a header's value: its type only
            logger.warning("run %s: could not prepare its call: %s", call.run.public_id, type(exc).__name__)
            call.refusal = f"could not prepare the call ({type(exc).__name__})"


@dataclass(frozen=True)
class _Resolved:
    addresses: tuple[str, ...] = ()  # the checked addresses to connect to
    refusal: str = ""  # the target may not be called: why
    failure: str = ""  # the lookup failed: a failed call


def _resolve(target: str) -> _Resolved:
    """The target's name resolved once and checked: the call connects to that address."""
    try:
        return _Resolved(addresses=tuple(check_resolved_target(target)))
    except ValueError as exc:
        return _Resolved(refusal=f"target refused: {exc}")
    except OSError:  # socket.gaierror: no such name, or no answer
        return _Resolved(failure=delivery.DNS_FAILURE)


def _out_of_tries(call: Call) -> bool:
    return call.claim.attempt - call.run.attempt_base > call.run.job.retry_max + 1


def _prepare_task(call: Call, grants: dict[tuple[int, str], str | None]) -> None:
    """A Celery task target: its message (runs.publishing), its grant checked again."""
    if _out_of_tries(call):
        call.refusal = "out of tries (leases lost)"
        return
    call.message = publishing.prepare(run=call.run, job=call.run.job, claim=call.claim, grants=grants)


def _prepare_one(call: Call, resolved: dict[str, _Resolved], signers: dict[int, delivery.Signer | None]) -> None:
    job = call.run.job
    if _out_of_tries(call):
        call.refusal = "out of tries (leases lost)"
        return
    if job.target not in resolved:
        resolved[job.target] = _resolve(job.target)
    where = resolved[job.target]
    if where.refusal:
        call.refusal = where.refusal
        return
    if where.failure:
        call.result = CallResult(error=where.failure)
        return
    if job.owner_id not in signers:
        signers[job.owner_id] = _signer_for(job)
    call.request = delivery.build_request(
        run=call.run, job=job, claim=call.claim, signer=signers[job.owner_id], addresses=where.addresses
    )


# How long recent calls to each host took (ms, a moving average, this process).
_recent_ms: dict[str, float] = {}
QUICK_MS = 20.0  # a host this quick is called in turn: hundreds of calls side by side cost more than they save
IN_TURN_FOR = 0.1  # seconds: the longest a batch calls in turn before the rest go side by side
IN_TURN_WAIT = 0.05  # seconds the batch waits for one call in turn; a slower one goes on without it


def _start_calls(flying: list[flights.Flight]) -> None:
    """The calls of a wave, each on the worker process's call pool and handed on
    (runs.flights) as soon as it has ended; a call refused, or failed before it was
    made, has ended already. To a host that has been answering within QUICK_MS the
    calls go one after another, the batch waiting for each at most IN_TURN_WAIT, for at
    most IN_TURN_FOR in all; the rest side by side. So the batch's thread never waits
    long on a target, however slow (one quick answer says nothing of the next
    endpoint), and no outcome waits for a call made after it."""
    pool = process_flights()
    rest = []
    for flight in flying:
        call = flight.item[0]
        if call.request is None and call.message is None:
            pool.ended(flight)
        else:
            rest.append(flight)
    stop = time.monotonic() + IN_TURN_FOR
    while rest and _recent_ms.get(rest[0].item[1].host, 1e9) <= QUICK_MS and time.monotonic() < stop:
        future = _submit(rest.pop(0))
        try:
            future.result(timeout=IN_TURN_WAIT)
        except FutureTimeout:
            break  # slow after all: it goes on, the rest side by side, and what ended lands
    for flight in rest:
        _submit(flight)


def _submit(flight: flights.Flight) -> Future[CallResult]:
    future = delivery.call_pool().submit(_calling, flight)
    future.add_done_callback(lambda done, flight=flight: _call_ended(flight, done))
    return future


def _calling(flight: flights.Flight) -> CallResult:
    flight.calling_since = time.monotonic()  # on a thread now: the service share counts from here
    return _call_one(flight.item[0])


def _call_ended(flight: flights.Flight, future: Future[CallResult]) -> None:
    """A call on the pool has ended (on the pool's thread): on to its outcome."""
    call = flight.item[0]
    try:
        call.result = future.result()
    except BaseException:  # noqa: BLE001 - _call_one returns failures; anything else is one too
        call.result = CallResult(error=delivery.REQUEST_FAILED)
    _note_duration(flight.item[1].host, call.result)
    process_flights().ended(flight)


def _note_duration(host: str, result: CallResult) -> None:
    before = _recent_ms.get(host)
    took = float(result.duration_ms) if result.status is not None or result.published else 1e6
    _recent_ms[host] = took if before is None else 0.8 * before + 0.2 * took


def _call_one(call: Call) -> CallResult:
    """The call, whatever raises inside it: an exception is a failed call (tried
    again), never one that takes the batch's other outcomes with it."""
    try:
        if call.message is not None:
            return publishing.publish(call.message, timeout_seconds=call.run.job.timeout_seconds)
        assert call.request is not None
        return delivery.call(call.request, timeout_seconds=call.run.job.timeout_seconds)
    except Exception as exc:
        logger.warning("run %s: its call raised %s", call.run.public_id, type(exc).__name__)
        return CallResult(error=delivery.REQUEST_FAILED)


def _tell_breakers(calls: list[Call], gates: dict[int, Gate], view: _BreakerView | None = None) -> None:
    """Each host's calls, in order, on its breaker: a write only when something changes,
    and no statement at all when every call was fine and the batch's read found nothing
    to reset for the host. (A failure another worker counted after that read is then
    not reset by these successes: the next failure opens the breaker one call sooner.)"""
    by_host: dict[str, list[Call]] = {}
    for call in calls:
        by_host.setdefault(gates[call.run.pk].host, []).append(call)
    clock: list[datetime] = []

    def now() -> datetime:  # read once, and only if something is written
        if not clock:
            clock.append(claims.store_now())
        return clock[0]

    for host, group in by_host.items():
        found = [(gates[c.run.pk].holder, host_trouble(c.result, c.run.job), c.result.describe())
                 for c in group if c.result]
        try:
            breakers.record_many(
                host=host, found=found, now=now, nothing_to_reset=view is not None and view.nothing_to_reset(host),
            )
        except Exception:  # the breaker is advice; the outcomes must still be recorded
            logger.warning("could not record the calls' results on %s's breaker", host, exc_info=True)
        if view is not None and any(failed for _, failed, _ in found):
            view.forget()


def host_trouble(result: CallResult, job: Job) -> bool:
    """Does this call's result count towards its host's breaker? Trouble (no answer,
    408, 429, a 5xx), except a timeout shorter than SCHEDULER_BREAKER_MIN_TIMEOUT: a
    job's own short timeout is its owner's choice, not the host's trouble, and it
    opened the breaker for every other service calling that host (a 1 s timeout
    against a host answering in 3 s, six runs, held the other services' runs 30 s,
    renewable at will). The call is still retried under the job's own policy."""
    if not result.retryable:
        return False
    timed_out = result.status is None and result.error.startswith(delivery.TIMED_OUT)
    return not (timed_out and job.timeout_seconds < settings.SCHEDULER_BREAKER_MIN_TIMEOUT)


def _signer_for(job: Job) -> delivery.Signer | None:
    from runs.signing import signer_for_owner

    return signer_for_owner(job.owner_id)


def _answered_event(run: Run, claim: Claim, result: CallResult, now: datetime) -> events.Event:
    if result.published is not None:  # a task target's message, accepted by the broker
        return events.of(run, "published", now, fence=claim.fence, duration_ms=result.duration_ms,
                            **result.published)
    answer = {"status": result.status} if result.status is not None else {"error": result.error}
    return events.of(run, "target_answered", now, fence=claim.fence, duration_ms=result.duration_ms, **answer)


def _decide(call: Call, now: datetime) -> tuple[claims.Outcome, str]:
    """The outcome a finished call asks for, and the dead reason if it is one.
    `call.run.job` is the job as it is now (locked: run_record_outcomes)."""
    run, job, claim, result = call.run, call.run.job, call.claim, call.result
    if call.refusal:
        return claims.Outcome(run.pk, claim.fence, S.DEAD, now, error=call.refusal), call.refusal
    assert result is not None
    if result.ok:
        if result.published is None and result.status is not None and result.duration_ms is not None:
            # The happy path: its answer and its success on the row (runs.timeline).
            return claims.Outcome(run.pk, claim.fence, S.SUCCEEDED, now, on_row=ON_ROW_ANSWERED | ON_ROW_SUCCEEDED,
                                  answer=result.status, duration_ms=result.duration_ms), ""
        return claims.Outcome(run.pk, claim.fence, S.SUCCEEDED, now), ""
    tries = claim.attempt - run.attempt_base  # calls in this round (a requeue starts a new one)
    if result.retryable and tries <= job.retry_max and job.state == Job.State.DELETED:
        # Deleted during the call: its waiting runs were cancelled, and so is this retry.
        return claims.Outcome(run.pk, claim.fence, S.CANCELLED, now, error=result.describe()), ""
    if result.retryable and tries <= job.retry_max:
        due_at = now + schedule.retry_delay(
            attempt=tries,
            backoff=job.retry_backoff,
            base=timedelta(seconds=job.retry_base_seconds),
            cap=timedelta(seconds=job.retry_cap_seconds),
            retry_after=(
                timedelta(seconds=result.retry_after_seconds) if result.retry_after_seconds is not None else None
            ),
        )
        return claims.Outcome(run.pk, claim.fence, S.SCHEDULED, now, error=result.describe(), due_at=due_at), ""
    if result.retryable:
        reason = f"out of tries after {tries} attempts: {result.describe()}"
    else:
        reason = f"target answered {result.describe()}"
    return claims.Outcome(run.pk, claim.fence, S.DEAD, now, error=reason), reason


# The store's own trouble (the connection went, a deadlock, a timeout) is not one
# row's: nothing of the batch can be written, and the leases bring its runs back.
_STORE_TROUBLE = (OperationalError, InterfaceError)


def run_record_outcomes(calls: list[Call]) -> dict[int, str]:
    """The batch's outcomes, together (_record_outcomes); if that write fails on
    something other than the store's own trouble, each run's alone, so one row the
    store refuses costs that run only. A run whose outcome cannot be written at all
    stays `running` (`outcome_not_recorded`): its lease runs out and it is claimed
    again, as after a worker's death."""
    if not calls:
        return {}
    try:
        return _record_outcomes(calls)
    except _STORE_TROUBLE:
        raise
    except Exception:  # noqa: BLE001 - a batch statement is a speed-up, not a unit of failure
        if len(calls) == 1:
            raise
        logger.warning("recording %d outcomes together failed; recording them one by one", len(calls), exc_info=True)
    outcomes: dict[int, str] = {}
    for call in calls:
        try:
            outcomes.update(_record_outcomes([call]))
        except _STORE_TROUBLE:
            raise
        except Exception:  # noqa: BLE001 - this run's write only
            logger.error("run %s: its outcome could not be written; its lease will run out", call.run.public_id,
                         exc_info=True)
            outcomes[call.run.pk] = "outcome_not_recorded"
    return outcomes


def _record_outcomes(calls: list[Call]) -> dict[int, str]:
    """One transaction for a batch: each outcome under its fence, the events, and
    the next run of every run that ended (or the retry, as a row). An ended run's
    `succeeded` or `dead` event names its job's next run (`next_run`).

    The batch's jobs are locked first (jobs_lock: before any run row, the order an
    edit, a pause or a delete takes them in) and read again: what the outcome leads
    to follows the job as it is now, whatever happened to it during the call.
    """
    with transaction.atomic():
        jobs = jobs_lock((call.run.job_id for call in calls), content=False)
        for call in calls:
            call.run.job = jobs.get(call.run.job_id) or call.run.job
        now = claims.store_now()  # a retry's due_at is read by the scanner in the store's clock
        decided = [(call, *_decide(call, now)) for call in calls]
        landed, on_row = claims.record_outcomes_on_row([outcome for _, outcome, _ in decided])
        found = _hold_retries(
            [c.run for c, o, _ in decided if c.run.pk in landed and o.status == S.SCHEDULED], now
        )
        ended = [c for c, o, _ in decided if c.run.pk in landed and o.status != S.SCHEDULED]
        # A detached run (overlap allow) made its job's next run when it was claimed.
        normal = [c for c in ended if not c.run.is_backfill and not c.run.detached]
        in_flight = {
            c.run.job_id: Flight(c.run.pk, c.claim.started_at) for c in normal if c.claim.started_at is not None
        }
        new_runs, scheduled = job_next_runs(jobs=[c.run.job for c in normal], now=now, in_flight=in_flight)
        found += scheduled
        dead = [c.run for c, o, _ in decided if c.run.pk in landed and o.status == S.DEAD]
        _pause_after_failures([r.job for r in dead if not r.is_backfill], now)
        outcomes: dict[int, str] = {}
        told: dict[int, str] = {}
        dead_notices: list[notices.Notice | None] = []
        for call, outcome, reason in decided:
            run, claim = call.run, call.claim
            # The happy path's answer and success went on the row with the outcome.
            mark = events.on_row if run.pk in on_row else (lambda e: e)
            if call.result is not None:
                found.append(mark(_answered_event(run, claim, call.result, now)))
            nxt = new_runs.get(run.job_id) if not run.is_backfill and not run.detached else None
            then = {"next_run": nxt.public_id, "next_scheduled_for": delivery.iso_z(nxt.scheduled_for)} if nxt else {}
            if run.pk not in landed:
                # The lease was taken over: the store refuses this holder's outcome.
                found.append(events.of(run, "stale_write_rejected", now, fence=claim.fence, worker=claim.worker))
                logger.warning("run %s: stale write from fence %s refused", run.public_id, claim.fence)
                outcomes[run.pk] = "stale_write_rejected"
            elif outcome.status == S.SUCCEEDED:
                found.append(mark(events.of(run, "succeeded", now, fence=claim.fence, **then)))
                outcomes[run.pk] = "succeeded"
            elif outcome.status == S.SCHEDULED:
                found.append(events.of(run, "retry_scheduled", now, due_at=delivery.iso_z(outcome.due_at),
                                          fence=claim.fence))
                outcomes[run.pk] = "retry_scheduled"
            elif outcome.status == S.CANCELLED:
                found.append(events.of(run, "cancelled", now, reason="job deleted", fence=claim.fence))
                outcomes[run.pk] = "cancelled"
            else:
                told = told or notices.recipients([c.run.job for c in calls])
                found.append(events.of(run, "dead", now, reason=reason, notified=told[run.job_id],
                                          fence=claim.fence, **then))
                outcomes[run.pk] = "dead"
                # The owner is told through the outbox, in this transaction; sent later (runs.notices).
                dead_notices.append(notices.notice_row(job=run.job, kind="dead", run=run, reason=reason, now=now))
                transaction.on_commit(lambda pk=run.pk, why=reason: notify_dead(run_id=pk, reason=why))
        events.record_many(found, runs={call.run.pk: call.run for call in calls})
        notices.notices_add(dead_notices)
    return outcomes


def _hold_retries(retried: list[Run], now: datetime) -> list[events.Event]:
    """A retry row of a job paused (or on a paused target host) during the call is
    held, like every other waiting run of it: the resume releases it."""
    held = _held_jobs(list({run.job_id: run.job for run in retried}.values())) if retried else set()
    ids = [run.pk for run in retried if run.job_id in held]
    if not ids:
        return []
    Run.objects.filter(pk__in=ids, status=S.SCHEDULED, kept_for=OPEN_KEPT_FOR).update(held=True)
    return [events.event(pk, "held", now, reason="job or target paused during the call") for pk in ids]


# The runs that say whether a job keeps failing: its normal runs that were called and
# ended (a skipped or cancelled row never ran; extra runs are not the job's timetable).
RAN = (S.SUCCEEDED, S.DEAD)


def _pause_after_failures(jobs: list[Job], now: datetime) -> None:
    """A job one of whose normal runs has just gone dead pauses itself when its
    `pause_after_failures` most recent runs that ran (RAN, newest scheduled_for first)
    all ended dead, and no later run of it has started without ending: as job_pause, with an audit entry `paused` (actor: the
    scheduler) and its owner told after commit (notify_paused). The jobs are locked
    by the outcome write and read under that lock."""
    from jobs.audit import audit_record
    from jobs.services import job_pause

    for job in {job.pk: job for job in jobs}.values():
        limit = job.pause_after_failures
        if limit <= 0 or job.paused or job.state != Job.State.ACTIVE or not job.is_recurring:
            continue
        latest = list(ended_newest_first(RAN, job_id=job.pk, is_backfill=False)
                      .values_list("status", "scheduled_for")[:limit])
        if len(latest) < limit or any(status != S.DEAD for status, _ in latest):
            continue
        # A later run of the job that has started and not ended (in flight under overlap
        # allow, or waiting for a retry) is one of its latest too: the row is not all
        # dead until it ends, dead. Each outcome lands at its own answer (runs.flights),
        # so without this the order in which a batch's calls end would decide.
        if Run.objects.filter(job_id=job.pk, is_backfill=False, kept_for=OPEN_KEPT_FOR, started_at__isnull=False,
                              scheduled_for__gt=latest[-1][1]).exists():
            continue
        reason = f"its last {limit} runs ended dead (pause_after_failures={limit})"
        job_pause(job=job, now=now)
        audit_record(actor=SCHEDULER_ACTOR, via="command", action="paused", obj=job, at=now,
                     detail={"reason": "pause_after_failures", "failures": limit})
        notices.notice_add(job=job, kind="paused", reason=reason, now=now)  # the outbox, in this transaction
        transaction.on_commit(lambda pk=job.pk, why=reason: notify_paused(job_id=pk, reason=why))


# Who the audit log names for what the scheduler does by itself (a job pausing itself
# after failures, a job resuming at its paused_until).
SCHEDULER_ACTOR = "scheduler"


def paused_target_hosts(hosts: set[str]) -> set[str]:
    from runs.models import PausedTarget

    return set(PausedTarget.objects.filter(host__in=list(hosts)).values_list("host", flat=True)) if hosts else set()


def notify_dead(*, run_id: int, reason: str) -> None:
    """After a run went dead (on commit): a log line and a signal for code. The owner
    is told by a notice (e-mail or webhook) that the dead write put in the outbox in
    its own transaction (runs.notices.notice_add); it is sent, digested, by
    runs.notices.notices_send, never by the worker that wrote it."""
    run = Run.objects.select_related("job__owner").get(pk=run_id)
    logger.warning("run %s of %s is dead: %s", run.public_id, run.job.public_id, reason)
    run_dead.send(sender=Run, run=run, reason=reason)


def notify_paused(*, job_id: int, reason: str) -> None:
    """After a job paused itself (on commit): a log line and a signal for code. The
    owner is told by the `paused` notice _pause_after_failures put in the outbox in
    the pausing transaction (runs.notices), as for dead runs."""
    job = Job.objects.select_related("owner").get(pk=job_id)
    logger.warning("%s paused itself: %s", job.public_id, reason)
    job_paused.send(sender=Job, job=job, reason=reason)
