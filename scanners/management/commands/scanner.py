"""`python manage.py scanner`: hold partition leases, move due runs onto the run queue."""
from __future__ import annotations

import logging
import select
import signal
import threading
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from runs import rollups
from runs.retention import every as upkeep_every
from runs.tasks import keep_run_partitions, send_notices
from scanners.coordination import PartitionLeases, make_leases
from scanners.probe import next_work, scanner_session
from scanners.scan import ScanResult, scan_once
from scanners.shares import ShareFloors
from scanners.vacuum import OpenRunsVacuum
from scanners.wakeups import FLOORS_DROP_EVERY, RETRY_AFTER_ERROR, Ceilings, FlightReads, Listener, Pacer

logger = logging.getLogger("scheduler.scanner")


class Command(BaseCommand):
    help = "Take partition leases from the coordinator and move due runs onto the run queue."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one scan, then exit (for scripts and tests)")
        parser.add_argument("--identifier", default=None, help="member name in the coordinator")

    def handle(self, *args: Any, once: bool, identifier: str | None, **options: Any) -> None:
        self.stopping = threading.Event()
        scanner_session(connection)  # plain index scans: scanners.probe.SCANNER_SESSION_OPTIONS
        leases = make_leases(identifier)

        def stop(*_: Any) -> None:
            self.stopping.set()
            leases.wake()  # out of its wait() at once

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        leases.start()
        self.stdout.write(f"scanner {leases.identifier} started ({leases.describe()['kind']} coordinator)")
        self.stdout.flush()
        try:
            self.run_loop(leases, once=once)
        finally:
            leases.stop()
            self.stdout.write(f"scanner {leases.identifier} stopped")

    def run_loop(self, leases: PartitionLeases, *, once: bool = False) -> None:
        """Turns until `self.stopping` is set: each a probe (one statement), a scan
        only when the probe finds work due, then a sleep until the next work, at most
        SCHEDULER_SCAN_INTERVAL, cut short by a notification (scanners.wakeups) or a
        change of leases (a member left, a partition's lock was freed: a partition
        just taken is scanned at once)."""
        self.stopping = getattr(self, "stopping", None) or threading.Event()
        self.pacer = Pacer(
            interval=settings.SCHEDULER_SCAN_INTERVAL,
            lookahead=float(getattr(settings, "SCHEDULER_LOOKAHEAD", 0.0)),
            requeue_after=settings.SCHEDULER_REQUEUE_AFTER,
            lease=settings.SCHEDULER_LEASE_SECONDS,
            batch=settings.SCHEDULER_SCAN_BATCH,
        )
        self.flight = FlightReads(requeue_after=settings.SCHEDULER_REQUEUE_AFTER)
        # Where each partition's reads of waiting runs start (scanners.scan.scan_once's
        # `floors`): after the last run a scan took there, until the next full read.
        self.floors: dict[int, tuple[Any, int]] = {}
        self.share_floors = ShareFloors()  # lowered and dropped with the floors
        # Where each partition's reads of runs in flight stop (scanners.wakeups.Ceilings).
        self.ceilings = Ceilings()
        self.floors_dropped_at = 0.0  # time.monotonic() of the last drop of every floor
        self.dropped: dict[int, tuple[Any, int]] = {}  # the floors the timer dropped, until the next scan
        self.vacuum = OpenRunsVacuum.for_scanner(settings.SCHEDULER_OPEN_RUNS_VACUUM_AFTER, leases.identifier)
        self.owned: frozenset[int] = frozenset()
        self.upkeep_at = 0.0  # time.monotonic() of the next history upkeep (partition 0's scanner)
        self.rescan = True  # the first turn, and the one after a failed turn, scans in full
        # Which wakes were notifications: only those are paced a scan gap apart (a
        # change of leases, a stop, is acted on at once).
        self.notified = threading.Event()

        def on_notice() -> None:
            self.notified.set()
            leases.wake()

        self.listener = None if once else Listener.for_scanner(leases.identifier, on_notice)
        try:
            while not self.stopping.is_set():
                turn = time.monotonic()
                sleep = self.handle_one(leases)
                if once:
                    break
                # Timed from after the probe, so a wake comes at the work's time or just
                # after, never before it. Also after a scan (sleep 0): a wake already set
                # is for work written before the probe that comes next, which sees it.
                woken = leases.wait(sleep)
                by_notice = self.notified.is_set()
                self.notified.clear()
                if woken and sleep > 0 and by_notice:
                    # Woken early by notifications, perhaps a stream of them: probes at
                    # most a scan gap apart (a run written due at once waits that long at
                    # most). Not by a change of leases: a partition just taken is scanned
                    # at once, not up to a gap (half the look-ahead) later.
                    self.stopping.wait(self.pacer.gap - (time.monotonic() - turn))
        finally:
            if self.listener is not None:
                self.listener.stop()

    def handle_one(self, leases: PartitionLeases) -> float:
        """One turn: ask which partitions are ours right now, probe them, scan them if
        work is due (or they just changed). Returns how long to sleep. A scan always
        comes back for a probe at once: what it left is the next sleep's answer."""
        owned = leases.poll()
        changed = owned != self.owned or self.rescan
        if owned != self.owned:
            # A line the handover measurements and operators read.
            self.stdout.write(f"partitions {sorted(owned)} at {time.time():.3f}")
            self.stdout.flush()
            self.pacer.forget()
            self.flight.forget()
            self.floors = {}
            self.share_floors.clear()
            self.ceilings.forget()
        self.owned = owned
        if self.listener is not None:
            self.listener.partitions = owned
        if not owned:
            return self.pacer.longest
        try:
            self._check_connection()
            full = self.flight.wanted()
            self._lower_floors(full)
            exact = full and self.ceilings.due()
            work = self.flight.merge(next_work(owned, notices=0 in owned, in_flight=full, floors=self.floors,
                                               ceilings=None if exact else self.ceilings.for_scan(), read_ceilings=exact))
            if work.ceilings is not None:
                self.ceilings.read(work.ceilings)
            self.pacer.observe(work)
            self._notices(work)
            if 0 in owned:
                self._upkeep()
            if not (changed or self.pacer.scan_due(work)):
                sleep, cap = self.pacer.sleep(work), self.flight.sleep_cap(work)
                return sleep if cap is None else min(cap, sleep)
            # A live scan: later batches by the time it has taken; it ends early if
            # its partitions stop being this scanner's meanwhile.
            result = scan_once(partitions=owned, now=work.now, advance=True,
                               keep_going=lambda: leases.poll() == owned, work=work, floors=self.floors,
                               ceilings=self.ceilings.for_scan(), share_floors=self.share_floors)
        except Exception:  # the database is down or a statement failed: try again next turn
            logger.exception("scan failed")
            self._store_failed()
            self.flight.forget()
            self.floors = {}
            self.share_floors.clear()
            self.ceilings.forget()
            self.rescan = True
            return min(self.pacer.longest, RETRY_AFTER_ERROR)
        self.rescan = False
        self._count_found_by_drop(result)
        self.pacer.scanned(work, result)
        self.flight.scanned(work, result)
        self.vacuum.counted(len(result.queued) + len(result.republished), owned, settings.SCHEDULER_PARTITIONS)
        self._report(result)
        return 0.0

    def _lower_floors(self, full: bool) -> None:
        """Floors lowered to where a run turned waiting behind them (scanners.scan.scan_once's
        `floors`). With a listener, to each due time notified since the last turn
        (migration runs 0018: run now, a retry, a deferral, a resume, an edit that
        brings a run sooner), all of them when notifications may have been missed, and
        all of them every FLOORS_DROP_EVERY: a waiting run that a scan's lock skipped
        (another transaction held it) is behind the floor with nothing notified.
        Without one (the embedded SQLite file, `--once`), at each read of the runs in
        flight."""
        now = time.monotonic()
        if self.listener is None:
            if full:
                self.floors = {}
            self.share_floors.clear()  # nothing lowers them: each scan's steps from the floors
            return
        unknown, lowered = self.listener.take_lowered()
        if unknown or now - self.floors_dropped_at >= FLOORS_DROP_EVERY:
            # On the timer alone, the next scan counts what it finds behind the floors
            # dropped (_count_found_by_drop): runs nothing woke it for. The share
            # floors go on a timer of their own (ShareFloors.dropped_for_locks).
            self.dropped = {} if unknown else dict(self.floors)
            self.floors, self.floors_dropped_at = {}, now
            if unknown:
                self.share_floors.clear()
            else:
                self.share_floors.dropped_for_locks(now)
            for part, due in lowered.items():  # notified: not the drop's finds
                if part in self.dropped and (due, 0) < self.dropped[part]:
                    self.dropped[part] = (due, 0)
            return
        for part, due in lowered.items():
            floor = self.floors.get(part)
            if floor is not None and (due, 0) < floor:
                self.floors[part] = (due, 0)
            self.share_floors.lower(part, (due, 0))

    def _count_found_by_drop(self, result: ScanResult) -> None:
        """The runs the scan after a timed floor drop took from behind the floors it
        dropped: waiting runs that nothing woke the scanner for (/metrics:
        scheduler_runs_found_by_floor_drop_total; a missing wake-up shows there)."""
        dropped, self.dropped = getattr(self, "dropped", {}), {}
        found = [(p, d, i) for p, d, i in result.taken if p in dropped and (d, i) < dropped[p]]
        if found:
            logger.warning("%d waiting runs found only by the periodic floor drop (runs %s)", len(found),
                           ", ".join(str(i) for _, _, i in found[:10]))
            rollups.add_count(rollups.FLOOR_DROP_FOUND, len(found))

    def _notices(self, work: Any) -> None:
        """The scanner holding partition 0 (one scanner, with no more coordination)
        publishes the notice sender when notices are due, at most every
        NOTICE_CHECK_SECONDS. It never sends them itself: a slow webhook must not hold
        up a scan."""
        if not self.pacer.notices_due(work):
            return
        self.pacer.notices_sent(work)
        try:
            send_notices.delay()
        except Exception:  # the broker is down: next time
            logger.exception("notices check failed")

    def _upkeep(self) -> None:
        """The scanner holding partition 0 publishes the runs history's upkeep
        (runs.retention.keep: partitions made ahead, retention) when it takes the
        partition and then every runs.retention.every() seconds. A worker runs it."""
        if time.monotonic() < self.upkeep_at:
            return
        self.upkeep_at = time.monotonic() + upkeep_every()
        try:
            keep_run_partitions.delay()
        except Exception:  # the broker is down: next time
            logger.exception("publishing the history upkeep failed")
            self.upkeep_at = time.monotonic() + RETRY_AFTER_ERROR

    @staticmethod
    def _check_connection() -> None:
        """The health check, free of statements: a connection psycopg knows is closed
        or broken, or one the server has written to while it sat idle (a server that
        ends a connection says so, then closes it: pg_terminate_backend, a restart),
        is dropped, and the probe opens a new one. One lost without a word (a host
        gone) fails the probe instead: the turn fails and the next one reconnects."""
        raw = connection.connection
        if raw is None or connection.vendor != "postgresql":
            return
        if raw.closed or raw.broken or select.select([raw.pgconn.socket], [], [], 0)[0]:
            logger.info("the scanner's database connection was closed by the server; opening a new one")
            connection.close()

    def _store_failed(self) -> None:
        """The connection is closed so that the next turn opens a new one (the store
        may have restarted or moved), and the listener reconnects too. Between turns it
        stays open: an idle turn is one statement, not a connection."""
        try:
            connection.close()
        except Exception:  # noqa: BLE001 - closing a broken connection may fail too
            logger.debug("closing the broken connection failed", exc_info=True)
        if self.listener is not None:
            self.listener.reset()

    def _report(self, result: ScanResult) -> None:
        if result.to_publish or result.misfired or result.set_aside:
            logger.info(
                "queued %d, lease expired %d, republished %d, misfired %d, skipped %d, set aside %d",
                len(result.queued), len(result.lease_expired), len(result.republished), result.misfired, result.skipped,
                len(result.set_aside),
            )
