"""The open runs' VACUUM, run by the scanner holding partition 0 (PostgreSQL only).

Every run leaves dead row versions in `runs_open`, and an entry in runs_due_idx_open
that is dead once it ends and moves to the history (its queueing and its claim are
HOT updates, which keep the entry its insert made: migration runs 0017). Until a VACUUM removes them, the scanner's reads of
the earliest due run (the probe's due part and the due read, both an index read per
partition from the oldest due time up) step over every entry left since the last
one: at 1,300 runs/s, a minute after a VACUUM, 12,000 buffers and 5 to 12 ms a read,
against 86 buffers and 0.2 ms just after it (docs/performance.md, "The store at
scale: the due read, retention, growth"). Autovacuum looks at a table at most once
a `autovacuum_naptime` (a minute by default), and some servers run with it off.

So the scanner holding partition 0 counts the runs the scanners queue (its own,
scaled by the share of the partitions it holds) and, once they pass
SCHEDULER_OPEN_RUNS_VACUUM_AFTER or a tenth of the open runs (the table's
`reltuples` as the last VACUUM left it), whichever is more, runs `VACUUM (SKIP_LOCKED)
runs_open` on a connection and a thread of its own: the scanner's turns go on
meanwhile, one VACUUM at a time, and one that finds the table locked (autovacuum at
it, an ALTER) is skipped, not waited for. An idle scheduler queues nothing and so
never vacuums: no statement while idle. SCHEDULER_OPEN_RUNS_VACUUM_AFTER=0 leaves the
table to autovacuum alone.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from scanners.wakeups import own_connection_params

logger = logging.getLogger("scheduler.scanner")

SHARE_OF_OPEN_RUNS = 0.1  # vacuum once the runs queued since the last pass a tenth of the open runs
VACUUM_SQL = "VACUUM (SKIP_LOCKED) runs_open"
OPEN_RUNS_SQL = "SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = 'runs_open'::regclass"


class OpenRunsVacuum:
    """Counts queued runs and vacuums `runs_open` when enough have been (see the module)."""

    def __init__(self, after: int, conn_params: dict[str, Any] | None, identifier: str = "") -> None:
        self.after = after
        self.open_runs = 0  # reltuples as the last VACUUM left it
        self.queued = 0.0  # runs queued since the last VACUUM (an estimate over every partition)
        self.vacuums = 0  # VACUUMs run (skipped ones included)
        self.last_seconds: float | None = None
        self._params = own_connection_params(conn_params, identifier, "vacuum") if conn_params is not None else None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_scanner(cls, after: int, identifier: str) -> OpenRunsVacuum:
        from django.db import connection

        params = connection.get_connection_params() if connection.vendor == "postgresql" else None
        return cls(after, params, identifier)

    @property
    def enabled(self) -> bool:
        return self.after > 0 and self._params is not None

    def threshold(self) -> float:
        return max(self.after, SHARE_OF_OPEN_RUNS * self.open_runs)

    def counted(self, queued: int, owned: frozenset[int], partitions: int) -> bool:
        """A scan queued `queued` runs in `owned` (of `partitions` in all). Returns
        whether a VACUUM was started."""
        if not self.enabled or 0 not in owned or not queued:
            return False
        self.queued += queued * partitions / len(owned)
        if self.queued < self.threshold() or self.running:
            return False
        self.queued = 0.0
        self._thread = threading.Thread(target=self._run, name="vacuum-open-runs", daemon=True)
        self._thread.start()
        return True

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float = 60.0) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        import psycopg

        assert self._params is not None
        started = time.monotonic()
        try:
            with psycopg.connect(**self._params, autocommit=True) as conn:
                conn.execute(VACUUM_SQL)
                row = conn.execute(OPEN_RUNS_SQL).fetchone()
            self.open_runs = int(row[0]) if row else self.open_runs
        except Exception:  # noqa: BLE001 - a failed VACUUM is autovacuum's to do; the next one is tried later
            logger.warning("VACUUM of the open runs failed", exc_info=True)
            return
        finally:
            self.vacuums += 1
        self.last_seconds = time.monotonic() - started
        logger.info("vacuumed the open runs in %.2f s (%d open runs)", self.last_seconds, self.open_runs)

