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
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.mail import send_mail
from django.db import DatabaseError, connection, transaction
from django.db.models import Max
from django.utils import timezone

from jobs import schedule
from jobs.models import Job
from jobs.validators import check_resolved_target, target_host
from runs import breakers, bulk, bulkhead, claims, delivery, events
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
    """Keeps the leases (and the bulkhead slots) of a batch's calls alive while they
    are in flight, from one thread of its own."""

    def __init__(self, claims_: list[Claim], lease: timedelta, slots: list[bulkhead.Slot]) -> None:
        self.claims, self.lease, self.slots = list(claims_), lease, list(slots)
        self.stopped = threading.Event()
        self.lost: set[int] = set()
        self.thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)

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
                    logger.warning("heartbeat for %d runs failed; trying again", len(self.claims), exc_info=True)
                    connection.close()
                if len(self.lost) == len(self.claims) and not self.slots:
                    return
        finally:
            connection.close()

    def _beat_once(self) -> None:
        now = timezone.now()
        for claim in self.claims:
            if claim.run_id in self.lost:
                continue
            if not claims.heartbeat(run_id=claim.run_id, fence=claim.fence, now=now, lease=self.lease):
                # Taken over: the call goes on, but its outcome will be refused.
                self.lost.add(claim.run_id)
        # A call still in flight to the host, taken over or not, holds its slot.
        self.slots = bulkhead.extend_many(self.slots, now=now, lease=self.lease)


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


def run_execute_many(*, run_ids: list[int], worker: str | None = None) -> dict[int, str]:
    """A batch of runs (one message from the scanner): admit, claim, call the
    targets side by side, record what happened. Returns each run's outcome.

    Admission (the target's breaker, then a bulkhead slot) comes before the claim,
    so a run that may not be called yet goes back to `scheduled` without its
    attempt or fence moving: waiting spends no try, and holds no worker. The
    claim, the outcomes and the next runs are each one statement for the whole
    batch; every write still names its run's fence.
    """
    worker = worker or default_worker_id()
    lease = lease_length()
    outcomes: dict[int, str] = {}
    now = timezone.now()
    found = {r.pk: r for r in Run.objects.select_related("job").filter(pk__in=run_ids)}
    candidates = []
    for run_id in dict.fromkeys(run_ids):
        run = found.get(run_id)
        if run is None or not claims.may_claim(run, now):
            outcomes[run_id] = "not_claimed"  # ended, held, or someone holds a live lease: drop it
        else:
            candidates.append(run)
    gates = _admit(candidates, worker, lease, now, outcomes)
    try:
        if gates:
            _claim_and_call([r for r in candidates if r.pk in gates], worker, lease, gates, outcomes)
    finally:
        _release(list(gates.values()))
    return outcomes


def _admit(runs: list[Run], worker: str, lease: timedelta, now: datetime, outcomes: dict[int, str]) -> dict[int, Gate]:
    """The breaker, then the bulkhead, per target host. Returns the runs let through."""
    by_host: dict[str, list[Run]] = {}
    for run in runs:
        by_host.setdefault(target_host(run.job.target), []).append(run)
    not_closed = breakers.not_closed(list(by_host))  # one read: usually nothing
    gates: dict[int, Gate] = {}
    for host, group in by_host.items():
        probes: set[int] = set()
        if host in not_closed:
            group, probes = _through_breaker(host, group, worker, lease, now, outcomes)
        holders = [f"{run.pk}/{worker}" for run in group]
        slots = {slot.holder: slot for slot in bulkhead.take_many(host=host, holders=holders, now=now, lease=lease)}
        for run, holder in zip(group, holders):
            slot = slots.get(holder)
            if slot is not None:
                gates[run.pk] = Gate(host=host, holder=holder, slot=slot, probe=run.pk in probes)
                continue
            if run.pk in probes:
                breakers.release_probe(host=host, holder=holder)
            outcomes[run.pk] = _defer(run, now, bulkhead.wait_until(now, host), "bulkhead_wait", host=host,
                                      limit=bulkhead.limit())
    return gates


def _through_breaker(
    host: str, group: list[Run], worker: str, lease: timedelta, now: datetime, outcomes: dict[int, str]
) -> tuple[list[Run], set[int]]:
    """A host whose breaker is open or half-open: the runs it lets through (the probe)."""
    passed, probes = [], set()
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
        outcomes[run.pk] = _defer(run, now, admission.hold_until, "held_by_breaker", host=host,
                                  state=admission.state, next_probe_at=probe_at)
    return passed, probes


def _defer(run: Run, now: datetime, due_at: datetime, reason: str, **detail: object) -> str:
    with transaction.atomic():
        if not claims.defer(run_id=run.pk, now=now, due_at=due_at):
            return "not_claimed"
        events.record(run.pk, reason, now, due_at=delivery.iso_z(due_at), **detail)
    return reason


@dataclass
class Call:
    run: Run
    claim: Claim
    request: delivery.Request | None = None
    refusal: str = ""  # claimed, but must not be called: why
    result: CallResult | None = None


def _claim_and_call(
    runs: list[Run], worker: str, lease: timedelta, gates: dict[int, Gate], outcomes: dict[int, str]
) -> None:
    with transaction.atomic():
        now = timezone.now()
        taken = claims.claim_many(run_ids=[r.pk for r in runs], worker=worker, now=now, lease=lease)
        events.record_many(
            events.event(c.run_id, "claimed", now, fence=c.fence, worker=worker, attempt=c.attempt) for c in taken
        )
    by_id = {c.run_id: c for c in taken}
    calls = []
    for run in runs:
        claim = by_id.get(run.pk)
        if claim is None:
            outcomes[run.pk] = "not_claimed"  # someone else holds it, or it is no longer queued
            continue
        run.fence, run.attempt = claim.fence, claim.attempt
        calls.append(Call(run=run, claim=claim))
    _prepare(calls)
    to_call = [c for c in calls if c.request is not None]
    with Heartbeat([c.claim for c in to_call], lease, [gates[c.run.pk].slot for c in to_call]):
        _call_all(to_call, {c.run.pk: gates[c.run.pk].host for c in to_call})
    failed_early = [c for c in calls if c.request is None and c.result is not None]  # e.g. a DNS failure
    for call in to_call + failed_early:
        gates[call.run.pk].called = True
    _tell_breakers(to_call + failed_early, gates)
    outcomes.update(run_record_outcomes(calls))


def _prepare(calls: list[Call]) -> None:
    """Checks after the claim (tries left, the target's address now), then the request.

    What goes wrong for one run costs that run only: a request that cannot be made
    (a header that cannot be sent, a secret that cannot be decrypted, any other
    exception) is a refusal with its reason; a name that does not resolve is a
    failed call (retried). A database error is the batch's, and goes up.
    """
    resolved: dict[str, _Resolved] = {}
    signers: dict[int, delivery.Signer | None] = {}
    for call in calls:
        try:
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


def _prepare_one(call: Call, resolved: dict[str, _Resolved], signers: dict[int, delivery.Signer | None]) -> None:
    job = call.run.job
    if call.claim.attempt - call.run.attempt_base > job.retry_max + 1:
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
QUICK_MS = 20.0  # a host this quick is called in turn: a thread hand-off costs more than it saves
IN_TURN_FOR = 0.1  # seconds: the longest a batch calls in turn before the rest go side by side


def _call_all(calls: list[Call], hosts: dict[int, str]) -> None:
    """The batch's calls: side by side on the worker process's call pool; or, for
    a host that has been answering within QUICK_MS, one after another on this
    thread, for at most IN_TURN_FOR seconds (or until one is slow), and the rest
    side by side."""
    rest = list(calls)
    started = time.monotonic()
    while rest and (
        len(rest) == 1
        or (_recent_ms.get(hosts[rest[0].run.pk], 1e9) <= QUICK_MS and time.monotonic() - started < IN_TURN_FOR)
    ):
        call = rest.pop(0)
        call.result = _call_one(call)
        _note_duration(hosts[call.run.pk], call.result)
    futures = [delivery.call_pool().submit(_call_one, c) for c in rest]
    for call, future in zip(rest, futures):
        call.result = future.result()
        _note_duration(hosts[call.run.pk], call.result)


def _call_one(call: Call) -> CallResult:
    """The call, whatever raises inside it: an exception is a failed call (tried
    again), never one that takes the batch's other outcomes with it."""
    assert call.request is not None
    try:
        return delivery.call(call.request, timeout_seconds=call.run.job.timeout_seconds)
    except Exception as exc:
        logger.warning("run %s: its call raised %s", call.run.public_id, type(exc).__name__)
        return CallResult(error=delivery.REQUEST_FAILED)


def _note_duration(host: str, result: CallResult) -> None:
    before = _recent_ms.get(host)
    took = float(result.duration_ms) if result.status is not None else 1e6
    _recent_ms[host] = took if before is None else 0.8 * before + 0.2 * took


def _tell_breakers(calls: list[Call], gates: dict[int, Gate]) -> None:
    """Each host's calls, in order, on its breaker: a write only when something changes."""
    by_host: dict[str, list[Call]] = {}
    for call in calls:
        by_host.setdefault(gates[call.run.pk].host, []).append(call)
    now = timezone.now()
    for host, group in by_host.items():
        try:
            breakers.record_many(
                host=host,
                found=[(gates[c.run.pk].holder, c.result.retryable, c.result.describe()) for c in group if c.result],
                now=now,
            )
        except Exception:  # the breaker is advice; the outcomes must still be recorded
            logger.warning("could not record the calls' results on %s's breaker", host, exc_info=True)


def _signer_for(job: Job) -> delivery.Signer | None:
    from runs.signing import signer_for_owner

    return signer_for_owner(job.owner_id)


def _answered_event(run: Run, claim: Claim, result: CallResult, now: datetime) -> events.Event:
    answer = {"status": result.status} if result.status is not None else {"error": result.error}
    return events.event(run.pk, "target_answered", now, fence=claim.fence, duration_ms=result.duration_ms, **answer)


def _decide(call: Call, now: datetime) -> tuple[claims.Outcome, str]:
    """The outcome a finished call asks for, and the dead reason if it is one."""
    run, job, claim, result = call.run, call.run.job, call.claim, call.result
    if call.refusal:
        return claims.Outcome(run.pk, claim.fence, S.DEAD, now, error=call.refusal), call.refusal
    assert result is not None
    if result.ok:
        return claims.Outcome(run.pk, claim.fence, S.SUCCEEDED, now), ""
    tries = claim.attempt - run.attempt_base  # calls in this round (a requeue starts a new one)
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


def run_record_outcomes(calls: list[Call]) -> dict[int, str]:
    """One transaction for a batch: each outcome under its fence, the events, and
    the next run of every run that ended (or the retry, as a row). An ended run's
    `succeeded` or `dead` event names its job's next run (`next_run`)."""
    if not calls:
        return {}
    now = timezone.now()
    decided = [(call, *_decide(call, now)) for call in calls]
    with transaction.atomic():
        landed = claims.record_outcomes([outcome for _, outcome, _ in decided])
        ended = [c.run for c, o, _ in decided if c.run.pk in landed and o.status != S.SCHEDULED]
        found, following = _next_runs([r for r in ended if not r.is_backfill], now)
        outcomes: dict[int, str] = {}
        for call, outcome, reason in decided:
            run, claim = call.run, call.claim
            if call.result is not None:
                found.append(_answered_event(run, claim, call.result, now))
            nxt = following.get(run.pk)
            then = {"next_run": nxt.public_id, "next_scheduled_for": delivery.iso_z(nxt.scheduled_for)} if nxt else {}
            if run.pk not in landed:
                # The lease was taken over: the store refuses this holder's outcome.
                found.append(events.event(run.pk, "stale_write_rejected", now, fence=claim.fence, worker=claim.worker))
                logger.warning("run %s: stale write from fence %s refused", run.public_id, claim.fence)
                outcomes[run.pk] = "stale_write_rejected"
            elif outcome.status == S.SUCCEEDED:
                found.append(events.event(run.pk, "succeeded", now, fence=claim.fence, **then))
                outcomes[run.pk] = "succeeded"
            elif outcome.status == S.SCHEDULED:
                found.append(events.event(run.pk, "retry_scheduled", now, due_at=delivery.iso_z(outcome.due_at),
                                          fence=claim.fence))
                outcomes[run.pk] = "retry_scheduled"
            else:
                recipient = run.job.notify or run.job.owner.email
                found.append(events.event(run.pk, "dead", now, reason=reason, notified=recipient, fence=claim.fence,
                                          **then))
                outcomes[run.pk] = "dead"
                transaction.on_commit(lambda pk=run.pk, why=reason: notify_dead(run_id=pk, reason=why))
        events.record_many(found)
    return outcomes


def _next_runs(ended: list[Run], now: datetime) -> tuple[list[events.Event], dict[int, Run]]:
    """The next run of each job whose run ended, created together (backfills are
    extra runs: the job's own timetable goes on without them). Returns each new
    run's `scheduled` event, and the new run by the ended run's id."""
    jobs = {run.job_id: run.job for run in ended if run.job.state != Job.State.DELETED}
    one_offs = [pk for pk, job in jobs.items() if not job.is_recurring]
    if one_offs:
        Job.objects.filter(pk__in=one_offs).exclude(state=Job.State.DELETED).update(
            state=Job.State.COMPLETED, updated_at=now
        )
    recurring = {pk: job for pk, job in jobs.items() if job.is_recurring}
    if not recurring:
        return [], {}
    latest = dict(
        Run.objects.filter(job_id__in=list(recurring), is_backfill=False)
        .values("job_id")
        .annotate(t=Max("scheduled_for"))
        .values_list("job_id", "t")
    )
    paused_hosts = paused_target_hosts({target_host(job.target) for job in recurring.values()})
    rows = []
    for pk, job in recurring.items():
        when = schedule.next_cron_time(job.schedule, job.timezone, latest.get(pk) or now)
        rows.append(
            Run(
                job=job,
                scheduled_for=when,
                due_at=schedule.spread_due_at(pk, when, timedelta(seconds=job.window_seconds)),
                partition=job.partition,
                held=job.paused or target_host(job.target) in paused_hosts,
            )
        )
    created = bulk.insert_open_runs(rows)
    new_by_job = {r.job_id: r for r in created}
    found = [
        events.event(r.pk, "scheduled", now, scheduled_for=delivery.iso_z(r.scheduled_for), due_at=delivery.iso_z(r.due_at))
        for r in created
    ]
    return found, {run.pk: new_by_job[run.job_id] for run in ended if run.job_id in new_by_job}


def paused_target_hosts(hosts: set[str]) -> set[str]:
    from runs.models import PausedTarget

    return set(PausedTarget.objects.filter(host__in=list(hosts)).values_list("host", flat=True)) if hosts else set()


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
