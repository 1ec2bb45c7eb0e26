"""`python manage.py scanner`: hold partition leases, move due runs onto the run queue."""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import close_old_connections

from scanners.coordination import PartitionLeases, make_leases
from runs.notices import notices_due
from runs.tasks import send_notices
from scanners.scan import ScanResult, scan_once

logger = logging.getLogger("scheduler.scanner")
NOTICE_CHECK_SECONDS = 5.0


class Command(BaseCommand):
    help = "Take partition leases from the coordinator and move due runs onto the run queue."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--once", action="store_true", help="one scan, then exit (for scripts and tests)")
        parser.add_argument("--identifier", default=None, help="member name in the coordinator")

    def handle(self, *args: Any, once: bool, identifier: str | None, **options: Any) -> None:
        self.stopping = threading.Event()
        leases = make_leases(identifier)

        def stop(*_: Any) -> None:
            self.stopping.set()
            leases.wake()  # out of its wait() at once

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        leases.start()
        self.stdout.write(f"scanner {leases.identifier} started ({leases.describe()['kind']} coordinator)")
        self.stdout.flush()
        owned: frozenset[int] = frozenset()
        try:
            while not self.stopping.is_set():
                started = time.monotonic()
                owned = self.handle_one(leases, owned)
                if once:
                    break
                # Until the next turn, or sooner when the coordinator saw a change
                # (a member left, a partition's lock was freed): a partition just
                # taken is scanned at once, not a scan interval later.
                leases.wait(settings.SCHEDULER_SCAN_INTERVAL - (time.monotonic() - started))
        finally:
            leases.stop()
            self.stdout.write(f"scanner {leases.identifier} stopped")

    def handle_one(self, leases: PartitionLeases, previous: frozenset[int]) -> frozenset[int]:
        """One turn: ask which partitions are ours right now, scan them."""
        owned = leases.poll()
        if owned != previous:
            # A line the handover measurements and operators read.
            self.stdout.write(f"partitions {sorted(owned)} at {time.time():.3f}")
            self.stdout.flush()
        if not owned:
            return owned
        close_old_connections()
        try:
            result = scan_once(partitions=owned)
        except Exception:  # the database is down or a statement failed: try again next turn
            logger.exception("scan failed")
            return owned
        self._report(result)
        self.notices_tick(owned)
        return owned

    def notices_tick(self, owned: frozenset[int]) -> None:
        """Every NOTICE_CHECK_SECONDS, the scanner holding partition 0 (one scanner,
        with no more coordination) publishes the notice sender when notices are due.
        It never sends them itself: a slow webhook must not hold up a scan."""
        if 0 not in owned or time.monotonic() < getattr(self, "_notices_next", 0.0):
            return
        self._notices_next = time.monotonic() + NOTICE_CHECK_SECONDS
        try:
            if notices_due():
                send_notices.delay()
        except Exception:  # the broker or the store is down: next time
            logger.exception("notices check failed")

    def _report(self, result: ScanResult) -> None:
        if result.to_publish or result.misfired or result.set_aside:
            logger.info(
                "queued %d, lease expired %d, republished %d, misfired %d, skipped %d, set aside %d",
                len(result.queued), len(result.lease_expired), len(result.republished), result.misfired, result.skipped,
                len(result.set_aside),
            )
