"""One scan of a scanner's partitions: due runs onto the run queue, misfires by
policy, and recovery of runs whose message or lease was lost.

The database write happens first and the publish after commit: a scanner that
dies between the two leaves queued runs that the unclaimed-run recovery
publishes again. A run published twice is claimed once (the fence).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from jobs import schedule
from jobs.models import Job
from runs import claims, events
from jobs.validators import target_host
from runs.delivery import iso_z
from runs.models import Run
from runs.services import run_create

logger = logging.getLogger("scheduler.scanner")
S = Run.Status


@dataclass
class ScanResult:
    queued: list[int] = field(default_factory=list)
    misfired: int = 0
    skipped: int = 0
    lease_expired: list[int] = field(default_factory=list)
    republished: list[int] = field(default_factory=list)

    @property
    def to_publish(self) -> list[int]:
        return self.queued + self.lease_expired + self.republished


def scan_once(*, partitions: list[int] | frozenset[int], now: datetime | None = None, publish: bool = True) -> ScanResult:
    """Scan the given partitions once; publish what became queued, batch by batch,
    each after its transaction commits."""
    now = now or claims.store_now()  # due and late by the store's clock, not this machine's
    parts = sorted(partitions)
    result = ScanResult()
    if not parts:
        return result
    batch = settings.SCHEDULER_SCAN_BATCH
    with transaction.atomic():
        _recover(parts, now, batch, result)
    if publish and (result.lease_expired or result.republished):
        publish_runs(result.lease_expired + result.republished)
    # Back-pressure: runs wait in the store, not in the broker (SCHEDULER_MAX_QUEUED).
    room = settings.SCHEDULER_MAX_QUEUED - claims.count_queued(partitions=parts)
    while room > 0:
        limit = min(batch, room)
        with transaction.atomic():
            due = list(claims.lock_due(partitions=parts, now=now, limit=limit).select_related("job").only(*DUE_FIELDS))
            queued = _queue_due(due, now, result)
        if publish and queued:
            publish_runs([run.pk for run in queued], hosts={run.pk: target_host(run.job.target) for run in queued})
        room -= len(queued)
        if len(due) < limit:
            break
    return result


# What the due read needs of a run and its job; a misfired run's job is read whole.
DUE_FIELDS = (
    "id", "job_id", "partition", "scheduled_for", "due_at", "status", "attempt", "is_backfill",
    "job__id", "job__window_seconds", "job__target", "job__schedule", "job__misfire",
)


def _recover(parts: list[int], now: datetime, batch: int, result: ScanResult) -> None:
    expired = claims.release_expired_leases(partitions=parts, now=now, limit=batch)
    stale = claims.touch_unclaimed(
        partitions=parts, now=now, older_than=timedelta(seconds=settings.SCHEDULER_REQUEUE_AFTER), limit=batch
    )
    found = [events.event(i, "lease_expired", now) for i in expired]
    found += [events.event(i, "requeued", now, reason="not claimed in time; published again") for i in stale]
    events.record_many(found)
    result.lease_expired, result.republished = expired, stale


def _queue_due(due: list[Run], now: datetime, result: ScanResult) -> list[Run]:
    """Due runs to `queued` (or to their misfire policy); returns the queued ones."""
    grace = timedelta(seconds=settings.SCHEDULER_MISFIRE_GRACE)
    on_time: list[Run] = []
    late_queued: list[Run] = []
    found: list[events.Event] = []
    for run in due:
        if run.is_backfill or run.attempt > 0 or now <= _deadline(run, grace):
            on_time.append(run)
        elif not run.job.schedule and run.job.misfire != "skip":
            # A late one-off under run_once or run_all runs now, and has no other
            # times to skip: it is queued with the others (a spike held back by
            # SCHEDULER_MAX_QUEUED costs no statement per run).
            found.append(_misfired(run, now, other_missed_times=0))
            result.misfired += 1
            on_time.append(run)
        else:
            run.job = Job.objects.get(pk=run.job_id)  # the policy needs the whole job
            if _misfire(run, now, result):
                late_queued.append(run)
    ids = [run.pk for run in on_time]
    if ids:
        claims.mark_queued(run_ids=ids, now=now)
        found += [events.event(i, "queued", now) for i in ids]
        result.queued.extend(ids)
    events.record_many(found)
    return on_time + late_queued


def _deadline(run: Run, grace: timedelta) -> datetime:
    return schedule.misfire_deadline(
        scheduled_for=run.scheduled_for,
        due_at=run.due_at,
        window=timedelta(seconds=run.job.window_seconds),
        grace=grace,
    )


def _misfire(run: Run, now: datetime, result: ScanResult) -> bool:
    """A run found past its window plus the grace: the job's misfire policy decides.
    True when the late run runs now (it is queued here)."""
    job = run.job
    missed: list[datetime] = []
    missed_count = 0
    next_future = None
    if job.is_recurring:
        # Keep only the most recent missed times: a job down for a year at one run a
        # minute would otherwise write 500k `skipped` rows. Keeping the latest ones
        # means the schedule goes on from now, not from a year ago.
        recent: deque[datetime] = deque(maxlen=settings.SCHEDULER_MISFIRE_MAX_SKIPPED)
        for t in schedule.cron_times(job.schedule, job.timezone, run.scheduled_for, now + timedelta(seconds=1)):
            recent.append(t)
            missed_count += 1
        missed = list(recent)
        next_future = schedule.next_cron_time(job.schedule, job.timezone, max([now, *missed]))
    decision = schedule.misfire_decision(
        policy=job.misfire, late_time=run.scheduled_for, missed_after=missed, next_future=next_future
    )
    result.misfired += 1
    found: list[events.Event] = [_misfired(run, now, other_missed_times=missed_count)]
    if decision.run_late:
        claims.mark_queued(run_ids=[run.pk], now=now)
        found.append(events.event(run.pk, "queued", now))
        result.queued.append(run.pk)
    else:
        Run.objects.filter(pk=run.pk, status=S.SCHEDULED).update(status=S.SKIPPED, finished_at=now)
        found.append(events.event(run.pk, "skipped", now, reason=f"misfire policy {job.misfire}"))
        result.skipped += 1
    events.record_many(found)
    _skip_times(job, decision.skipped_times, now, result)
    if not decision.run_late:
        if decision.next_time is not None:
            nxt = run_create(job=job, scheduled_for=decision.next_time, now=now)
            events.record(run.pk, "next_run_created", now, run=nxt.public_id, scheduled_for=iso_z(nxt.scheduled_for))
        elif not job.is_recurring:
            Job.objects.filter(pk=job.pk).exclude(state=Job.State.DELETED).update(state=Job.State.COMPLETED)
    return decision.run_late


def _misfired(run: Run, now: datetime, *, other_missed_times: int) -> events.Event:
    """The `misfired` event every late run's timeline gets, naming the policy."""
    late_by = int((now - run.scheduled_for).total_seconds())
    return events.event(run.pk, "misfired", now, policy=run.job.misfire, late_by_s=late_by,
                        other_missed_times=other_missed_times)


def _skip_times(job: Job, times: list[datetime], now: datetime, result: ScanResult) -> None:
    """Every other missed time gets a `skipped` row (and a `skipped` event)."""
    if not times:
        return
    taken = set(Run.objects.filter(job=job, scheduled_for__in=times).values_list("scheduled_for", flat=True))
    rows = [
        Run(
            job=job,
            scheduled_for=t,
            due_at=t,
            partition=job.partition,
            status=S.SKIPPED,
            finished_at=now,
            last_error=f"missed while nothing could start it (misfire policy {job.misfire})",
        )
        for t in times
        if t not in taken
    ]
    created = Run.objects.bulk_create(rows)
    if created and created[0].pk is None:  # backends without RETURNING on bulk insert
        created = list(Run.objects.filter(job=job, scheduled_for__in=[r.scheduled_for for r in rows]))
    events.record_many(events.event(r.pk, "skipped", now, reason=f"misfire policy {job.misfire}") for r in created)
    result.skipped += len(created)


def publish_runs(run_ids: list[int], hosts: dict[int, str] | None = None) -> None:
    """Runs onto the run queue over one broker connection, SCHEDULER_DISPATCH_BATCH
    to a message, each message's runs to one target host where the host is known
    (so one slow host's message does not carry another host's runs)."""
    from runs.tasks import execute_runs
    from scheduler_project.celery import app

    # More runs to one host than its bulkhead holds would only be put back to wait.
    size = max(1, min(settings.SCHEDULER_DISPATCH_BATCH, settings.SCHEDULER_TARGET_CONCURRENCY))
    groups: dict[str, list[int]] = {}
    for run_id in run_ids:
        groups.setdefault((hosts or {}).get(run_id, ""), []).append(run_id)
    with app.producer_or_acquire() as producer:
        for ids in groups.values():
            for start in range(0, len(ids), size):
                execute_runs.apply_async((ids[start : start + size],), producer=producer)
