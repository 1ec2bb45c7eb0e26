"""The scanner's bounded reads against a small reference model (PostgreSQL).

Since migration runs 0017 one index orders waiting runs and runs in flight together,
and the scanner's reads stop early on both sides so as not to walk each other:

- the reads of waiting runs (the due read, the probe's due part) start in each partition
  after the last run a scan took there (the floors), lowered to the due time of each run
  that turns waiting (the scanners' notification names it, migration runs 0018), and
  dropped when notifications may have been lost;
- the reads of runs in flight (the probe's lease, queued and count parts, lease
  recovery, the republish) stop at each partition's ceiling (wakeups.Ceilings): read as
  it is when not known or every CEILINGS_READ_EVERY, raised by each scan over the runs
  it takes.

A hypothesis state machine drives the real scan and probe (scan_once, next_work, with
the scanner command's handling of floors and ceilings: Command._lower_floors, Ceilings)
and the real claim on real PostgreSQL, with the writes that move a run the other ways: a
run made waiting again at an earlier due time (a deferral, a retry, a pause and resume:
behind a floor), a lease that ran out, a run that ends, and a run queued by another
scanner (one that held the partition before and has not yet seen its lease lost: past a
ceiling). The notifications are the test's (what the triggers send for each write that
makes a run waiting; inside the test's transaction none is delivered): the test after
this one has the triggers and the listener for real. The model is the state of each
run. What must hold:

- every write of the scan is one the model allows (a waiting run due by the horizon
  queued, an expired lease released), and the store agrees with the model after each;
- each scan queues every waiting run due, however far its floors had moved, but for
  the runs of a service that holds its share of the queue (SCHEDULER_SERVICE_QUEUED,
  one here, among two services): a scan steps over those from its share floors
  (scanners.shares.ShareFloors), which are lowered and dropped with the floors;
- each read of runs in flight finds what an unbounded read finds (the earliest lease
  end, the oldest queued run, the count of queued runs), and a scan releases every
  ended lease, except for runs another scanner queued since the ceilings were last
  read as they are: those are found at that read.
"""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models import Count, Max, Min
from django.test import override_settings
from hypothesis import HealthCheck, event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from jobs.models import Job
from runs import claims
from runs.models import Run
from scanners import shares
from scanners.management.commands.scanner import Command
from scanners.probe import next_work
from scanners.scan import scan_once
from scanners.shares import ShareFloors
from scanners.wakeups import CEILINGS_READ_EVERY, Ceilings, Listener
from jobs.services import service_account_ensure
from tests.factories import expire_lease, make_job, make_run

S = Run.Status

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the bounded reads are PostgreSQL's"),
]

PARTS = [2, 5, 11]
WAITING, QUEUED, RUNNING, ENDED = "waiting", "queued", "running", "ended"
LOOKAHEAD = 1.0
SHARE = 1  # runs of one service queued at once (SCHEDULER_SERVICE_QUEUED)


class BoundedReads(RuleBasedStateMachine):
    shared_out_scans = 0  # scans, in all examples, that left a service's due runs for its share

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[int, str] = {}
        self.expired: set[int] = set()  # running runs whose lease has run out
        self.floors: dict[int, tuple[datetime, int]] = {}
        self.tick = 0.0
        self.ceilings = Ceilings(clock=lambda: self.tick)
        self.foreign = False  # a run queued by another scanner since the ceilings were read as they are
        self.made = 0
        # The scanner command's floor handling, with the test's notifications.
        self.notified: dict[int, datetime] = {}
        self.lost = False
        self.command = Command.__new__(Command)
        self.command.listener = self
        self.command.floors = self.floors
        self.command.share_floors = ShareFloors()
        self.owners = [service_account_ensure(name=name)[0] for name in ("alpha", "beta")]
        # Both services have jobs from the start: the scans share out (shares.several_services).
        for owner in self.owners:
            make_job(owner, name=f"{owner.username}'s first")
        shares.forget_services()
        self.owner_of: dict[int, int] = {}  # run id: its job's owner id

    def take_lowered(self) -> tuple[bool, dict[int, datetime]]:
        """The Listener's side of the scanner command's _lower_floors."""
        taken = (self.lost, self.notified)
        self.lost, self.notified = False, {}
        return taken

    def _notify(self, run: Run) -> None:
        """What the triggers send for a run that turned waiting, due within the horizon."""
        if run.due_at < claims.store_now() + timedelta(seconds=60):
            self.notified[run.partition] = min(run.due_at, self.notified.get(run.partition, run.due_at))

    def _turn(self, full: bool) -> None:
        """The start of the scanner command's turn: its floors as _lower_floors leaves them."""
        self.command.floors, self.command.floors_dropped_at = self.floors, float("inf")
        self.command._lower_floors(full)
        self.floors = self.command.floors

    def teardown(self) -> None:
        Run.objects.all().delete()
        Job.objects.all().delete()

    def _in(self, state: str) -> list[int]:
        return sorted(pk for pk, s in self.state.items() if s == state)

    # ------------------------------------------------------------------ writes
    @precondition(lambda self: self.made < 30)
    @rule(part=st.sampled_from(PARTS), offset=st.integers(min_value=-30, max_value=3), same=st.booleans(),
          owner=st.sampled_from([0, 1]))
    def add(self, part: int, offset: int, same: bool, owner: int) -> None:
        """A waiting run of one of two services, due up to 30 s ago or a little after the
        look-ahead; `same`: due at the same time as the partition's last run (a spike's
        runs share one)."""
        now = claims.store_now()
        last = Run.objects.filter(partition=part, pk__in=list(self.state)).order_by("-pk").first()
        due = last.due_at if same and last is not None else now + timedelta(seconds=offset)
        self.made += 1
        run = make_run(make_job(self.owners[owner], name=f"job {self.made}"), due, partition=part)
        self.state[run.pk] = WAITING
        self.owner_of[run.pk] = self.owners[owner].pk
        self._notify(run)

    @precondition(lambda self: any(s in (QUEUED, RUNNING) for s in self.state.values()))
    @rule(data=st.data(), back=st.integers(min_value=1, max_value=60))
    def made_waiting_again(self, data: st.DataObject, back: int) -> None:
        """Queued or running, made waiting again at an earlier due time: behind the floor."""
        pk = data.draw(st.sampled_from(self._in(QUEUED) + self._in(RUNNING)))
        run = Run.objects.get(pk=pk)
        Run.objects.filter(pk=pk).update(status=S.SCHEDULED, due_at=run.due_at - timedelta(seconds=back),
                                         queued_at=None, lease_owner="", lease_expires_at=None)
        self.state[pk] = WAITING
        self.expired.discard(pk)
        self._notify(Run.objects.get(pk=pk))

    @precondition(lambda self: bool([pk for pk in self.state if self.state[pk] == QUEUED]))
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        pk = data.draw(st.sampled_from(self._in(QUEUED)))
        if claims.claim_many(run_ids=[pk], worker="w1", lease=timedelta(minutes=5)):
            self.state[pk] = RUNNING
        else:  # not due yet by the store's clock: the worker waits for it
            assert Run.objects.get(pk=pk).due_at > claims.store_now() - timedelta(seconds=1)

    @precondition(lambda self: bool([pk for pk in self.state if self.state[pk] == RUNNING]))
    @rule(data=st.data())
    def lease_runs_out(self, data: st.DataObject) -> None:
        pk = data.draw(st.sampled_from(self._in(RUNNING)))
        expire_lease(pk)
        self.expired.add(pk)

    @precondition(lambda self: bool([pk for pk in self.state if self.state[pk] == RUNNING]))
    @rule(data=st.data())
    def ends(self, data: st.DataObject) -> None:
        pk = data.draw(st.sampled_from(self._in(RUNNING)))
        Run.objects.filter(pk=pk).update(status=S.SUCCEEDED, finished_at=claims.store_now())
        self.state[pk] = ENDED
        self.expired.discard(pk)

    @precondition(lambda self: bool([pk for pk in self.state if self.state[pk] == WAITING]))
    @rule(data=st.data())
    def another_scanner_queues(self, data: st.DataObject) -> None:
        """A run queued by another scanner: due by its horizon, like any it queues."""
        soon = claims.store_now() + timedelta(seconds=LOOKAHEAD)
        pk = data.draw(st.sampled_from(self._in(WAITING)))
        if Run.objects.get(pk=pk).due_at > soon:
            return
        claims.mark_queued(run_ids=[pk], now=claims.store_now())
        self.state[pk] = QUEUED
        self.foreign = True

    # ------------------------------------------------------------------ the scanner
    @rule()
    def partitions_change_hands(self) -> None:
        """What the scanner command does when its partitions change, or a turn fails."""
        self.floors = {}
        self.command.share_floors.clear()
        self.ceilings.forget()

    @rule()
    def notifications_lost(self) -> None:
        """The listen connection was lost and is back: the floors go."""
        self.lost = True

    @rule(seconds=st.sampled_from([0.5, CEILINGS_READ_EVERY]))
    def time_passes(self, seconds: float) -> None:
        self.tick += seconds

    @rule()
    def read_runs_in_flight(self) -> None:
        """The probe as the scanner command asks it when it reads the runs in flight."""
        self._turn(full=True)
        exact = self.ceilings.due()
        work = next_work(PARTS, in_flight=True, floors=self.floors,
                         ceilings=None if exact else self.ceilings.for_scan(), read_ceilings=exact)
        if exact:
            assert work.ceilings is not None and set(work.ceilings) == set(PARTS)
            self.ceilings.read(work.ceilings)
            self.foreign = False
        else:
            assert work.ceilings is None
        waiting = Run.objects.filter(pk__in=self._in(WAITING))
        assert work.due == waiting.aggregate(t=Min("due_at"))["t"]
        if not self.foreign:
            queued = Run.objects.filter(pk__in=self._in(QUEUED)).aggregate(t=Min("queued_at"), n=Count("id"))
            running = Run.objects.filter(pk__in=self._in(RUNNING)).aggregate(t=Min("lease_expires_at"))
            assert (work.queued, work.queued_count, work.lease) == (queued["t"], queued["n"], running["t"])
        if exact:
            # Each partition's ceiling is its last run in flight, or none.
            for part in PARTS:
                top = Run.objects.filter(pk__in=self._in(QUEUED) + self._in(RUNNING), partition=part).aggregate(
                    at=Max("due_at"))["at"]
                assert (work.ceilings[part][0] == top) if top else work.ceilings[part] == claims.NONE_IN_FLIGHT

    @rule()
    def scan(self) -> None:
        self._turn(full=False)
        now = claims.store_now()
        expired = set(self.expired)
        bounded = not self.foreign and self.ceilings.for_scan() is not None
        result = scan_once(partitions=PARTS, now=now, publish=False, floors=self.floors,
                           ceilings=self.ceilings.for_scan(), share_floors=self.command.share_floors)
        horizon = now + timedelta(seconds=LOOKAHEAD)
        for pk in result.queued:
            assert self.state[pk] == WAITING
            assert Run.objects.get(pk=pk).due_at <= horizon
            self.state[pk] = QUEUED
        for pk in result.lease_expired:
            assert self.state[pk] == RUNNING and pk in self.expired
            self.state[pk] = QUEUED
            self.expired.discard(pk)
        assert not result.set_aside and not result.skipped
        left = Run.objects.filter(pk__in=self._in(WAITING), due_at__lte=now).values_list("pk", flat=True)
        queued_of = {owner: sum(1 for pk in self._in(QUEUED) if self.owner_of[pk] == owner)
                     for owner in self.owner_of.values()}
        for pk in left:
            assert queued_of[self.owner_of[pk]] >= SHARE, "a due run of a service under its share was left waiting"
        if left:
            event("a scan left a service's due runs for its share")
            BoundedReads.shared_out_scans += 1
        if bounded:  # a batch of them a scan, the earliest ended first
            assert len(result.lease_expired) == min(3, len(expired)), "a lease that ran out was not released"

    @invariant()
    def the_store_agrees(self) -> None:
        if not self.state:
            return
        rows = dict(Run.objects.filter(pk__in=list(self.state)).values_list("pk", "status"))
        of = {S.SCHEDULED: WAITING, S.QUEUED: QUEUED, S.RUNNING: RUNNING, S.SUCCEEDED: ENDED}
        assert {pk: of[status] for pk, status in rows.items()} == self.state


def test_the_scanners_bounded_reads_miss_no_run() -> None:
    # Misfire: a run up to a minute late is not late here (only the reads are tested);
    # three runs a batch, so a scan takes several batches and moves its floors between.
    with override_settings(SCHEDULER_LOOKAHEAD=LOOKAHEAD, SCHEDULER_SCAN_BATCH=3, SCHEDULER_MAX_QUEUED=10_000,
                           SCHEDULER_MISFIRE_GRACE=600, SCHEDULER_SERVICE_QUEUED=SHARE):
        BoundedReads.shared_out_scans = 0
        run_state_machine_as_test(BoundedReads, settings=settings(
            max_examples=100, stateful_step_count=40, deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    print(f"scans that left a service's due runs for its share: {BoundedReads.shared_out_scans}")
    assert BoundedReads.shared_out_scans >= 15, "the share rule was hardly drawn"


def test_a_read_bounded_by_the_ceilings_does_not_read_the_waiting_backlog() -> None:
    """The reason for the ceilings: 2,000 waiting runs due, 20 in flight below them. The
    probe's read of runs in flight under the ceilings reads a few dozen buffers of
    runs_open; without them (the bound of the clock alone) it reads the backlog."""
    now = claims.store_now()
    for i in range(2_020):
        make_run(make_job(name=f"backlog {i}"), now - timedelta(seconds=60) + timedelta(milliseconds=i), partition=5)
    first = list(Run.objects.filter(partition=5).order_by("due_at", "id").values_list("pk", flat=True)[:20])
    claims.mark_queued(run_ids=first, now=now)
    ceilings = Ceilings(clock=lambda: 0.0)
    work = next_work([5], in_flight=True, read_ceilings=True)
    ceilings.read(work.ceilings)
    last = Run.objects.get(pk=first[-1])
    assert ceilings.known == {5: (last.due_at, last.pk)}
    from scanners.probe import NEXT_WORK_SQL, next_work_params

    def removed(bounded: bool) -> int:
        params = next_work_params([5], in_flight=True, notices=False,
                                  ceilings=ceilings.for_scan() if bounded else None)
        with connection.cursor() as cursor:
            # As the scanner's own sessions plan (scanners.probe.SCANNER_SESSION_OPTIONS).
            cursor.execute("SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off")
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + NEXT_WORK_SQL, params)
            plan = cursor.fetchone()[0]
        plan = plan if isinstance(plan, list) else __import__("json").loads(plan)
        found: list[int] = []

        def walk(node: dict[str, Any]) -> None:  # rows of runs_open read and let go by the filter
            if node.get("Relation Name") == "runs_open":
                found.append(int(node.get("Rows Removed by Filter", 0)) * int(node.get("Actual Loops", 1)))
            for child in node.get("Plans", []):
                walk(child)

        walk(plan[0]["Plan"])
        return sum(found)

    # Bounded, a part lets go of at most the 20 runs in flight (the lease part of the
    # queued ones, the due part of all of them: 40 here); unbounded, each of the three
    # parts on runs in flight also reads the 2,000 waiting ones. (Rows, not buffers: the
    # dead entries other tests left in the partition cost both reads alike.)
    bounded, unbounded = removed(True), removed(False)
    assert bounded <= 3 * 20 and unbounded >= 3 * 2_000, (bounded, unbounded)
    assert next_work([5], in_flight=True, ceilings=ceilings.for_scan()).queued_count == 20


def _lowered(listener: Listener, wait: float = 5.0) -> tuple[bool, dict[int, datetime]]:
    """What the listener has for the scanner, waiting for a notification to arrive."""
    deadline = time.monotonic() + wait
    while True:
        unknown, lowered = listener.take_lowered()
        if unknown or lowered or time.monotonic() > deadline:
            return unknown, lowered
        time.sleep(0.02)


@pytest.mark.django_db(transaction=True)
def test_a_run_that_turns_waiting_behind_the_floor_is_notified_with_its_due_time_and_the_floor_goes_down_to_it(
) -> None:
    """The triggers (migration runs 0018) and the scanner's listener for real: a run due now
    (run now) and a run in flight made waiting at an earlier time (a deferral) each
    notify their due time, and the scanner command lowers its floor to it, so that the
    next scan queues them. Before 0018 the notification had the partition alone, and
    such a run waited for the floors to be dropped."""
    woken = threading.Event()
    listener = Listener.for_scanner("floors", woken.set)
    assert listener is not None
    try:
        listener.partitions = frozenset([3])
        assert listener.listening.wait(10)
        assert listener.take_lowered() == (True, {})  # what was written before it listened: unknown
        command = Command.__new__(Command)
        command.listener, command.floors, command.floors_dropped_at = listener, {}, time.monotonic()
        command.share_floors = ShareFloors()
        now = claims.store_now()
        first = make_run(make_job(name="first"), now - timedelta(seconds=1), partition=3)
        assert _lowered(listener) == (False, {3: first.due_at})
        assert scan_once(partitions=[3], now=now, publish=False, floors=command.floors).queued == [first.pk]
        assert command.floors == {3: (first.due_at, first.pk)}

        behind = make_run(make_job(name="run now"), now - timedelta(seconds=5), partition=3)
        assert _lowered(listener) == (False, {3: behind.due_at})
        listener._lower(3, behind.due_at)  # as it was notified, for the command's own take
        command._lower_floors(full=False)
        assert command.floors == {3: (behind.due_at, 0)}
        assert scan_once(partitions=[3], now=now, publish=False, floors=command.floors).queued == [behind.pk]

        # A run in flight made waiting at an earlier due time: the update's notification.
        earlier = first.due_at - timedelta(seconds=30)
        Run.objects.filter(pk=first.pk).update(status=S.SCHEDULED, due_at=earlier, queued_at=None)
        assert _lowered(listener) == (False, {3: earlier})
        listener._lower(3, earlier)
        command._lower_floors(full=False)
        assert scan_once(partitions=[3], now=now, publish=False, floors=command.floors).queued == [first.pk]
        # Another partition's notification wakes nobody and lowers nothing.
        make_run(make_job(name="elsewhere"), now, partition=4)
        assert _lowered(listener, wait=0.5) == (False, {})
    finally:
        listener.stop()


def test_a_run_notified_behind_the_share_floors_is_read_by_the_next_scan_that_steps_over_a_service() -> None:
    """Alpha holds its share of the queue (one run here), so scans step over its due runs
    and read beta's from the share floors, which the read before moved to its horizon.
    A run of beta's that turns waiting behind them (due a while ago: run now, a retry)
    is notified, the share floors go down to it with the floors, and the next scan
    queues it; alpha's waiting run stays for its share."""
    alpha, _ = service_account_ensure(name="alpha")
    beta, _ = service_account_ensure(name="beta")
    command = Command.__new__(Command)
    notified: dict[int, datetime] = {}
    command.listener = type("Notified", (), {"take_lowered": lambda self: (False, notified.copy())})()
    command.floors, command.floors_dropped_at, command.share_floors = {}, float("inf"), ShareFloors()
    now = claims.store_now()

    def scan() -> list[int]:
        command._lower_floors(False)
        notified.clear()
        return scan_once(partitions=[5], now=claims.store_now(), publish=False, floors=command.floors,
                         share_floors=command.share_floors).queued

    make_job(beta, name="b0")  # two services with jobs: the scans share out (shares.several_services)
    with override_settings(SCHEDULER_SERVICE_QUEUED=1, SCHEDULER_MAX_QUEUED=100, SCHEDULER_LOOKAHEAD=1.0):
        first = make_run(make_job(alpha, name="a1"), now - timedelta(seconds=20), partition=5)
        second = make_run(make_job(alpha, name="a2"), now - timedelta(seconds=19), partition=5)
        assert scan() == [first.pk, second.pk]  # no share held before the scan: it counts from none
        third = make_run(make_job(alpha, name="a3"), now - timedelta(seconds=18), partition=5)
        assert scan() == []  # alpha holds its share: stepped over, the share floor at the horizon
        assert command.share_floors.at[5][0] > now
        late = make_run(make_job(beta, name="b1"), now - timedelta(seconds=30), partition=5)
        notified[5] = late.due_at  # what the trigger sends (the test's transaction delivers none)
        assert scan() == [late.pk]
        assert Run.objects.get(pk=third.pk).status == S.SCHEDULED
