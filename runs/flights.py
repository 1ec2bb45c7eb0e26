"""A call's flight: from the moment its run is claimed to the moment its outcome is written.

Each call lands on its own. When a call ends (an answer, an error, its timeout), its
outcome is written with whatever else has ended in this process meanwhile (one
transaction for those), never held for the slowest call of its batch: a run counts as
in flight (overlap `skip` and `buffer_one`, a retry's due time, `finished_at`,
`pause_after_failures`) until its own answer, not its neighbours'.

Two ways to land, one rule:

- The batch's own thread (a worker child, or a waiter thread) starts its calls on the
  process's call pool and writes the outcomes of those that end close together, one
  group a transaction, as they end.
- Detached (a Celery worker on PostgreSQL): once it has waited DETACH_AFTER with
  calls still in flight, it hands them to the process's writer thread, which writes
  their outcomes as they end, and goes back for its next message. A target that
  hangs holds a thread of the call pool for its timeout, never a worker child: the
  runs of other services keep being claimed and called. A direct call, an eager
  task, or the embedded SQLite file (whose one writer gains nothing from a second
  thread) waits for its last outcome.

While they fly, the process's beat thread keeps every call's lease (and its bulkhead
slot) alive, one thread for all of them. A share of the calls in flight per service
(`of_owner`, SCHEDULER_SERVICE_CALLS) lets the batch hold back one service's runs
while that service already has its share in flight here.

The database is the truth throughout: a process that dies loses only what it held,
and the leases bring those runs back, as before.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import InterfaceError, OperationalError, close_old_connections, connection

from runs import bulkhead, claims

logger = logging.getLogger("scheduler.runs")

# The store's own trouble (the connection went, a deadlock, a timeout): nothing of a
# group can be written; the writer tries again until the calls' leases would be gone.
STORE_TROUBLE = (OperationalError, InterfaceError)
LAND_AT_MOST = 200  # outcomes written in one transaction at most
IDLE_SECONDS = 60.0  # the writer and beat threads end after this long with nothing to do
STORE_RETRY_SECONDS = 1.0
# How long a worker child waits for its batch's calls before the process's writer
# takes the rest over (runs.services._Batch.finish).
DETACH_AFTER = 0.25
# The writer waits this long for more calls to end before it writes what has (a group,
# one transaction): at most LINGER_MOST after the first, so an outcome lands within
# about that of its answer.
LINGER_QUIET = 0.003
LINGER_MOST = 0.02


class Landed:
    """A batch's runs on their way to their outcomes: the caller that waits (inline)
    reads `outcomes` once `left` is 0."""

    def __init__(self, outcomes: dict[int, str], *, inline: bool) -> None:
        self.outcomes = outcomes
        self.inline = inline
        self.cond = threading.Condition()
        self.ended: deque[Flight] = deque()  # inline: ended, not yet written
        self.left = 0


@dataclass(eq=False)
class Flight:
    """One claimed run's call. `item` is what the land function writes from (runs.services'
    Call and Gate); `slot` its bulkhead slot, kept alive with the lease."""

    run_id: int
    owner: int | None
    claim: claims.Claim
    slot: bulkhead.Slot | None
    item: Any
    landed: Landed
    calling_since: float = 0.0  # time.monotonic() when its call started on a thread
    ended_at: float = 0.0  # time.monotonic() when its call ended
    lost: bool = False  # its lease was taken over: the beat no longer extends it


@dataclass
class Flights:
    """This process's flights. `land` writes a group's outcomes (one transaction) and
    returns each run's; `release` frees what a group held (its slots, its probes),
    whatever happened to the write; `lease` is the run lease's length."""

    land: Callable[[list[Flight]], dict[int, str]]
    release: Callable[[list[Flight]], None]
    lease: Callable[[], timedelta]
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _ended: deque[Flight] = field(default_factory=deque)  # detached: ended, not yet written
    _flying: dict[int, Flight] = field(default_factory=dict)  # by id(): every flight not yet landed
    _owners: Counter[int | None] = field(default_factory=Counter)
    _writer: threading.Thread | None = None
    _beater: threading.Thread | None = None

    # ---------------------------------------------------------------- the batch's side

    def of_owner(self, owner: int | None, *, longer_than: float = 0.0) -> int:
        """Calls of this service in flight in this process now, those in flight for
        more than `longer_than` seconds only."""
        with self._cond:
            if longer_than <= 0:
                return self._owners[owner]
            since = time.monotonic() - longer_than
            return sum(1 for f in self._flying.values()
                       if f.owner == owner and not f.ended_at and 0 < f.calling_since < since)

    def start(self, flights: list[Flight]) -> None:
        """Flights whose calls are about to start (or have ended already): kept alive
        until they land."""
        if not flights:
            return
        with self._cond:
            for flight in flights:
                self._flying[id(flight)] = flight
                self._owners[flight.owner] += 1
            for flight in flights:
                with flight.landed.cond:
                    flight.landed.left += 1
            if self._beater is None:
                self._beater = threading.Thread(target=self._beat, name="flights-beat", daemon=True)
                self._beater.start()

    def ended(self, flight: Flight) -> None:
        """Its call has ended (from whichever thread made it): on to its outcome."""
        flight.ended_at = time.monotonic()
        landed = flight.landed
        with landed.cond:
            if landed.inline:
                landed.ended.append(flight)
                if _worth_waking(len(landed.ended), landed.left):
                    landed.cond.notify_all()
                return
        self._to_writer([flight])

    def _to_writer(self, flights: list[Flight]) -> None:
        if not flights:
            return
        with self._cond:
            self._ended.extend(flights)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="flights-writer", daemon=True)
                self._writer.start()
            if _worth_waking(len(self._ended), len(self._flying), added=len(flights)):
                self._cond.notify_all()

    def land_ready(self, landed: Landed) -> None:
        """Inline: write the outcomes of the calls that have ended so far, without waiting."""
        while True:
            with landed.cond:
                group = _take(landed.ended)
            if not group:
                return
            self._land(group)

    def land_all(self, landed: Landed, detach_after: float | None = None,
                 backlog: Callable[[], int] = lambda: 0) -> None:
        """Write each outcome as its call ends (the calls ending close together in one
        group), until the batch's last has landed; or, with `detach_after`, until that
        many seconds have passed with calls still in flight: those are handed to the
        process's writer, and this returns (the worker child is free for its next
        message), unless calls of the process wait for a thread (`backlog`): then the
        child waits on, as the process's back-pressure. The store's own trouble goes up (the caller hands the batch back);
        what it had not written is given up here, its leases left to run out."""
        deadline = None if detach_after is None else time.monotonic() + detach_after
        try:
            while True:
                with landed.cond:
                    while not landed.ended and landed.left > 0:
                        wait = None if deadline is None else deadline - time.monotonic()
                        if wait is not None and wait <= 0 and backlog() > 0:
                            # Calls wait for a thread: the process is at its limit, and
                            # the child waits too (the back-pressure), a while more.
                            deadline = time.monotonic() + (detach_after or DETACH_AFTER)
                            continue
                        if wait is not None and wait <= 0:
                            # Slow calls: the writer lands them, the child goes on.
                            landed.inline = False
                            rest = list(landed.ended)
                            landed.ended.clear()
                            break
                        landed.cond.wait(wait)
                    else:
                        rest = None
                        if landed.left <= 0:
                            return
                        _linger(landed.cond, landed.ended, landed.left)
                        group = _take(landed.ended)
                if rest is not None:
                    self._to_writer(rest)
                    return
                self._land(group)
        except BaseException:
            self.abandon(landed)
            raise

    def abandon(self, which: Landed | list[Flight]) -> None:
        """Stop keeping flights alive, a batch's (its write failed on the store's trouble)
        or some (their calls will not be made): their outcomes are not written, their
        leases run out and the runs are claimed again."""
        with self._cond:
            if isinstance(which, Landed):
                gone = [f for f in self._flying.values() if f.landed is which]
            else:
                gone = [f for f in which if id(f) in self._flying]
        self._landed(gone, {})

    # ---------------------------------------------------------------- landing

    def _land(self, group: list[Flight]) -> None:
        try:
            outcomes = self.land(group)
        except STORE_TROUBLE:
            raise
        except Exception:  # noqa: BLE001 - runs.services isolates rows; anything else: leases run out
            logger.exception("%d outcomes could not be written; their leases will run out", len(group))
            outcomes = {f.run_id: "outcome_not_recorded" for f in group}
        self._landed(group, outcomes)

    def _landed(self, group: list[Flight], outcomes: dict[int, str]) -> None:
        with self._cond:
            self._forget(group)
        self._release(group)
        for flight in group:
            landed = flight.landed
            with landed.cond:
                landed.outcomes[flight.run_id] = outcomes.get(flight.run_id, "outcome_not_recorded")
                landed.left -= 1
                landed.cond.notify_all()

    def _forget(self, group: list[Flight]) -> None:
        for flight in group:
            if self._flying.pop(id(flight), None) is not None:
                self._owners[flight.owner] -= 1
                if self._owners[flight.owner] <= 0:
                    del self._owners[flight.owner]

    def _release(self, group: list[Flight]) -> None:
        if not group:
            return
        try:
            self.release(group)
        except Exception:  # noqa: BLE001 - slots and probes run out by themselves
            logger.warning("could not release what %d calls held", len(group), exc_info=True)

    def _write_loop(self) -> None:
        """Detached: the process's writer. Writes what has ended, a group at a time; on
        the store's trouble, tries again each second while the leases would still hold."""
        try:
            while True:
                with self._cond:
                    if not self._ended:
                        self._cond.wait(IDLE_SECONDS)
                    if not self._ended:
                        if not self._flying:
                            self._writer = None
                            return
                        continue
                    _linger(self._cond, self._ended, len(self._flying))
                    group = _take(self._ended)
                close_old_connections()
                try:
                    self._land(group)
                except STORE_TROUBLE:
                    logger.warning("writing %d outcomes failed on the store's trouble; trying again", len(group),
                                   exc_info=True)
                    connection.close()
                    self._again(group)
                    time.sleep(STORE_RETRY_SECONDS)
        finally:
            connection.close()

    def _again(self, group: list[Flight]) -> None:
        """A group the store could not take: back to the front, but for flights whose
        lease is surely gone by now (the next claim's outcome is theirs)."""
        horizon = self.lease().total_seconds()
        now = time.monotonic()
        keep = [f for f in group if now - f.ended_at < horizon]
        gone = [f for f in group if now - f.ended_at >= horizon]
        with self._cond:
            self._ended.extendleft(reversed(keep))
        if gone:
            logger.error("%d outcomes not written within their lease; their runs are claimed again", len(gone))
            self._landed(gone, {})

    # ---------------------------------------------------------------- the beat

    def _beat(self) -> None:
        """Every lease's third, each flight's lease and slot extended (the store's clock).
        A lease taken over is no longer extended: the call goes on, its outcome is refused."""
        interval = max(0.5, self.lease().total_seconds() / 3)
        try:
            while True:
                time.sleep(interval)  # not the condition: every call's end notifies it
                with self._cond:
                    flying = list(self._flying.values())
                    if not flying:
                        self._beater = None
                        return
                try:
                    self._beat_once(flying)
                except Exception:  # noqa: BLE001 - a dropped connection costs one beat, not the leases
                    logger.warning("the heartbeat of %d calls failed; trying again", len(flying), exc_info=True)
                    connection.close()
        finally:
            connection.close()

    def _beat_once(self, flying: list[Flight]) -> None:
        lease = self.lease()
        now = claims.store_now()
        for flight in flying:
            if not flight.lost and not claims.heartbeat(run_id=flight.run_id, fence=flight.claim.fence, lease=lease):
                flight.lost = True
        bulkhead.extend_many([f.slot for f in flying if f.slot is not None], now=now, lease=lease)

    # ---------------------------------------------------------------- tests, shutdown

    def in_flight(self) -> int:
        with self._cond:
            return len(self._flying)

    def drain(self, timeout: float) -> bool:
        """Wait, up to `timeout` seconds, for every flight to land (a worker child about
        to exit). True when they did."""
        deadline = time.monotonic() + timeout
        while self.in_flight():
            if time.monotonic() >= deadline:
                logger.warning("stopping with %d calls in flight; their runs are recovered from the store",
                               self.in_flight())
                return False
            time.sleep(0.05)
        return True


def _worth_waking(ended: int, flying: int, added: int = 1) -> bool:
    """Whether a call's end wakes the thread that lands (its batch's, or the writer):
    when it is the first to wait (the lander may be asleep for good), when a group is
    full, or when nothing else is in flight. Not at every end: the lander lingers in
    steps of LINGER_QUIET (_linger), and each wake-up takes the GIL from the threads
    making the calls."""
    return ended <= added or ended >= LAND_AT_MOST or ended >= flying


def _linger(cond: threading.Condition, ended: deque[Flight], flying: int) -> None:
    """Under `cond`, with at least one flight ended: wait a moment for the calls ending
    close together, so that they land in one transaction (a batch's calls to a quick
    host end within milliseconds of each other): until none has ended for LINGER_QUIET,
    at most LINGER_MOST after the first, and not at all when nothing else is in flight
    (`flying`: those not landed, the ended included) or a group is full. It is not
    woken at each end (_worth_waking): it looks every LINGER_QUIET."""
    started = time.monotonic()
    seen = len(ended)
    while seen < LAND_AT_MOST and seen < flying:
        left = LINGER_MOST - (time.monotonic() - started)
        if left <= 0:
            return
        cond.wait(min(LINGER_QUIET, left))
        if len(ended) == seen:
            return  # quiet: nothing more ended meanwhile
        seen = len(ended)


def _take(ended: deque[Flight]) -> list[Flight]:
    group = []
    while ended and len(group) < LAND_AT_MOST:
        group.append(ended.popleft())
    return group
