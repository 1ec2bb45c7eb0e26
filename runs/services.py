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
from contextlib import nullcontext
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

from django.conf import settings
from django.db import transaction

from jobs.models import Job
from jobs.validators import target_key
from runs import breakers, bulkhead, claims, delivery, events, flights, publishing, rollups
from runs.claims import Claim
from runs.delivery import CallResult, _PerProcess
from runs.models import (
    OPEN_KEPT_FOR, Run,
)
from runs.nextrun import job_next_runs, jobs_lock
from runs.outcomes import _STORE_TROUBLE, Call, run_record_outcomes
from runs.prepare import _prepare

logger = logging.getLogger("scheduler.runs")
S = Run.Status


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


def lease_length() -> timedelta:
    return timedelta(seconds=settings.SCHEDULER_LEASE_SECONDS)


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


# How long recent calls to each host took (ms, a moving average, this process).
_recent_ms: dict[str, float] = {}
QUICK_MS = 20.0  # a host this quick is called in turn: hundreds of calls side by side cost more than they save
IN_TURN_FOR = 0.1  # seconds: the longest a batch calls in turn before the rest go side by side
IN_TURN_WAIT = 0.05  # seconds between the batch's looks at its calls in turn: none ended, the rest go side by side


def _start_calls(flying: list[flights.Flight]) -> None:
    """The calls of a wave, each on the worker process's call pool and handed on
    (runs.flights) as soon as it has ended; a call refused, or failed before it was
    made, has ended already. To a host that has been answering within QUICK_MS the
    calls go one after another, on one pool thread (_InTurn), the batch looking every
    IN_TURN_WAIT: when no call has ended meanwhile, or IN_TURN_FOR has passed, the ones
    not yet made go side by side. So the batch's thread never waits long on a target, however
    slow (one quick answer says nothing of the next endpoint), and no outcome waits for
    a call made after it."""
    pool = process_flights()
    rest = []
    for flight in flying:
        call = flight.item[0]
        if call.request is None and call.message is None:
            pool.ended(flight)
        else:
            rest.append(flight)
    quick = [f for f in rest if _recent_ms.get(f.item[1].host, 1e9) <= QUICK_MS]
    if len(quick) > 1:
        rest = [f for f in rest if _recent_ms.get(f.item[1].host, 1e9) > QUICK_MS]
        rest += _InTurn(quick).call()
    for flight in rest:
        _submit(flight)


class _InTurn:
    """Calls made one after another on one thread of the call pool, not each handed to
    a thread and waited for (two thread wake-ups a call). `call` watches them from the
    batch's thread and returns those it took back, not made yet, to go side by side."""

    def __init__(self, todo: list[flights.Flight]) -> None:
        self.todo = deque(todo)
        self.ended = 0
        self.cond = threading.Condition()

    def call(self) -> list[flights.Flight]:
        delivery.call_pool().submit(self._run)
        stop = time.monotonic() + IN_TURN_FOR
        with self.cond:
            seen = self.ended
            while self.todo:
                left = stop - time.monotonic()
                if left <= 0:
                    break  # long enough: what is not made yet goes side by side
                self.cond.wait(min(IN_TURN_WAIT, left))  # woken early only once every call is taken
                if self.todo and self.ended == seen:
                    break  # no call ended meanwhile: slow after all
                seen = self.ended
            taken = list(self.todo)
            self.todo.clear()
        return taken

    def _run(self) -> None:
        while True:
            with self.cond:
                if not self.todo:
                    return
                flight = self.todo.popleft()
                if not self.todo:
                    self.cond.notify_all()  # the batch's thread goes on to land them
            try:
                result = _calling(flight)
            except BaseException:  # noqa: BLE001 - _call_one returns failures; anything else is one too
                result = CallResult(error=delivery.REQUEST_FAILED)
            _call_done(flight, result)
            with self.cond:
                self.ended += 1


def _submit(flight: flights.Flight) -> Future[CallResult]:
    future = delivery.call_pool().submit(_calling, flight)
    future.add_done_callback(lambda done, flight=flight: _call_ended(flight, done))
    return future


def _calling(flight: flights.Flight) -> CallResult:
    flight.calling_since = time.monotonic()  # on a thread now: the service share counts from here
    return _call_one(flight.item[0])


def _call_ended(flight: flights.Flight, future: Future[CallResult]) -> None:
    """A call on the pool has ended (on the pool's thread): on to its outcome."""
    try:
        result = future.result()
    except BaseException:  # noqa: BLE001 - _call_one returns failures; anything else is one too
        result = CallResult(error=delivery.REQUEST_FAILED)
    _call_done(flight, result)


def _call_done(flight: flights.Flight, result: CallResult) -> None:
    """A call's result kept, its host's pace noted, and its flight on to its outcome."""
    flight.item[0].result = result
    _note_duration(flight.item[1].host, result)
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


