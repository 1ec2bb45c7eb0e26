"""The run lifecycle: create, claim, call, record the outcome and the next run.

Retries are rows (a run back to `scheduled` with a later `due_at`), never
broker-side retries: the database is the truth, queues are hints.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.mail import send_mail
from django.db import connection, transaction
from django.db.models import Max
from django.utils import timezone

from jobs import schedule
from jobs.models import Job
from jobs.validators import check_resolved_target, target_host
from runs import breakers, bulkhead, claims, delivery, events
from runs.claims import Claim
from runs.delivery import CallResult
from runs.models import Run
from runs.signals import run_dead

logger = logging.getLogger("scheduler.runs")
S = Run.Status


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


def lease_length() -> timedelta:
    return timedelta(seconds=settings.SCHEDULER_LEASE_SECONDS)


def is_held(job: Job) -> bool:
    """A held run is not scanned: its job is paused (or its target host is; see runs.holds)."""
    from runs.holds import target_is_paused

    return job.paused or target_is_paused(job.target)


def run_create(
    *, job: Job, scheduled_for: datetime, now: datetime, is_backfill: bool = False, reason: str = ""
) -> Run:
    window = timedelta(seconds=job.window_seconds)
    run = Run.objects.create(
        job=job,
        scheduled_for=scheduled_for,
        due_at=schedule.spread_due_at(job.pk, scheduled_for, window),
        partition=job.partition,
        held=is_held(job),
        is_backfill=is_backfill,
    )
    detail = {"scheduled_for": delivery.iso_z(run.scheduled_for), "due_at": delivery.iso_z(run.due_at)}
    if reason:
        detail["reason"] = reason
    events.record(run.pk, "scheduled", now, **detail)
    return run


def run_next_create(*, job: Job, now: datetime) -> Run | None:
    """The job's next run, after its latest one; a one-off is completed instead.

    Called in the same transaction that ends the previous run, so a job always
    has exactly one run waiting.
    """
    if job.state == Job.State.DELETED:
        return None
    if not job.is_recurring:
        Job.objects.filter(pk=job.pk).exclude(state=Job.State.DELETED).update(
            state=Job.State.COMPLETED, updated_at=now
        )
        return None
    latest = Run.objects.filter(job=job, is_backfill=False).aggregate(t=Max("scheduled_for"))["t"]
    after = latest or now
    return run_create(job=job, scheduled_for=schedule.next_cron_time(job.schedule, job.timezone, after), now=now)


class Heartbeat:
    """Keeps the lease (and the bulkhead slot) alive while the target call is in
    flight, from its own thread."""

    def __init__(self, claim: Claim, lease: timedelta, slot: bulkhead.Slot | None = None) -> None:
        self.claim, self.lease, self.slot = claim, lease, slot
        self.stopped = threading.Event()
        self.lost = False
        self.thread = threading.Thread(target=self._beat, name=f"heartbeat-{claim.run_id}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)

    def _beat(self) -> None:
        interval = max(0.5, self.lease.total_seconds() / 3)
        try:
            while not self.stopped.wait(interval):
                try:
                    self._beat_once()
                except Exception:
                    # A dropped connection (a database restart, a terminated backend)
                    # costs one beat, not the lease: the next beat reconnects.
                    logger.warning("heartbeat for run %s failed; trying again", self.claim.run_id, exc_info=True)
                    connection.close()
                if self.lost and self.slot is None:
                    return
        finally:
            connection.close()

    def _beat_once(self) -> None:
        now = timezone.now()
        if not self.lost:
            alive = claims.heartbeat(run_id=self.claim.run_id, fence=self.claim.fence, now=now, lease=self.lease)
            # Taken over: the call goes on, but its outcome will be refused.
            self.lost = not alive
        if self.slot is not None:
            # The call is still in flight to the host, taken over or not: it holds its slot.
            bulkhead.extend(self.slot, now=now, lease=self.lease)


@dataclass
class Gate:
    """What a run was let through with: a bulkhead slot, and perhaps the breaker's probe."""

    host: str
    holder: str
    slot: bulkhead.Slot
    probe: bool
    called: bool = False

    def release(self) -> None:
        try:
            bulkhead.release(self.slot)
            if self.probe and not self.called:
                breakers.release_probe(host=self.host, holder=self.holder)
        except Exception:  # the slot and the probe run out by themselves
            logger.warning("could not release %s's slot for %s", self.holder, self.host, exc_info=True)


def run_execute(*, run_id: int, worker: str | None = None) -> str:
    """Admit, claim, call the target, record what happened. Returns the outcome.

    Admission (the target's breaker, then a bulkhead slot) comes before the claim,
    so a run that may not be called yet goes back to `scheduled` without its
    attempt or fence moving: waiting spends no try, and holds no worker.
    """
    worker = worker or default_worker_id()
    lease = lease_length()
    run = Run.objects.select_related("job").filter(pk=run_id).first()
    if run is None or not claims.may_claim(run, timezone.now()):
        return "not_claimed"  # ended, held, or someone holds a live lease: drop the message
    gate = _admit(run, worker, lease)
    if isinstance(gate, str):
        return gate
    try:
        return _claim_and_call(run_id, worker, lease, gate)
    finally:
        gate.release()


def _admit(run: Run, worker: str, lease: timedelta) -> Gate | str:
    now = timezone.now()
    host = target_host(run.job.target)
    holder = f"{run.pk}/{worker}"
    probe_lease = timedelta(seconds=run.job.timeout_seconds) + lease
    admission = breakers.admit(host=host, holder=holder, now=now, probe_lease=probe_lease)
    if admission.hold_until is not None:
        probe_at = delivery.iso_z(admission.next_probe_at) if admission.next_probe_at else None
        return _defer(run, now, admission.hold_until, "held_by_breaker", host=host, state=admission.state,
                      next_probe_at=probe_at)
    slot = bulkhead.take(host=host, holder=holder, now=now, lease=lease)
    if slot is None:
        if admission.probe:
            breakers.release_probe(host=host, holder=holder)
        return _defer(run, now, bulkhead.wait_until(now, host), "bulkhead_wait", host=host, limit=bulkhead.limit())
    return Gate(host=host, holder=holder, slot=slot, probe=admission.probe)


def _defer(run: Run, now: datetime, due_at: datetime, reason: str, **detail: object) -> str:
    with transaction.atomic():
        if not claims.defer(run_id=run.pk, now=now, due_at=due_at):
            return "not_claimed"
        events.record(run.pk, reason, now, due_at=delivery.iso_z(due_at), **detail)
    return reason


def _claim_and_call(run_id: int, worker: str, lease: timedelta, gate: Gate) -> str:
    with transaction.atomic():
        now = timezone.now()
        claim = claims.claim(run_id=run_id, worker=worker, now=now, lease=lease)
        if claim is None:
            return "not_claimed"  # someone else holds it, or it is no longer queued
        run = Run.objects.select_related("job").get(pk=run_id)
        events.record(run_id, "claimed", now, fence=claim.fence, worker=worker, attempt=claim.attempt)
    job = run.job
    if claim.attempt > job.retry_max + 1:
        return run_record_refusal(run=run, job=job, claim=claim, reason="out of tries (leases lost)")
    try:
        check_resolved_target(job.target)
    except ValueError as exc:
        return run_record_refusal(run=run, job=job, claim=claim, reason=f"target refused: {exc}")
    request = delivery.build_request(run=run, job=job, claim=claim, signer=_signer_for(job))
    with Heartbeat(claim, lease, gate.slot):
        result = delivery.call(request, timeout_seconds=job.timeout_seconds)
    gate.called = True
    _tell_breaker(gate, result)
    return run_record_outcome(run=run, job=job, claim=claim, result=result)


def _tell_breaker(gate: Gate, result: CallResult) -> None:
    try:
        breakers.record(host=gate.host, holder=gate.holder, trouble=result.retryable, error=result.describe(),
                        now=timezone.now())
    except Exception:  # the breaker is advice; the outcome must still be recorded
        logger.warning("could not record the call's result on %s's breaker", gate.host, exc_info=True)


def _signer_for(job: Job) -> delivery.Signer | None:
    from runs.signing import signer_for_owner

    return signer_for_owner(job.owner_id)


def _answered_event(run: Run, claim: Claim, result: CallResult, now: datetime) -> object:
    answer = {"status": result.status} if result.status is not None else {"error": result.error}
    return events.event(run.pk, "target_answered", now, fence=claim.fence, duration_ms=result.duration_ms, **answer)


def run_record_outcome(*, run: Run, job: Job, claim: Claim, result: CallResult) -> str:
    """One transaction: the outcome under the fence, and the next run or the retry."""
    now = timezone.now()
    with transaction.atomic():
        answered = _answered_event(run, claim, result, now)
        if result.ok:
            if not claims.finish(run_id=run.pk, fence=claim.fence, status=S.SUCCEEDED, now=now):
                return _stale(run, claim, now, answered)
            events.record_many([answered, events.event(run.pk, "succeeded", now, fence=claim.fence)])
            _next_run(job, run, now)
            return "succeeded"
        if result.retryable and claim.attempt <= job.retry_max:
            due_at = now + schedule.retry_delay(
                attempt=claim.attempt,
                backoff=job.retry_backoff,
                base=timedelta(seconds=job.retry_base_seconds),
                cap=timedelta(seconds=job.retry_cap_seconds),
                retry_after=(
                    timedelta(seconds=result.retry_after_seconds) if result.retry_after_seconds is not None else None
                ),
            )
            if not claims.schedule_retry(run_id=run.pk, fence=claim.fence, due_at=due_at, error=result.describe()):
                return _stale(run, claim, now, answered)
            retry = events.event(run.pk, "retry_scheduled", now, due_at=delivery.iso_z(due_at), fence=claim.fence)
            events.record_many([answered, retry])
            return "retry_scheduled"
        if result.retryable:
            reason = f"out of tries after {claim.attempt} attempts: {result.describe()}"
        else:
            reason = f"target answered {result.describe()}"
        return _dead(run=run, job=job, claim=claim, reason=reason, now=now, answered=answered)


def run_record_refusal(*, run: Run, job: Job, claim: Claim, reason: str) -> str:
    """A claimed run that must not be called goes to the dead list."""
    now = timezone.now()
    with transaction.atomic():
        return _dead(run=run, job=job, claim=claim, reason=reason, now=now, answered=None)


def _dead(*, run: Run, job: Job, claim: Claim, reason: str, now: datetime, answered: object) -> str:
    if not claims.finish(run_id=run.pk, fence=claim.fence, status=S.DEAD, now=now, error=reason):
        return _stale(run, claim, now, answered)
    recipient = job.notify or job.owner.email
    found = [answered] if answered is not None else []
    dead = events.event(run.pk, "dead", now, reason=reason, notified=recipient, fence=claim.fence)
    events.record_many(found + [dead])
    _next_run(job, run, now)
    transaction.on_commit(lambda: notify_dead(run_id=run.pk, reason=reason))
    return "dead"


def _next_run(job: Job, run: Run, now: datetime) -> None:
    if run.is_backfill:
        return  # backfills are extra runs; the job's own timetable goes on without them
    nxt = run_next_create(job=job, now=now)
    if nxt is not None:
        events.record(
            run.pk, "next_run_created", now, run=nxt.public_id, scheduled_for=delivery.iso_z(nxt.scheduled_for)
        )


def _stale(run: Run, claim: Claim, now: datetime, answered: object) -> str:
    # The lease was taken over: the store refuses this holder's outcome.
    found = [answered] if answered is not None else []
    events.record_many(found + [events.event(run.pk, "stale_write_rejected", now, fence=claim.fence, worker=claim.worker)])
    logger.warning("run %s: stale write from fence %s refused", run.public_id, claim.fence)
    return "stale_write_rejected"


def notify_dead(*, run_id: int, reason: str) -> None:
    """Tell the job's owner: a signal for code, a log line, and an e-mail when there is an address."""
    run = Run.objects.select_related("job__owner").get(pk=run_id)
    job = run.job
    logger.warning("run %s of %s is dead: %s", run.public_id, job.public_id, reason)
    run_dead.send(sender=Run, run=run, reason=reason)
    recipient = job.notify or job.owner.email
    if recipient:
        send_mail(
            subject=f"[scheduler] {job.name or job.public_id}: run {run.public_id} is dead",
            message=(
                f"Run {run.public_id} of job {job.public_id} ({job.name}) scheduled for "
                f"{delivery.iso_z(run.scheduled_for)} is on the dead list after {run.attempt} attempt(s).\n\n"
                f"Reason: {reason}\nTarget: {job.target}\n"
            ),
            from_email=None,
            recipient_list=[recipient],
            fail_silently=True,
        )
