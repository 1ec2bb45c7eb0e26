"""What happens next to a job: its next run (job_next_run / job_next_runs, from the job
as it is inside the writing transaction, its row locked), the times it passed while a
run was in flight (overlap), and a cancelled run made waiting again (run_reopen).
The worker's outcome, an edit, a resume, a job's creation and the scanner's misfire
path all come here.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection, transaction
from django.db.models import OuterRef, Subquery

from jobs import schedule
from jobs.models import Job
from jobs.public_ids import format_id
from jobs.validators import target_key
from runs import bulk, delivery, events, notices
from runs.models import (
    JOBS_OPEN_RUN, ON_ROW_SCHEDULED, Run,
    ended_newest_first,
)


logger = logging.getLogger("scheduler.runs")
S = Run.Status


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


def paused_target_hosts(hosts: set[str]) -> set[str]:
    from runs.models import PausedTarget

    return set(PausedTarget.objects.filter(host__in=list(hosts)).values_list("host", flat=True)) if hosts else set()
