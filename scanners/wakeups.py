"""When a scanner wakes: the probe's answer (scanners.probe.next_work) turned into a
sleep, and the LISTEN connection that wakes it sooner.

A scanner sleeps until the earliest work in its partitions comes due (less the
look-ahead for due runs), at most SCHEDULER_SCAN_INTERVAL. Work written meanwhile
that is due sooner wakes it: a trigger on runs, notices and jobs (the migrations
runs 0011) sends `NOTIFY scheduler_due, '<partition>'` ('0' for a
notice, '*' for a resume time), and the `Listener` thread, LISTENing on a
connection of its own, wakes the scanner owning that partition, which probes (one
statement) and scans only if something is due. Notifications are hints: one lost
(the listen connection down, a notice sent while it reconnects) costs at most a
scan interval, the longest a scanner sleeps.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from scanners.probe import Work
from scanners.scan import ScanResult

logger = logging.getLogger("scheduler.scanner")

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)  # the notified due times count from it
CHANNEL = "scheduler_due"  # the triggers' channel (migration runs 0011)
# The triggers notify work due within this of the writing statement's clock; work
# due later is found by a scanner's own wake, which is never further apart than
# LONGEST_SLEEP. Half the horizon: a writing transaction may take up to the other
# half before it commits and the run becomes visible.
NOTIFY_HORIZON = timedelta(seconds=60)
LONGEST_SLEEP = NOTIFY_HORIZON.total_seconds() / 2
# Scans that did not fill a batch are at least this far apart (or half the
# look-ahead, when that is longer): under a steady stream of due runs the scanner
# takes them in small batches, not one scan per due_at.
SCAN_GAP = 0.02
NOTICE_CHECK_SECONDS = 5.0  # the notice sender is published at most this often
RETRY_AFTER_ERROR = 1.0  # a failed turn (the store down) is tried again after this, at most the interval
LISTEN_BACKOFF = (0.5, 30.0)  # the listen connection's reconnects: first wait, longest wait
LISTEN_STABLE = 30.0  # a listen connection that lived this long resets the backoff
# The probe reads the runs in flight (the earliest lease end, the oldest queued run) at
# most this often, and whenever what it read last comes due (FlightReads).
FLIGHT_READ_EVERY = 1.0
# A read due this close is taken now: an idle scanner waking by its 1 s interval reads
# them on each wake, rather than skipping by a hair and probing again at once.
FLIGHT_READ_SLACK = 0.05
# The ceilings of the reads of runs in flight are read as they are at least this often
# (Ceilings): a run in flight above one (queued by a scanner that held the partition
# before, and had not yet seen it lose its lease) is read within this.
CEILINGS_READ_EVERY = 30.0
# A scanner with a listener drops its floors (where its reads of waiting runs start,
# scanners.scan.scan_once) at least this often: a waiting run its scan's lock skipped,
# which nothing notifies, is read again within it.
FLOORS_DROP_EVERY = 5.0


@dataclass
class Pacer:
    """When to scan and how long to sleep, from each probe's Work. No clock of its
    own and no sleeping: every time is the store's, as the probe read it."""

    interval: float
    lookahead: float
    requeue_after: float
    lease: float
    batch: int
    gap: float = field(init=False)
    _stuck: dict[str, datetime] = field(init=False, default_factory=dict)
    _scanned_at: datetime | None = field(init=False, default=None)
    _unchecked: Work | None = field(init=False, default=None)  # the probe before the last scan
    _full: bool = field(init=False, default=False)
    _shared_out: bool = field(init=False, default=False)
    _notices_after: datetime | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.gap = max(SCAN_GAP, self.lookahead / 2)

    @property
    def longest(self) -> float:
        return min(self.interval, LONGEST_SLEEP)

    def times(self, work: Work, *, lookahead: float) -> dict[str, datetime]:
        """When each kind of a scan's work is due: a run less the look-ahead, a lease at
        its end, a queued run when it is republished, a paused job at its resume time."""
        times = {
            "due": work.due - timedelta(seconds=lookahead) if work.due else None,
            "lease": work.lease,
            "requeue": work.queued + timedelta(seconds=self.requeue_after) if work.queued else None,
            "resume": work.resume,
        }
        return {kind: t for kind, t in times.items() if t is not None}

    def observe(self, work: Work) -> None:
        """The first probe after a scan: work that was due at that scan and is still
        there could not be done (the queue at SCHEDULER_MAX_QUEUED, rows another
        scanner holds, a resume that fails). That kind waits a scan interval, as it
        did when every scan was an interval apart, instead of being scanned for again
        and again. A scan that filled a batch is not blocked: it goes straight on.

        A due run counts as left only if the earliest due_at is the one the scan
        was for: a run written during the scan already due (run-now) is new work."""
        before, self._unchecked = self._unchecked, None
        if before is None or self._full:
            return
        for kind, t in self.times(work, lookahead=0).items():
            # Due runs left by a scan that stepped over a service holding its share of
            # the queue are that service's: other services' runs coming due are scanned
            # for a gap apart, not an interval (scan_once, ServiceShares).
            if kind == "due" and self._shared_out:
                continue
            if t <= before.now and (kind != "due" or work.due == before.due):
                self._stuck[kind] = before.now + timedelta(seconds=self.interval)

    def scan_at(self, work: Work) -> datetime | None:
        """When a scan is next wanted, or None: nothing to do in these partitions."""
        times = []
        for kind, t in self.times(work, lookahead=self.lookahead).items():
            until = self._stuck.get(kind)
            if until is not None and until <= work.now:
                del self._stuck[kind]
            elif until is not None:
                t = max(t, until)
            times.append(t)
        if not times:
            return None
        at = min(times)
        if self._scanned_at is not None and not self._full:
            at = max(at, self._scanned_at + timedelta(seconds=self.gap))
        return at

    def forget(self) -> None:
        """The partitions changed: what was blocked was about others."""
        self._stuck.clear()

    def scan_due(self, work: Work) -> bool:
        at = self.scan_at(work)
        return at is not None and at <= work.now

    def scanned(self, work: Work, result: ScanResult) -> None:
        """A scan ran at work.now (the probe's clock, which the scan used)."""
        self._scanned_at, self._unchecked = work.now, work
        self._full = max(len(result.lease_expired), len(result.republished), len(result.resumed)) >= self.batch
        self._shared_out = result.shared_out

    def notices_due(self, work: Work) -> bool:
        at = self._notices_at(work)
        return at is not None and at <= work.now

    def notices_sent(self, work: Work) -> None:
        self._notices_after = work.now + timedelta(seconds=NOTICE_CHECK_SECONDS)

    def _notices_at(self, work: Work) -> datetime | None:
        if work.notices is None:
            return None
        return max(work.notices, self._notices_after) if self._notices_after else work.notices

    def sleep(self, work: Work) -> float:
        """Seconds from the probe until the next wake: the next scan, the next notice
        check, at most the longest sleep. While runs wait queued, at most a lease's
        length: one claimed now has its lease end no sooner than that, and the next
        probe sees it running and wakes again at its end."""
        wakes = [work.now + timedelta(seconds=self.longest)]
        wakes += [t for t in (self.scan_at(work), self._notices_at(work)) if t is not None]
        if work.queued is not None:
            wakes.append(work.now + timedelta(seconds=self.lease))
        return max(0.0, (min(wakes) - work.now).total_seconds())


@dataclass
class FlightReads:
    """When the probe reads the runs in flight, and what it read last.

    Those two parts of the probe read every run in flight in the partitions (no
    index orders them by lease end or queue time: the claim that sets both writes no
    index entry), thousands at the highest rate, where a scanner probes many times a
    second. They are read at most every `every` seconds, and at once when the last
    answer comes due (a lease end, a queued run's republish time) or the partitions
    change; in between the probe goes by the last answer.

    The last answer stays a lower bound: a lease is only ever set to a claim's or a
    heartbeat's clock plus the lease length, later than every lease end read before,
    and a run is queued at the clock, later than every queue time read before. So a
    scanner never wakes later for an ended lease or a run to republish than when
    each probe read them. Runs it queues itself are counted at once (`scanned`: the
    oldest queue time is then no earlier than the scan's clock, and the sleep while runs
    wait queued is at most a lease, Pacer.sleep); any other new run in flight is seen
    within `every`, since a scanner that did not read them sleeps no longer than until
    its next read (`sleep_cap`). The scan decides from its own reads, never from these
    times (scanners.scan.scan_once). With a lease length that differs between
    workers, a shorter lease may be seen up to `every` late."""

    requeue_after: float
    every: float = FLIGHT_READ_EVERY
    clock: Callable[[], float] = time.monotonic
    _last: Work | None = field(init=False, default=None)
    _read_at: float = field(init=False, default=0.0)
    _queued_since: int = field(init=False, default=0)  # runs this scanner queued since the last read

    def wanted(self) -> bool:
        """Whether the next probe reads the runs in flight."""
        last = self._last
        if last is None:
            return True
        elapsed = self.clock() - self._read_at
        if elapsed >= self.every - FLIGHT_READ_SLACK:
            return True
        now = last.now + timedelta(seconds=elapsed)
        if last.lease is not None and last.lease <= now:
            return True
        return last.queued is not None and last.queued + timedelta(seconds=self.requeue_after) <= now

    def merge(self, work: Work) -> Work:
        """The probe's answer with the runs in flight: its own if it read them (kept
        as the last answer), else the last answer's."""
        if work.in_flight:
            self._last, self._read_at, self._queued_since = work, self.clock(), 0
            return work
        if self._last is None:
            return work
        # The queued count: the last one read, plus what this scanner queued since (the
        # workers' claims since are not seen: never fewer than there are, so the
        # back-pressure never lets more than SCHEDULER_MAX_QUEUED wait).
        count = None if self._last.queued_count is None else self._last.queued_count + self._queued_since
        return replace(work, lease=self._last.lease, queued=self._last.queued, queued_count=count)

    def scanned(self, work: Work, result: ScanResult) -> None:
        """A scan at work.now queued runs (new, recovered or republished): the oldest
        queue time is no earlier than the last answer's, or than work.now if it had none."""
        self._queued_since += len(result.queued) + len(result.lease_expired)
        if self._last is None or not (result.queued or result.lease_expired or result.republished):
            return
        if self._last.queued is None:
            self._last = replace(self._last, queued=work.now)

    def sleep_cap(self, work: Work) -> float | None:
        """Seconds this scanner may sleep at most after a probe that did not read the
        runs in flight: until its next read is due. None after a probe that read them."""
        if work.in_flight or self._last is None:
            return None
        return max(0.0, self.every - (self.clock() - self._read_at))

    def forget(self) -> None:
        """The partitions changed, or a scan failed: the next probe reads them."""
        self._last = None


@dataclass
class Ceilings:
    """The highest (due time, id) a run in flight has in each of the scanner's
    partitions, as far as it knows: where its reads of runs in flight stop.

    runs_due_idx_open holds waiting runs and runs in flight together, ordered by due
    time (migration runs 0017: neither the queueing nor the claim writes an index
    entry). A read of runs in flight bounded by the clock alone reads every waiting run
    due by then as well, and in a backlog that is all of it, on each read (the probe's
    lease and queued parts and the back-pressure count; docs/performance.md). The
    scanner takes waiting runs in (due time, id) order, so in a backlog the waiting
    runs are above the last one it took.

    `known` is read as it is (next_work's read_ceilings: each partition's last run in
    flight, one read through the backlog) when the partitions change, after a failed
    turn, and every `every` seconds; in between each scan raises it over the runs it
    takes, before they are queued (scanners.scan.scan_once). Every other way a run gets
    in flight keeps it under: a lease run out or a republish leaves its due time as it
    was; a deferral, a retry, a pause or an edit makes it waiting first, and it is
    queued again by a scan. The one way past it: a scanner that held a partition
    before and goes on queueing there until it sees its lease lost (a batch at most,
    scan_once's keep_going); such a run is read within `every`. Until then the
    back-pressure count can be short by those runs, and their lease recovery and
    republish wait."""

    every: float = CEILINGS_READ_EVERY
    clock: Callable[[], float] = time.monotonic
    known: dict[int, tuple[datetime, int]] = field(default_factory=dict)
    _read_at: float | None = field(init=False, default=None)

    def due(self) -> bool:
        """Whether the next read of runs in flight reads the ceilings as they are (and
        reads up to the look-ahead, not up to them)."""
        return self._read_at is None or self.clock() - self._read_at >= self.every

    def read(self, found: dict[int, tuple[datetime, int]]) -> None:
        """What a probe read as the ceilings: they only go up while the partitions
        stay this scanner's."""
        self.known = {p: max(at, self.known.get(p, at)) for p, at in found.items()}
        self._read_at = self.clock()

    def for_scan(self) -> dict[int, tuple[datetime, int]] | None:
        """What a scan stops its reads of runs in flight at, and raises: None until
        they have been read (the embedded SQLite file never reads them)."""
        return None if self._read_at is None else self.known

    def forget(self) -> None:
        """The partitions changed, or a turn failed: read them again."""
        self.known = {}
        self._read_at = None


class Listener:
    """LISTEN scheduler_due on a connection of its own, in a thread: a notification
    for one of `partitions` (or '*') calls `wake`. Idle, the thread sits in select()
    on the connection's socket and a pipe (stop, reset): no statement, no timer.

    If the connection drops it reconnects with backoff, and wakes the scanner once
    it is back (what was sent meanwhile is lost); until then the scanner sleeps by
    its interval, which is all a lost notification costs.

    A run's notification names its due time too (migration runs 0018: '<partition>
    <microseconds since the epoch>'): the earliest of each partition since the scanner
    last asked is kept for it (take_lowered), to lower the floor its reads of waiting
    runs start after (scanners.scan.scan_once). Until a LISTEN is in place, and after
    each reconnect, what was written meanwhile is not known: take_lowered says so, and
    the scanner drops its floors."""

    def __init__(self, identifier: str, conn_params: dict[str, Any], wake: Callable[[], None]) -> None:
        self.partitions: frozenset[int] = frozenset()
        self.listening = threading.Event()  # set while LISTEN is in place (tests, ops)
        self._params = listen_params(conn_params, identifier)
        self._wake = wake
        self._stop = threading.Event()
        self._reset = threading.Event()
        self._pipe_r, self._pipe_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name=f"listen-{identifier}", daemon=True)
        self._lock = threading.Lock()
        self._lowered: dict[int, datetime] = {}  # the earliest due time notified, each partition
        self._unknown = True  # not listening since the last take_lowered: floors go

    def take_lowered(self) -> tuple[bool, dict[int, datetime]]:
        """Whether notifications may have been missed since the last call (the
        scanner then drops its floors), and the earliest due time each partition of
        this scanner was notified of since; both start again."""
        with self._lock:
            unknown, lowered = self._unknown or not self.listening.is_set(), self._lowered
            self._unknown, self._lowered = False, {}
        return unknown, lowered

    @classmethod
    def for_scanner(cls, identifier: str, wake: Callable[[], None]) -> Listener | None:
        """A started listener on PostgreSQL; None on the embedded SQLite file (no
        NOTIFY: the scanner sleeps by its interval there)."""
        from django.db import connection

        if connection.vendor != "postgresql":
            return None
        listener = cls(identifier, connection.get_connection_params(), wake)
        listener._thread.start()
        return listener

    def reset(self) -> None:
        """Reconnect (the scanner's own connection failed: the store may have moved)."""
        self._reset.set()
        self._poke()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._poke()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._pipe_r)
            os.close(self._pipe_w)

    def _poke(self) -> None:
        try:
            os.write(self._pipe_w, b"x")
        except OSError:  # closed by stop()
            pass

    def _run(self) -> None:
        backoff = LISTEN_BACKOFF[0]
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self._listen()
            except Exception as exc:  # noqa: BLE001 - whatever it is, the scanner goes on by its interval
                self.listening.clear()
                if self._stop.is_set():
                    break
                if time.monotonic() - started >= LISTEN_STABLE:
                    backoff = LISTEN_BACKOFF[0]
                logger.warning("listen connection lost (%s); waking by the scan interval, reconnecting in %.1f s",
                               str(exc).strip()[:200] or type(exc).__name__, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, LISTEN_BACKOFF[1])

    def _listen(self) -> None:
        import psycopg

        with psycopg.connect(**self._params, autocommit=True) as conn:
            conn.execute(f"LISTEN {CHANNEL}")
            with self._lock:
                self._unknown = True
            self.listening.set()
            # Listening now: whatever was written while it was not is looked for at once.
            self._wake()
            sock = conn.pgconn.socket
            while not self._stop.is_set():
                ready, _, _ = select.select([sock, self._pipe_r], [], [])
                if self._pipe_r in ready:
                    os.read(self._pipe_r, 64)
                    if self._reset.is_set():
                        self._reset.clear()
                        raise ConnectionResetError("reset after the scanner's connection failed")
                    continue
                self._deliver([n.payload for n in conn.notifies(timeout=0)])
                if conn.closed or conn.broken:
                    raise ConnectionError("listen connection closed")
        self.listening.clear()

    def _deliver(self, payloads: list[str]) -> None:
        partitions = self.partitions
        wake = False
        for payload in payloads:
            part, _, micros = payload.partition(" ")
            if payload == "*":
                wake = True
            elif part.isdigit() and int(part) in partitions:
                wake = True
                if micros.lstrip("-").isdigit():
                    self._lower(int(part), EPOCH + timedelta(microseconds=int(micros)))
        if wake:
            self._wake()

    def _lower(self, partition: int, due: datetime) -> None:
        with self._lock:
            if partition not in self._lowered or due < self._lowered[partition]:
                self._lowered[partition] = due


def listen_params(conn_params: dict[str, Any], identifier: str) -> dict[str, Any]:
    """The listen connection's parameters (own_connection_params)."""
    return own_connection_params(conn_params, identifier, "listen")


def own_connection_params(conn_params: dict[str, Any], identifier: str, role: str) -> dict[str, Any]:
    """Django's connection parameters for a plain psycopg connection of the scanner's
    own (the listen one, the open runs' VACUUM): its name in pg_stat_activity
    (`scanner <identifier> <role>`), a bounded connect, and TCP keepalives (the listen
    connection only ever reads: without them a silently lost server would never be
    noticed)."""
    params = {k: v for k, v in conn_params.items() if k not in ("cursor_factory", "context", "prepare_threshold")}
    params["application_name"] = f"scanner {identifier} {role}"[:63]
    for key, value in (("connect_timeout", 10), ("keepalives", 1), ("keepalives_idle", 30),
                       ("keepalives_interval", 10), ("keepalives_count", 3)):
        params.setdefault(key, value)
    return params
