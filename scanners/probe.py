"""The probe: what an idle scanner asks its partitions on each wake, in one statement
(next_work), and its answer (Work). scanners.scan.scan_once does the work it finds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection

from runs import claims
from runs.models import OPEN_KEPT_FOR_SQL

# ------------------------------------------------------------------ the probe
#
# What an idle scanner asks on each wake, in one statement: the store's clock and,
# in its partitions, the earliest time of each kind of work a scan does. Each part
# is an index read: the earliest due run per partition (runs_due_idx_open's runs, read
# per partition as DUE_IDS_SQL does, after the partition's floor, stopping at the first
# waiting one), the earliest lease end and the oldest queued run (runs_due_idx_open's
# runs due by the look-ahead and a second, claims.in_flight_due_bound, and by the
# partition's ceiling, wakeups.Ceilings: every run in flight of the partition, at most
# SCHEDULER_MAX_QUEUED and those running, and the few waiting runs below the ceiling; no
# index orders them by either time, since neither the queueing nor the claim, which set
# both, writes an index entry: migration runs 0017), the
# earliest resume time of a paused job (jobs_paused_until_idx, which holds only jobs
# with a resume time), and for the scanner of partition 0 the earliest pending
# notice (notices_due_idx). docs/performance.md, "Idle", has what it costs.
# The two parts on runs in flight read every one of them, up to SCHEDULER_MAX_QUEUED
# and more at the highest rate, where the scanner wakes many times a second: they are
# asked only when wakeups.FlightReads says so (each part in a CASE, whose subquery
# PostgreSQL runs only when its branch is taken).
_EARLIEST_IN_FLIGHT = """(SELECT min(e.t)
          FROM unnest(%s::integer[], %s::timestamptz[], %s::bigint[]) AS p(part, up_to_at, up_to_id)
         CROSS JOIN LATERAL (
               SELECT r.{column} AS t FROM runs r
                WHERE r.partition = p.part AND (r.due_at, r.id) <= (p.up_to_at, p.up_to_id)
                  AND {where} AND r.kept_for = {open}
                ORDER BY r.{column} LIMIT 1) e)"""
# A run in flight is due by the store's clock plus claims.in_flight_due_bound(), held
# or not, and by the partition's ceiling (wakeups.Ceilings): runs_due_idx_open's range
# for it (migration runs 0017).
_IN_FLIGHT = "r.stage = 'flight' AND r.due_at <= STATEMENT_TIMESTAMP() + %s"
# The due part starts each partition after the last run the scanner's scans took there
# (scan_once's floors; claims.DUE_IDS_SQL reads the same way): the runs in flight, due first in
# runs_due_idx_open, are behind it.
_EARLIEST_DUE = """(SELECT min(e.t)
          FROM unnest(%s::integer[], %s::timestamptz[], %s::bigint[]) AS p(part, after_at, after_id)
         CROSS JOIN LATERAL (
               SELECT r.due_at AS t FROM runs r
                WHERE r.partition = p.part AND (r.due_at, r.id) > (p.after_at, p.after_id)
                  AND r.stage = 'waiting' AND NOT r.held AND r.kept_for = {open}
                ORDER BY r.due_at, r.id LIMIT 1) e)""".format(open=OPEN_KEPT_FOR_SQL)
# The back-pressure count, a partition at a time under its ceiling.
_QUEUED_COUNT = """(SELECT coalesce(sum(c.n), 0)
          FROM unnest(%s::integer[], %s::timestamptz[], %s::bigint[]) AS p(part, up_to_at, up_to_id)
         CROSS JOIN LATERAL (
               SELECT count(*) AS n FROM runs r
                WHERE r.partition = p.part AND (r.due_at, r.id) <= (p.up_to_at, p.up_to_id)
                  AND {where} AND r.status = 'queued' AND r.kept_for = {open}) c)""".format(
    where=_IN_FLIGHT, open=OPEN_KEPT_FOR_SQL)
# The ceilings as they are (wakeups.Ceilings, when not known or due again): each
# partition's last run in flight by (due time, id), read backwards from the bound
# (through a backlog's waiting runs, once).
_CEILINGS = """(SELECT json_agg(json_build_array(p.part, m.due_at, m.id))
          FROM unnest(%s::integer[]) AS p(part)
         CROSS JOIN LATERAL (
               SELECT r.due_at, r.id FROM runs r
                WHERE r.partition = p.part AND {where} AND r.kept_for = {open}
                ORDER BY r.due_at DESC, r.id DESC LIMIT 1) m)""".format(where=_IN_FLIGHT, open=OPEN_KEPT_FOR_SQL)
NEXT_WORK_SQL = f"""
SELECT clock_timestamp(),
       {_EARLIEST_DUE},
       CASE WHEN %s THEN {_EARLIEST_IN_FLIGHT.format(open=OPEN_KEPT_FOR_SQL, column="lease_expires_at", where=_IN_FLIGHT + " AND r.status = 'running'")} END,
       CASE WHEN %s THEN {_EARLIEST_IN_FLIGHT.format(open=OPEN_KEPT_FOR_SQL, column="queued_at", where=_IN_FLIGHT + " AND r.status = 'queued'")} END,
       (SELECT j.paused_until FROM jobs j
         WHERE j.paused_until IS NOT NULL AND j.paused AND j.id %% %s = ANY(%s::integer[])
         ORDER BY j.paused_until LIMIT 1),
       CASE WHEN %s THEN (SELECT n.due_at FROM notices n WHERE n.status = 'pending' ORDER BY n.due_at LIMIT 1) END,
       CASE WHEN %s THEN {_QUEUED_COUNT} END,
       CASE WHEN %s THEN {_CEILINGS} END
"""
# The embedded SQLite file: the same question, plainly (small tables, and no LATERAL).
NEXT_WORK_SQL_SQLITE = """
SELECT (SELECT min(due_at) FROM runs WHERE status = 'scheduled' AND NOT held AND partition IN ({parts})),
       CASE WHEN %s THEN (SELECT min(lease_expires_at) FROM runs WHERE status = 'running' AND partition IN ({parts})) END,
       CASE WHEN %s THEN (SELECT min(queued_at) FROM runs WHERE status = 'queued' AND partition IN ({parts})) END,
       (SELECT min(paused_until) FROM jobs WHERE paused_until IS NOT NULL AND paused AND id %% %s IN ({parts})),
       CASE WHEN %s THEN (SELECT min(due_at) FROM notices WHERE status = 'pending') END,
       CASE WHEN %s THEN (SELECT count(*) FROM runs WHERE status = 'queued' AND partition IN ({parts})) END
"""


# The scanner's own connections read with plain index scans, never bitmap ones. Its reads
# of runs in flight (the probe's lease and queued parts, the back-pressure count, the
# recovery reads) go through runs_due_idx_open's entries due by the look-ahead, where
# every run that ended since the last VACUUM leaves a dead entry. A plain index scan marks each dead entry it
# meets (PostgreSQL's kill_prior_tuple), so the next read steps over it without visiting
# the table; a bitmap scan does not, and visits every one again on every read. With
# bitmaps the probe read 3,872 entries a partition for about 34 live runs and took 52 ms,
# six times a second, at 985 runs/s: a third of a core of PostgreSQL (docs/performance.md,
# "The store at scale: the due read, retention, growth"). And never a sequential scan
# where an index serves: the reads of runs in flight are a range of runs_due_idx_open
# up to the look-ahead (migration runs 0017), and `due_at` moves with the clock past
# what the table's statistics last saw, so that a minute after an ANALYZE the planner
# takes every open run for due and reads the whole table (11 ms for 30,000 open runs,
# every scan) where the range holds a few dozen. Set as startup options: no statement
# of its own.
SCANNER_SESSION_OPTIONS = "-c enable_bitmapscan=off -c enable_seqscan=off"


def scanner_session(wrapper: Any) -> None:
    """Give this database wrapper's next connection the scanner's session options
    (PostgreSQL; nothing elsewhere). The OPTIONS dict is replaced, not changed: a
    copied wrapper shares it with its original."""
    if wrapper.vendor != "postgresql":
        return
    options = dict(wrapper.settings_dict.get("OPTIONS") or {})
    have = options.get("options", "")
    if SCANNER_SESSION_OPTIONS not in have:
        options["options"] = f"{have} {SCANNER_SESSION_OPTIONS}".strip()
    wrapper.settings_dict["OPTIONS"] = options
    wrapper.close()  # connected already: the next statement connects with them


@dataclass(frozen=True)
class Work:
    """The probe's answer: the store's clock, and the earliest time of each kind of
    work in a scanner's partitions (None: none of that kind)."""

    now: datetime
    due: datetime | None = None  # a scheduled, not-held run's due_at
    lease: datetime | None = None  # a running run's lease_expires_at
    queued: datetime | None = None  # a queued run's queued_at (republished SCHEDULER_REQUEUE_AFTER later)
    resume: datetime | None = None  # a paused job's paused_until
    notices: datetime | None = None  # a pending notice's due_at (asked by partition 0's scanner only)
    in_flight: bool = True  # whether `lease` and `queued` were read by this probe (next_work's in_flight)
    # Runs queued, not yet claimed: read with the runs in flight; in between, the last
    # count plus the runs queued since (wakeups.FlightReads), never less than there are.
    queued_count: int | None = None
    # Each partition's ceiling as read (next_work's read_ceilings; None: not read).
    ceilings: "dict[int, tuple[datetime, int]] | None" = None


def next_work_params(parts: list[int], *, in_flight: bool, notices: bool,
                     floors: "dict[int, tuple[datetime, int]] | None" = None,
                     ceilings: "dict[int, tuple[datetime, int]] | None" = None,
                     read_ceilings: bool = False) -> list[object]:
    """NEXT_WORK_SQL's parameters, in its order (the fourth says whether it reads the
    runs in flight)."""
    bound = claims.in_flight_due_bound()
    up_to = claims.ceiling_params(parts, ceilings)
    return [*claims.floor_params(parts, floors), in_flight, *up_to, bound, in_flight, *up_to, bound,
            settings.SCHEDULER_PARTITIONS, parts, notices, in_flight, *up_to, bound,
            in_flight and read_ceilings, parts, bound]


def next_work(partitions: list[int] | frozenset[int], *, notices: bool = False, in_flight: bool = True,
              floors: "dict[int, tuple[datetime, int]] | None" = None,
              ceilings: "dict[int, tuple[datetime, int]] | None" = None,
              read_ceilings: bool = False) -> Work:
    """One statement: the store's clock and the earliest work in these partitions;
    with `notices`, also the earliest pending notice (the scanner holding partition 0
    publishes the notice sender). Without `in_flight`, the runs in flight are not read
    (`lease` and `queued` come back None): the scanner reads them at most once a
    FLIGHT_READ_EVERY and in between goes by what it read last (wakeups.FlightReads).
    `floors`: where each partition's due part starts (scan_once's). `ceilings`: the
    highest (due time, id) a run in flight of each partition has (wakeups.Ceilings; a
    partition not in it is read up to the look-ahead). With `read_ceilings` (and
    `in_flight`), the answer has each partition's ceiling as it is, in `ceilings`."""
    parts = sorted(partitions)
    n = settings.SCHEDULER_PARTITIONS
    found = None
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(NEXT_WORK_SQL, next_work_params(parts, in_flight=in_flight, notices=notices, floors=floors,
                                                           ceilings=ceilings, read_ceilings=read_ceilings))
            row = cursor.fetchone()
            if in_flight and read_ceilings:
                found = _ceilings_read(row[7], parts)
        else:
            marks = ", ".join(["%s"] * len(parts)) or "NULL"
            cursor.execute(NEXT_WORK_SQL_SQLITE.format(parts=marks),
                           [*parts, in_flight, *parts, in_flight, *parts, n, *parts, notices, in_flight, *parts])
            row = (claims.store_now(), *cursor.fetchone())
    now, due, lease, queued, resume, notice = (claims._as_datetime(v) for v in row[:6])
    assert now is not None
    count = None if row[6] is None else int(row[6])
    return Work(now=now, due=due, lease=lease, queued=queued, resume=resume, notices=notice, in_flight=in_flight,
                queued_count=count, ceilings=found)


def _ceilings_read(value: Any, parts: list[int]) -> "dict[int, tuple[datetime, int]]":
    """The probe's ceilings column (a JSON list of [partition, due_at, id]; NULL when no
    partition has a run in flight) as a ceiling for each partition read."""
    if isinstance(value, str):
        value = json.loads(value)
    found = {int(p): (datetime.fromisoformat(at), int(pk)) for p, at, pk in value or []}
    return {p: found.get(p, claims.NONE_IN_FLIGHT) for p in parts}
