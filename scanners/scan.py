"""One scan of a scanner's partitions: due runs onto the run queue, misfires by
policy, and recovery of runs whose message or lease was lost.

The database write happens first and the publish after commit: a scanner that
dies between the two leaves queued runs that the unclaimed-run recovery
publishes again. A run published twice is claimed once (the fence).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from time import monotonic

from django.conf import settings
from django.db import InterfaceError, OperationalError, transaction
from django.db.models.functions import Mod

from jobs import schedule
from jobs.models import Job
from runs import claims, events, notices
from jobs.validators import target_key
from runs.delivery import iso_z
from runs.models import OPEN_KEPT_FOR, Run
from runs.nextrun import EXCLUDED_PREFIX, job_next_run, jobs_lock, run_next_create
from runs.outcomes import notify_dead
from scanners.messages import publish_runs
from scanners.probe import Work
from scanners.shares import ServiceShares, ShareFloors, read_due_skipping

logger = logging.getLogger("scheduler.scanner")
S = Run.Status


@dataclass
class ScanResult:
    queued: list[int] = field(default_factory=list)
    misfired: int = 0
    skipped: int = 0
    lease_expired: list[int] = field(default_factory=list)
    republished: list[int] = field(default_factory=list)
    set_aside: list[int] = field(default_factory=list)  # runs the scan could not handle: now dead (scan_error)
    resumed: list[int] = field(default_factory=list)  # paused jobs whose paused_until came: resumed
    # Each waiting run the scan's reads took (queued, misfired or set aside), by where
    # it stood: (partition, due_at, id), as the floors compare them.
    taken: list[tuple[int, datetime, int]] = field(default_factory=list)
    # Late runs left as they were, their job locked by an edit: the next scan looks
    # again, so the floors stay below them.
    left: list[int] = field(default_factory=list)
    # A due read stepped over the runs of services holding their share of the queue
    # (ServiceShares): due runs are left that the next scan, not an interval, looks at.
    shared_out: bool = False

    @property
    def to_publish(self) -> list[int]:
        return self.queued + self.lease_expired + self.republished

    def add(self, other: "ScanResult") -> None:
        """Counts of one run's handling, taken once its savepoint is released."""
        self.queued += other.queued
        self.misfired += other.misfired
        self.skipped += other.skipped
        self.set_aside += other.set_aside
        self.left += other.left


# Runs a scan may publish again while its partitions' queue is at SCHEDULER_MAX_QUEUED.
# With the queue full a run not claimed in time is most likely still in the broker,
# behind the others; republishing all of them would send every waiting run again every
# SCHEDULER_REQUEUE_AFTER, duplicates growing with the backlog. A few per scan still
# find messages that really were lost while it was full (Redis flushed at the limit):
# as those are claimed the queue has room again, and republishing speeds up with it.
REPUBLISH_WHEN_FULL = 10


def scan_once(
    *,
    partitions: list[int] | frozenset[int],
    now: datetime | None = None,
    publish: bool = True,
    advance: bool = False,
    keep_going: Callable[[], bool] | None = None,
    work: "Work | None" = None,
    floors: "dict[int, tuple[datetime, int]] | None" = None,
    ceilings: "dict[int, tuple[datetime, int]] | None" = None,
    share_floors: "ShareFloors | None" = None,
) -> ScanResult:
    """Scan the given partitions once; publish what became queued, batch by batch,
    each after its transaction commits.

    `advance` (a live scan: `now` is the store's clock, read just before): each
    queueing batch, and the republish, decides and stamps at `now` plus the time the
    scan has taken so far (a queueing batch: no earlier than the store's clock of the
    statement that locked its rows). A scan through a backlog takes several batches
    and can take seconds, and what it writes must not be stamped before what other
    writers wrote meanwhile (runs.invariants). Without it every step is at `now`
    (tests, a given time).
    `keep_going`: asked before each batch after the first; False ends the scan there
    (its partitions are no longer this scanner's: the lease was lost mid-scan).
    `work`: the probe these partitions were just asked (next_work, at `now`); the
    kinds of work it says are not due yet are not looked for: no resume before the
    earliest `paused_until`, no lease recovery before the earliest lease end, no
    republish before the oldest queued run has waited SCHEDULER_REQUEUE_AFTER. A
    steady stream of due runs has a scanner scanning every few tens of milliseconds,
    and those reads were half of each scan's statements (the soak at 155 runs/s,
    2026-12-02). Work that comes due in between is found by the next scan.
    `floors` (the scanner command's, kept across its scans): each partition's due
    read starts after the last run (due time, id) a scan took there, and each batch
    moves it on; the scanner command lowers them to each due time notified and drops
    them when notifications may have been missed (Command._lower_floors). `work`'s
    `queued_count`, when it has one, stands for the back-pressure count.
    `ceilings` (the scanner's wakeups.Ceilings.known, kept across its scans): the
    highest (due time, id) a run in flight of each partition has; each batch raises it
    over the runs it took, before they are queued, and the reads of runs in flight
    (lease recovery, republish) stop at the highest of them."""
    now = now or claims.store_now()  # due and late by the store's clock, not this machine's
    started = monotonic()

    def clock() -> datetime:
        return now + timedelta(seconds=monotonic() - started) if advance else now

    parts = sorted(partitions)
    result = ScanResult()
    if not parts:
        return result
    batch = settings.SCHEDULER_SCAN_BATCH
    older = timedelta(seconds=settings.SCHEDULER_REQUEUE_AFTER)

    def is_due(at: datetime | None, after: timedelta = timedelta(0)) -> bool:
        return work is None or (at is not None and at + after <= now)

    # First, so that a resumed job's released run is due in this very scan: the floor
    # of each resumed job's partition goes, since its released run may be behind it.
    if is_due(work and work.resume):
        _resume_due_jobs(parts, now, batch, result)
        if floors is not None:
            for job_id in result.resumed:
                floors.pop(job_id % settings.SCHEDULER_PARTITIONS, None)
    up_to = claims.ceiling_up_to(parts, ceilings)
    if is_due(work and work.lease):
        with transaction.atomic():
            _recover(parts, now, batch, result, up_to)
    if publish and result.lease_expired:
        publish_runs(result.lease_expired, now=now)
    # Back-pressure: runs wait in the store, not in the broker (SCHEDULER_MAX_QUEUED).
    if work is not None and work.queued_count is not None:
        waiting = work.queued_count + len(result.lease_expired)
    else:
        waiting = claims.count_queued(partitions=parts, up_to=up_to)
    room = settings.SCHEDULER_MAX_QUEUED - waiting
    chunk = queue_chunk()
    left = room if room >= chunk else 0
    # A service's share of the queue (SCHEDULER_SERVICE_QUEUED): the services holding
    # theirs are stepped over by this scan's due reads, so that one service's burst
    # does not queue ahead of another's runs due just after it.
    shares = ServiceShares.read(parts, up_to, waiting) if left > 0 else ServiceShares()
    # With a message's worth already waiting, the workers are behind: a run queued
    # ahead will not be taken before its time anyway, and slicing by due time
    # (run_messages) would only make messages of a few runs each, every one paying a
    # batch's fixed statements. The soak under load (2026-12-01, 135 runs/s) had its
    # claims at a median of 2 runs, and its workers at a third of their rate, on
    # messages sliced before the backlog and taken after it. Then: full messages.
    behind = waiting >= chunk
    # Runs due within the look-ahead are queued now, published, and waited for by the
    # worker, which claims each at its due time (runs.services.run_execute_many). Late
    # or not is decided at the batch's clock.
    first = True
    while left > 0:
        if not first and keep_going is not None and not keep_going():
            return result
        first = False
        limit = min(batch, left)
        at = clock()
        horizon = at + timedelta(seconds=settings.SCHEDULER_LOOKAHEAD)
        mine = ScanResult()
        try:
            with transaction.atomic():
                skipping = shares.full()
                if skipping:
                    # Read, then locked: the share floors move over what was read and
                    # taken, never past a run another transaction held (read_keys).
                    after = share_floors.after(skipping, floors) if share_floors is not None else floors
                    read_keys = read_due_skipping(partitions=parts, now=horizon, limit=limit, after=after,
                                                  skip_owners=skipping)
                    due = list(claims.lock_listed(ids=[pk for _, _, pk in read_keys], now=horizon, limit=limit)
                               .select_related("job").only(*DUE_FIELDS))
                else:
                    due = list(claims.lock_due(partitions=parts, now=horizon, limit=limit, after=floors)
                               .select_related("job").only(*DUE_FIELDS))
                    read_keys = [(run.partition, run.due_at, run.pk) for run in due]
                if ceilings is not None:
                    # Raised before the runs are queued: a ceiling too high reads a
                    # little more, one too low would hide a run in flight.
                    for run in due:
                        ceilings[run.partition] = max(ceilings.get(run.partition, claims.NONE_IN_FLIGHT),
                                                      (run.due_at, run.pk))
                if advance and due:
                    # Stamped no earlier than the statement that locked the rows: `at`
                    # was read before it, and a worker's deferral that let go of a run
                    # in between is stamped by then (runs.services._defer_many) and
                    # must come first on its timeline.
                    at = max(at, due[0].locked_at)
                queued = _queue_due(due, at, mine, keep_going)
        except _LeaseLost:
            return result  # the batch's writes undone: the partitions' new scanner decides
        result.add(mine)
        slow = shares.took(queued)
        if skipping:
            result.shared_out = True
        as_it_was = set(mine.left)
        result.taken += [(run.partition, run.due_at, run.pk) for run in due if run.pk not in as_it_was]
        # Queued, misfired or set aside: none of them waits any more. A run left as it
        # was still waits: its partition's floor stays below it (`due` is in floor order).
        # A read that stepped over the services holding their share moves their share
        # floors instead: the runs it stepped over still wait below the runs it took.
        taken = {run.pk for run in due} - as_it_was
        moved = floors if not skipping else (share_floors.at if share_floors is not None else None)
        if moved is not None:
            # Over each partition's runs read, in due order, up to the first not taken
            # (left as it was, or not locked: a stepping read knows those).
            stopped: set[int] = set()
            for part, due_at, pk in read_keys:
                if pk not in taken:
                    stopped.add(part)
                elif part not in stopped:
                    moved[part] = max(moved.get(part, claims.NO_FLOOR), (due_at, pk))
            if skipping and len(read_keys) < limit:
                # Read to the horizon: every other service's run due by then was taken.
                for part in parts:
                    if part not in stopped:
                        moved[part] = max(moved.get(part, claims.NO_FLOOR), (horizon, 0))
        if publish and queued:
            publish_runs([run.pk for run in queued], hosts={run.pk: _host(run.job) for run in queued},
                         due={} if behind else {run.pk: run.due_at for run in queued}, now=at, slow=slow)
        left -= len(queued)
        if len(read_keys) < limit or not taken:
            break  # read to the end, or all it read stays (locked, left): the next scan
    if keep_going is not None and not keep_going():
        return result
    # Republishing comes after queueing, from the room that is left: due runs first.
    if not is_due(work and work.queued, older):
        return result
    again_at = clock()
    with transaction.atomic():
        _republish(parts, again_at, republish_budget(room_left=left, batch=batch), result, up_to)
    if publish and result.republished:
        publish_runs(result.republished, now=again_at)
    return result


def queue_chunk() -> int:
    """The least room under SCHEDULER_MAX_QUEUED a scan waits for before it queues
    (a full run message's worth, SCHEDULER_DISPATCH_BATCH, or a quarter of the limit
    if that is less). Queueing whatever room each scan found, a queue at its limit
    was fed a few runs at a time as the workers took a few: the soak under load
    (2026-12-01, 135 runs/s) had its claims at a median of 2 runs (4.9 on average)
    for thousands queued, each message paying a batch's fixed statements for a
    couple of runs, and the workers fell to about 35 runs/s: the backlog kept
    itself going. Runs left due meanwhile are late already."""
    return max(1, min(settings.SCHEDULER_DISPATCH_BATCH, settings.SCHEDULER_MAX_QUEUED // 4))


def republish_budget(*, room_left: int, batch: int) -> int:
    """How many unclaimed runs one scan may publish again: the room the back-pressure
    leaves after this scan's queueing (each republished run is taken for lost, one more
    message), at least REPUBLISH_WHEN_FULL, at most a batch. The oldest go first."""
    return min(batch, max(room_left, REPUBLISH_WHEN_FULL))


def _host(job: Job) -> str:
    # A stored target that no longer parses as a URL is published with no host: it
    # must not stop its batch from being published (its call fails on its own).
    try:
        return target_key(job)
    except ValueError:
        return ""


# What the due read needs of a run and its job; a misfired run's job is read whole.
DUE_FIELDS = (
    "id", "job_id", "partition", "scheduled_for", "due_at", "status", "attempt", "is_backfill",
    "job__id", "job__window_seconds", "job__target", "job__task", "job__queue", "job__schedule",
    "job__schedule_list", "job__every_seconds", "job__misfire", "job__owner",
)


def _resume_due_jobs(parts: list[int], now: datetime, batch: int, result: ScanResult) -> None:
    """Paused jobs of these partitions whose paused_until has come resume
    (jobs.services.job_resume_due), at most a batch a scan, the longest due first.

    One read of jobs_paused_until_idx (only jobs with a resume time are in it), then
    each job in a transaction of its own: one job's error costs that job only (it
    stays paused, logged, and the next scan tries it again), and a job another
    transaction holds (an edit) is skipped, not waited for."""
    from jobs.services import job_resume_due

    due = (
        Job.objects.filter(paused=True, paused_until__isnull=False, paused_until__lte=now)
        .annotate(part=Mod("id", settings.SCHEDULER_PARTITIONS))
        .filter(part__in=parts)
        .order_by("paused_until")
        .values_list("pk", flat=True)[:batch]
    )
    for job_id in list(due):
        try:
            with transaction.atomic():
                resumed = job_resume_due(job_id=job_id, now=now)
        except _STORE_ERRORS:
            raise
        except Exception:  # noqa: BLE001 - this job's failure only
            logger.error("job_%s could not be resumed at its paused_until; next scan", job_id, exc_info=True)
            continue
        if resumed is not None:
            result.resumed.append(job_id)


def _recover(parts: list[int], now: datetime, batch: int, result: ScanResult, up_to: datetime | None = None) -> None:
    expired = claims.release_expired_leases(partitions=parts, now=now, limit=batch, up_to=up_to)
    found = [events.event(i, "lease_expired", now) for i in expired]
    stopped = _stop_runs_of_stopped_jobs(expired, now, found)
    events.record_many(found)
    result.lease_expired = [i for i in expired if i not in stopped]


def _stop_runs_of_stopped_jobs(ids: list[int], now: datetime, found: list[events.Event]) -> set[int]:
    """A run whose lease ran out after its job was deleted or paused is not started
    again: a run already running when that happened may finish, but a new attempt
    is a new start. A deleted job's run is cancelled; a paused job's goes back to
    waiting, held, for the resume to release (jobs.services.job_resume)."""
    if not ids:
        return set()
    rows = Run.objects.filter(pk__in=ids, kept_for=OPEN_KEPT_FOR).values_list("pk", "job__state", "job__paused")
    deleted = [pk for pk, state, _ in rows if state == Job.State.DELETED]
    paused = [pk for pk, state, is_paused in rows if state != Job.State.DELETED and is_paused]
    if deleted:
        Run.objects.filter(pk__in=deleted, status=S.QUEUED, kept_for=OPEN_KEPT_FOR).update(
            status=S.CANCELLED, finished_at=now, queued_at=None)
        found += [events.event(pk, "cancelled", now, reason="job deleted") for pk in deleted]
    if paused:
        Run.objects.filter(pk__in=paused, status=S.QUEUED, kept_for=OPEN_KEPT_FOR).update(
            status=S.SCHEDULED, held=True, queued_at=None)
        found += [events.event(pk, "held", now, reason="job paused") for pk in paused]
    return {*deleted, *paused}


def _republish(parts: list[int], now: datetime, budget: int, result: ScanResult,
               up_to: datetime | None = None) -> None:
    """Queued runs not claimed within SCHEDULER_REQUEUE_AFTER, published again: their
    message may be lost (a broker flushed or restarted, a dead worker's prefetch).

    While the workers are behind, a run not claimed in time is most likely still
    waiting, in the broker or in a worker's prefetch, behind the others: publishing
    every such run again sends each waiting run once more every
    SCHEDULER_REQUEUE_AFTER, a backlog feeding itself (the soak under load,
    2026-12-01: 1,069,103 copies for 281,801 runs queued, the workers' rate down by
    a fifth). So the cut is also SCHEDULER_REQUEUE_AFTER before the latest
    `queued_at` among these partitions' running runs (claims.claimed_up_to), which
    the claim sets to when the message that started each was published: the workers
    are taking messages published then, and a run whose last copy the broker had
    before those by that much is taken for lost (the broker hands messages on in
    order, but for the few a worker holds ahead); runs that finished within the
    last SCHEDULER_REQUEUE_AFTER count as well as running ones. With none of either
    (the workers took none of these partitions' messages that long: lost, or the
    workers stopped), the plain cut, as before. Whatever the cut, each copy of a run
    waits longer than the one before (claims.touch_unclaimed). (Two first versions
    read the running runs' queued_at as the time of their last copy, and a run
    claimed from an earlier copy pulled the cut forward: the republishing fed itself
    again, 70,389 and 120,247 copies in the soak's first 4 minutes.)"""
    older = timedelta(seconds=settings.SCHEDULER_REQUEUE_AFTER)
    reached = claims.claimed_up_to(partitions=parts, since=now - older, up_to=up_to)
    stale = claims.touch_unclaimed(
        partitions=parts, now=now, older_than=older, limit=budget,
        before=None if reached is None else reached - older, up_to=up_to,
    )
    events.record_many(events.event(i, "requeued", now, reason="not claimed in time; published again") for i in stale)
    result.republished = stale


# One row's failure costs that row only: any exception, except the store's own
# trouble (the database went away, a deadlock, a statement timeout), which is not
# the row's: that fails the scan, and the next turn tries it all again.
_STORE_ERRORS = (OperationalError, InterfaceError)


class _LeaseLost(Exception):
    """The scan's partitions stopped being this scanner's in the middle of a batch."""


# Late runs handled between two asks of the lease, in a batch. Each is a savepoint,
# a job lock and its misfire policy: a batch of late runs (a backlog) took seconds
# under load, and a scanner cut off from ZooKeeper went on writing through it, 6.29 s
# after the cut with a session timeout of 4 s (the soak under load, 2026-12-01).
LATE_RUNS_PER_ASK = 25


def _queue_due(due: list[Run], now: datetime, result: ScanResult,
               keep_going: Callable[[], bool] | None = None) -> list[Run]:
    """Due runs to `queued` (or to their misfire policy); returns the queued ones.

    A run that cannot be handled costs that run only: each late run is handled
    under a savepoint of its own, and if the one statement that queues the others
    fails, they are queued one by one. A run that fails alone is set aside
    (`_set_aside`). `keep_going` is asked every LATE_RUNS_PER_ASK late runs; False
    raises _LeaseLost, which undoes the batch."""
    grace = timedelta(seconds=settings.SCHEDULER_MISFIRE_GRACE)
    on_time: list[Run] = []
    late_queued: list[Run] = []
    found: list[events.Event] = []
    late = 0
    for run in due:
        if run.is_backfill or run.attempt > 0 or now <= _deadline(run, grace):
            on_time.append(run)
        elif not run.job.is_recurring and run.job.misfire != "skip":
            # A late one-off under run_once or run_all runs now, and has no other
            # times to skip: it is queued with the others (a spike held back by
            # SCHEDULER_MAX_QUEUED costs no statement per run).
            found.append(_misfired(run, now, other_missed_times=0))
            result.misfired += 1
            on_time.append(run)
        else:
            late += 1
            if keep_going is not None and late % LATE_RUNS_PER_ASK == 0 and not keep_going():
                raise _LeaseLost
            if _handle_late(run, now, result):
                late_queued.append(run)
    return _queue_on_time(on_time, found, now, result) + late_queued


def _handle_late(run: Run, now: datetime, result: ScanResult) -> bool:
    """One late run by its job's policy, under a savepoint: if anything in it fails
    (a stored cron or zone that no longer parses, a clash on insert), its writes
    are undone and the run is set aside. True when the late run was queued."""
    mine = ScanResult()
    try:
        with transaction.atomic():
            # The policy decides from the job as it is now, its row locked. NOWAIT:
            # this scan holds run rows, and an edit locks the job, then its runs.
            job = jobs_lock([run.job_id], nowait=True).get(run.job_id)
            if job is None:
                return False
            run.job = job
            queued = _misfire(run, now, mine)
    except _STORE_ERRORS as exc:
        if _lock_busy(exc):
            # Someone is changing the job (an edit, a pause): its writes decide what
            # happens to this run, and the next scan looks again (below the floor).
            logger.info("run %s: its job is being changed; next scan", run.public_id)
            result.left.append(run.pk)
            return False
        raise
    except Exception as exc:  # noqa: BLE001 - one row's failure, whatever it is
        _set_aside(run, now, exc, result)
        return False
    result.add(mine)
    return queued


def _queue_on_time(runs: list[Run], found: list[events.Event], now: datetime, result: ScanResult) -> list[Run]:
    """The on-time runs to `queued` in one statement; if it fails, one by one
    (a batch statement is a speed-up, not a unit of failure)."""
    if not runs:
        events.record_many(found)
        return []
    try:
        with transaction.atomic():
            _mark_queued(runs, found, now)
    except _STORE_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - the statement failed on some row: find which
        logger.warning("queueing %d runs together failed (%s); queueing them one by one", len(runs), exc)
    else:
        result.queued.extend(run.pk for run in runs)
        return runs
    queued: list[Run] = []
    for run in runs:
        try:
            with transaction.atomic():
                _mark_queued([run], [e for e in found if e.run_id == run.pk], now)
        except _STORE_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001 - this row's failure
            _set_aside(run, now, exc, result)
            continue
        queued.append(run)
        result.queued.append(run.pk)
    return queued


def _mark_queued(runs: list[Run], found: list[events.Event], now: datetime) -> None:
    # The `queued` entry goes on the row (runs.timeline), but for a run that has an
    # event of this scan before it: a row, after that one.
    told = {e.run_id for e in found}
    ids = [run.pk for run in runs if run.pk not in told]
    rows = [run.pk for run in runs if run.pk in told]
    claims.mark_queued(run_ids=ids, now=now, on_row=True)
    claims.mark_queued(run_ids=rows, now=now)
    events.record_many([*found, *(events.event(i, "queued", now) for i in rows),
                        *(events.on_row(events.event(i, "queued", now)) for i in ids)])


def _set_aside(run: Run, now: datetime, exc: Exception, result: ScanResult) -> None:
    """A run the scan cannot handle ends dead, with why on its timeline (`scan_error`,
    then `dead`), and its owner is told, as for any dead run.

    Dead, not tried again: what failed (a schedule or zone that no longer parses, a
    row the store refuses) fails the same way next turn, and a run left due would be
    read and fail on every scan. Like Quartz's ERROR state, it waits for people: fix
    the job, then requeue the run from the dead list. Its job still gets its next run
    where that can be worked out (a clash, a refused row), so one bad run does not
    stop the job; where it cannot (the schedule does not parse) the `dead` event says so.
    """
    why = f"{type(exc).__name__}: {exc}"[:1000]
    reason = f"the scanner could not handle this run: {why}"
    logger.error("run %s set aside: %s", run.public_id, why)
    Run.objects.filter(pk=run.pk, status=S.SCHEDULED).update(status=S.DEAD, finished_at=now, last_error=reason[:2000])
    job = Job.objects.select_related("owner").get(pk=run.job_id)
    then = _next_after_set_aside(run, job, now)
    events.record_many([
        events.of(run, "scan_error", now, reason=why),
        events.of(run, "dead", now, reason=reason, notified=notices.recipient(job), **then),
    ])
    notices.notice_add(job=job, kind="dead", run=run, reason=reason, now=now)
    transaction.on_commit(lambda pk=run.pk, why=reason: notify_dead(run_id=pk, reason=why))
    result.set_aside.append(run.pk)


def _next_after_set_aside(run: Run, job: Job, now: datetime) -> dict[str, str]:
    """The job's next run after a run set aside (none for an extra run), under its
    own savepoint; what the `dead` event says about it."""
    if run.is_backfill:
        return {}
    try:
        with transaction.atomic():
            nxt = run_next_create(job=job, now=now)
    except _STORE_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever it is, it is said on the timeline
        return {"next_run_error": f"{type(exc).__name__}: {exc}"[:1000]}
    return {"next_run": nxt.public_id, "next_scheduled_for": iso_z(nxt.scheduled_for)} if nxt else {}


def _deadline(run: Run, grace: timedelta) -> datetime:
    return schedule.misfire_deadline(
        scheduled_for=run.scheduled_for,
        due_at=run.due_at,
        window=timedelta(seconds=run.job.window_seconds),
        grace=grace,
    )


def _misfire(run: Run, now: datetime, result: ScanResult) -> bool:
    """A run found past its window plus the grace: the job's misfire policy decides.
    True when the late run runs now (it is queued here).

    Only times that are themselves past their window plus the grace count as
    missed (schedule.missed_times); the first time that is not is the job's next
    run under every policy, never skipped."""
    job = run.job
    missed: list[datetime] = []
    excluded: list[datetime] = []
    missed_count = 0
    next_time = None
    if job.is_recurring:
        # The job's own timetable (every kind: cron, lists, every, ends_at, exclude).
        found_missed = schedule.missed_times(
            timetable=job.timetable(),
            late_time=run.scheduled_for,
            now=now,
            window=timedelta(seconds=job.window_seconds),
            grace=timedelta(seconds=settings.SCHEDULER_MISFIRE_GRACE),
            keep=settings.SCHEDULER_MISFIRE_MAX_SKIPPED,
        )
        missed, missed_count, next_time = found_missed.latest, found_missed.count, found_missed.next_time
        excluded = found_missed.excluded
    decision = schedule.misfire_decision(
        policy=job.misfire, late_time=run.scheduled_for, missed_after=missed, next_time=next_time
    )
    result.misfired += 1
    found: list[events.Event] = [_misfired(run, now, other_missed_times=missed_count)]
    if decision.run_late:
        claims.mark_queued(run_ids=[run.pk], now=now)
        found.append(events.of(run, "queued", now))
        result.queued.append(run.pk)
    else:
        Run.objects.filter(pk=run.pk, status=S.SCHEDULED).update(status=S.SKIPPED, finished_at=now)
        found.append(events.of(run, "skipped", now, reason=f"misfire policy {job.misfire}"))
        notices.notice_add(job=job, kind="skipped", run=run, reason=f"misfire policy {job.misfire}", now=now)
        result.skipped += 1
    events.record_many(found, runs={run.pk: run})
    _skip_times(job, decision.skipped_times, now, result)
    if job.misfire == Job.Misfire.RUN_ALL:
        # Every missed time runs in turn: an excluded one gets its row when the runs
        # reach it (runs.nextrun). Written now, those rows were the job's latest, and
        # its next run came after them, past every time between (each one lost).
        excluded = []
    _skip_times(job, excluded, now, result, excluded=True)
    if not decision.run_late:
        # The one next-run decision, after the skipped rows are written: the first
        # time after the latest of them (decision.next_time); a one-off is completed.
        nxt = job_next_run(job=job, now=now)
        if nxt is not None:
            events.record(run.pk, "next_run_created", now, run=nxt.public_id, scheduled_for=iso_z(nxt.scheduled_for))
    return decision.run_late


def _lock_busy(exc: Exception) -> bool:
    """The job's row is locked by another transaction (FOR UPDATE NOWAIT refused)."""
    import psycopg.errors

    return isinstance(exc.__cause__, psycopg.errors.LockNotAvailable)


def _misfired(run: Run, now: datetime, *, other_missed_times: int) -> events.Event:
    """The `misfired` event every late run's timeline gets, naming the policy."""
    late_by = int((now - run.scheduled_for).total_seconds())
    return events.of(run, "misfired", now, policy=run.job.misfire, late_by_s=late_by,
                        other_missed_times=other_missed_times)


def _skip_times(job: Job, times: list[datetime], now: datetime, result: ScanResult, *, excluded: bool = False) -> None:
    """Every other missed time gets a `skipped` row (and a `skipped` event); with
    `excluded`, the times on the job's excluded dates, with reason `excluded`."""
    if not times:
        return
    taken = {r.scheduled_for: r for r in Run.objects.filter(job=job, scheduled_for__in=times)}
    why = f"{EXCLUDED_PREFIX} the date is one of the job's excluded dates" if excluded else (
        f"missed while nothing could start it (misfire policy {job.misfire})"
    )
    # An edit's cancelled row at a missed time is this time's row again, as the
    # excluded rows' (runs.nextrun): left cancelled, the job's next run came after the
    # skipped rows, at that very time, already missed, and reopened it as waiting.
    again = [r for r in taken.values() if r.status == S.CANCELLED and not r.is_backfill]
    if again:
        Run.objects.filter(pk__in=[r.pk for r in again], status=S.CANCELLED).update(
            status=S.SKIPPED, finished_at=now, last_error=why)
        for r in again:
            r.status, r.finished_at, r.last_error = S.SKIPPED, now, why
    reason = "excluded" if excluded else f"misfire policy {job.misfire}"
    rows = [
        Run(
            job=job,
            scheduled_for=t,
            due_at=t,
            partition=job.partition,
            status=S.SKIPPED,
            finished_at=now,
            last_error=why,
        )
        for t in times
        if t not in taken
    ]
    created = Run.objects.bulk_create(rows) if rows else []
    if created and created[0].pk is None:  # backends without RETURNING on bulk insert
        created = list(Run.objects.filter(job=job, scheduled_for__in=[r.scheduled_for for r in rows]))
    created += again
    events.record_many(
        (events.of(r, "skipped", now, reason=reason) for r in created),
        runs={r.pk: r for r in created},
    )
    notices.notices_add(
        notices.notice_row(job=job, kind="skipped", run=r, reason=reason, now=now) for r in created
    )
    result.skipped += len(created)


