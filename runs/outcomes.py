"""A call's outcome decided and written: succeeded, a retry at its backoff, or dead
(someone is told), with the job's next run in the same transaction; and the rules
that read outcomes: retries held while a job is paused, pause_after_failures.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db import InterfaceError, OperationalError, transaction

from jobs import schedule
from jobs.models import Job
from runs import claims, delivery, events, notices, publishing
from runs.claims import Claim
from runs.delivery import CallResult
from runs.models import (
    ON_ROW_ANSWERED, ON_ROW_SUCCEEDED, OPEN_KEPT_FOR, Run,
    ended_newest_first,
)
from runs.nextrun import Flight, _held_jobs, job_next_runs, jobs_lock
from runs.signals import job_paused, run_dead


logger = logging.getLogger("scheduler.runs")
S = Run.Status


@dataclass
class Call:
    run: Run
    claim: Claim
    request: delivery.Request | None = None
    message: publishing.TaskMessage | None = None  # a task target's, instead of a request
    refusal: str = ""  # claimed, but must not be called: why
    result: CallResult | None = None


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
