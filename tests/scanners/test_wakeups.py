"""The scanner sleeps until it has work: the probe (one statement), the sleep it
decides, the triggers that wake it, and what an idle scanner costs."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.db import connection
from django.db.models import Min
from django.test import override_settings
from django.utils import timezone

from jobs.models import Job
from runs import claims
from runs.models import Notice, Run
from scanners.coordination import LocalLeases
from scanners.management.commands.scanner import Command
from scanners.probe import NEXT_WORK_SQL, Work, next_work, next_work_params, scanner_session
from scanners.scan import ScanResult
from scanners.wakeups import (
    CHANNEL, FLIGHT_READ_EVERY, LONGEST_SLEEP, NOTICE_CHECK_SECONDS, SCAN_GAP, FlightReads, Pacer, listen_params,
)
from tests.factories import make_job, make_run, utc

S = Run.Status
T0 = utc("2026-10-28T20:30:00Z")
on_postgresql = pytest.mark.skipif(connection.vendor != "postgresql", reason="NOTIFY and the plans are PostgreSQL's")


def pacer(**given: Any) -> Pacer:
    values: dict[str, Any] = {"interval": 1.0, "lookahead": 0.0, "requeue_after": 30, "lease": 60, "batch": 500}
    values.update(given)
    return Pacer(**values)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


# ------------------------------------------------------------------ the sleep (no database)


def test_an_idle_scanner_sleeps_the_scan_interval_and_never_longer_than_the_notify_horizon_allows() -> None:
    assert pacer(interval=1.0).sleep(Work(now=T0)) == 1.0
    assert pacer(interval=30.0).sleep(Work(now=T0, due=at(600))) == 30.0
    # A run written due in 61 s notifies nobody (the triggers' horizon is 60 s): the
    # scanner must wake by itself before it is due, however long its interval.
    assert pacer(interval=300.0).sleep(Work(now=T0)) == LONGEST_SLEEP == 30.0


def test_a_scanner_sleeps_until_its_earliest_work_less_the_lookahead_for_a_due_run() -> None:
    assert pacer(interval=30).sleep(Work(now=T0, due=at(2.5))) == 2.5
    assert pacer(interval=30, lookahead=0.4).sleep(Work(now=T0, due=at(2.5))) == pytest.approx(2.1)
    # Recovery work is not handed on early: a lease at its end, a lost message when
    # SCHEDULER_REQUEUE_AFTER has passed, a paused job at its resume time.
    assert pacer(interval=30, lookahead=0.4).sleep(Work(now=T0, lease=at(3))) == 3.0
    assert pacer(interval=60, requeue_after=5, lease=60).sleep(Work(now=T0, queued=at(-2))) == 3.0
    assert pacer(interval=30, lookahead=0.4).sleep(Work(now=T0, resume=at(7))) == 7.0
    assert pacer(interval=30).sleep(Work(now=T0, due=at(-1))) == 0.0


def test_while_a_run_waits_queued_the_scanner_looks_again_within_a_lease() -> None:
    """A queued run claimed now has its lease end no sooner than a lease from now: the
    probe then sees it running and sleeps until that end, never past it."""
    p = pacer(interval=30, requeue_after=30, lease=2)
    assert p.sleep(Work(now=T0, queued=at(-1))) == 2.0
    assert p.sleep(Work(now=T0)) == 30.0


def test_work_due_is_scanned_for_and_work_not_yet_due_is_not() -> None:
    p = pacer(lookahead=0.2)
    assert not p.scan_due(Work(now=T0, due=at(0.5), lease=at(1), queued=at(-29), resume=at(0.1)))
    assert p.scan_due(Work(now=T0, due=at(0.2)))
    assert p.scan_due(Work(now=T0, lease=at(0)))
    assert p.scan_due(Work(now=T0, queued=at(-30)))
    assert p.scan_due(Work(now=T0, resume=at(-0.001)))
    assert not p.scan_due(Work(now=T0, notices=at(-5)))  # notices are published, not scanned for


def test_scans_that_found_no_full_batch_are_at_least_a_scan_gap_apart() -> None:
    p = pacer()
    p.scanned(Work(now=T0), ScanResult(queued=[1]))
    after = Work(now=at(0.001), due=at(0.002))
    p.observe(after)
    assert not p.scan_due(after)
    assert p.sleep(after) == pytest.approx(SCAN_GAP - 0.001)
    assert p.scan_due(Work(now=at(SCAN_GAP), due=at(0.002)))
    assert pacer(lookahead=0.5).gap == 0.25  # half the look-ahead, when that is longer


def test_work_a_scan_could_not_do_waits_a_scan_interval_instead_of_being_scanned_for_again() -> None:
    """The queue at SCHEDULER_MAX_QUEUED leaves due runs due: scanning for them at once
    again would spin. They wait an interval, as when every scan was an interval apart,
    while other kinds of work still wake the scanner at their time."""
    p = pacer(interval=1.0)
    p.scanned(Work(now=T0, due=at(-3)), ScanResult())
    still = Work(now=at(0.01), due=at(-3), resume=at(0.3))
    p.observe(still)
    assert not p.scan_due(still)
    assert p.sleep(still) == pytest.approx(0.29)  # the resume time, not the stuck runs
    assert not p.scan_due(Work(now=at(0.99), due=at(-3)))
    assert p.scan_due(Work(now=at(1.0), due=at(-3)))


def test_due_runs_a_scan_left_for_a_services_share_are_scanned_for_a_gap_later_not_an_interval() -> None:
    """A scan that stepped over a service holding its share of the queue left its due
    runs due on purpose (scan_once: `shared_out`): other services' runs coming due
    meanwhile are behind them in due order, and must not wait an interval."""
    p = pacer(interval=1.0, lookahead=0.5)
    p.scanned(Work(now=T0, due=at(-3)), ScanResult(shared_out=True))
    still = Work(now=at(0.01), due=at(-3))
    p.observe(still)
    assert not p.scan_due(still)
    assert p.sleep(still) == pytest.approx(0.24)  # the gap (half the look-ahead) since the scan
    assert p.scan_due(Work(now=at(0.25), due=at(-3)))
    # The same scan without stepping over anyone: the runs wait the interval.
    q = pacer(interval=1.0, lookahead=0.5)
    q.scanned(Work(now=T0, due=at(-3)), ScanResult())
    q.observe(still)
    assert not q.scan_due(Work(now=at(0.25), due=at(-3)))


def test_a_scan_that_filled_a_batch_goes_straight_on() -> None:
    p = pacer(batch=3)
    p.scanned(Work(now=T0, lease=at(-9)), ScanResult(lease_expired=[1, 2, 3]))
    more = Work(now=at(0.001), lease=at(-8))
    p.observe(more)
    assert p.scan_due(more) and p.sleep(more) == 0.0


def test_work_written_during_a_scan_is_not_taken_for_work_it_could_not_do() -> None:
    p = pacer(interval=1.0)
    p.scanned(Work(now=T0), ScanResult(queued=[1]))
    later = Work(now=at(0.05), due=at(0.03))  # due after the scan: written meanwhile
    p.observe(later)
    assert p.scan_due(later)
    p.scanned(Work(now=at(1), due=at(-3)), ScanResult())
    run_now = Work(now=at(1.05), due=at(0.99))  # due before the scan, but not the run it was for
    p.observe(run_now)
    assert p.scan_due(run_now)


def test_notices_are_published_at_once_then_at_most_every_notice_check() -> None:
    p = pacer(interval=30)
    first = Work(now=T0, notices=at(-1))
    assert p.notices_due(first)
    p.notices_sent(first)
    again = Work(now=at(1), notices=at(-1))
    assert not p.notices_due(again)
    assert p.sleep(again) == pytest.approx(NOTICE_CHECK_SECONDS - 1)
    assert p.notices_due(Work(now=at(NOTICE_CHECK_SECONDS), notices=at(-1)))
    assert not pacer().notices_due(Work(now=T0, notices=at(3)))


# ------------------------------------------------------------------ the probe


@pytest.mark.embedded
@pytest.mark.django_db
def test_the_probe_finds_the_earliest_work_of_each_kind_in_its_own_partitions_only(service: Any) -> None:
    jobs = [make_job(service.user, name=f"j{i}") for i in range(4)]
    mine = frozenset({jobs[0].partition, jobs[1].partition})
    a, b, other, far = jobs
    extra = {"is_backfill": True}  # more open runs than a job's own one
    make_run(a, at(10))
    make_run(b, at(4), due_at=at(5))  # due_at counts, not scheduled_for
    make_run(a, at(1), held=True, **extra)  # held: not the scanner's
    make_run(other, at(2))  # another scanner's partition
    make_run(b, at(-60), status=S.RUNNING, lease_expires_at=at(20), **extra)
    make_run(a, at(-120), status=S.QUEUED, queued_at=at(-100), **extra)
    make_run(far, at(-120), status=S.QUEUED, queued_at=at(-200))
    Job.objects.filter(pk=b.pk).update(paused=True, paused_until=at(40))
    Job.objects.filter(pk=far.pk).update(paused=True, paused_until=at(30))
    Notice.objects.create(job=far, kind=Notice.Kind.DEAD, created_at=T0, due_at=at(7))

    work = next_work(mine, notices=True)
    assert (work.due, work.lease, work.queued, work.resume, work.notices) == (at(5), at(20), at(-100), at(40), at(7))
    assert abs((work.now - claims.store_now()).total_seconds()) < 5
    assert next_work(mine).notices is None  # only the scanner of partition 0 asks
    nothing = next_work(frozenset(range(16)) - mine - {other.partition, far.partition})
    assert (nothing.due, nothing.lease, nothing.queued, nothing.resume) == (None, None, None, None)


def fill(rows: int) -> None:
    """`rows` jobs and a run each due next week, a tenth of them queued, a tenth running
    (those due at T0 or a little before), a tenth of the jobs paused with a resume time, a tenth with a pending notice: every index the probe
    reads has rows, most of them none of its business."""
    from tests.scanners.test_due_query_plan import fill_sql

    owner = make_job().owner
    fill_jobs, fill_runs = fill_sql()
    with connection.cursor() as cursor:
        cursor.execute(fill_jobs, [owner.pk, rows])
        # Waiting runs due next week by the store's clock (a backlog due already is a
        # different shape: the reads of runs in flight read it too).
        cursor.execute(fill_runs, [timezone.now() + timedelta(days=7)])
        # A run in flight was due when it was queued (runs.claims.in_flight_due_bound): T0,
        # weeks ago, and a few minutes before it.
        cursor.execute("UPDATE runs SET status = 'queued', due_at = %s - (id %% 997) * interval '1 second', "
                       "queued_at = due_at WHERE id %% 10 = 1", [T0])
        cursor.execute("UPDATE runs SET status = 'running', due_at = %s - (id %% 997) * interval '1 second', "
                       "lease_expires_at = due_at WHERE id %% 10 = 2", [T0])
        cursor.execute("UPDATE jobs SET paused = true, paused_until = %s WHERE id %% 10 = 3", [T0 + timedelta(days=8)])
        cursor.execute("INSERT INTO notices (job_id, kind, reason, created_at, status, due_at, tries, sent_to, "
                       "last_error) SELECT id, 'dead', '', now(), 'pending', %s, 0, '', '' FROM jobs WHERE id %% 10 = 4",
                       [T0 + timedelta(days=9)])
        for table in ("jobs", "runs", "notices"):
            cursor.execute(f"ANALYZE {table}")


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_each_part_of_the_probe_is_a_read_of_its_own_index_at_a_hundred_thousand_rows() -> None:
    """The earliest due run is the first entry of runs_due_idx's waiting runs (no sort);
    the earliest lease and queued times are read from its runs in flight, all of them
    (no index orders them by those times: the claim that sets them writes no index
    entry), so those two parts sort what they read and nothing reads the table."""
    fill(100_000)
    for parts in (list(range(16)), [3, 7]):
        with connection.cursor() as cursor:
            cursor.execute("EXPLAIN (COSTS OFF) " + NEXT_WORK_SQL, next_work_params(parts, in_flight=True, notices=True))
            plan = "\n".join(row[0] for row in cursor.fetchall())
        for index in ("runs_due_idx", "jobs_paused_until_idx", "notices_due_idx"):
            assert index in plan, plan
        assert plan.count("->  Sort") <= 2, plan
        assert "Seq Scan" not in plan, plan
        work = next_work(parts, notices=True)
        mine = Run.objects.filter(partition__in=parts)
        scheduled = mine.filter(status=S.SCHEDULED, held=False).order_by("due_at")
        assert work.due == scheduled.values_list("due_at", flat=True).first()
        assert work.lease == mine.filter(status=S.RUNNING).aggregate(t=Min("lease_expires_at"))["t"]
        assert work.queued == mine.filter(status=S.QUEUED).aggregate(t=Min("queued_at"))["t"]
        assert work.resume == T0 + timedelta(days=8) and work.notices == T0 + timedelta(days=9)


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_probe_not_asked_for_the_runs_in_flight_does_not_read_them() -> None:
    """The probe's two parts on runs in flight read every one of them: at 1,400 runs/s,
    where a scanner probes many times a second, they made the probe the costliest
    statement of a run (0.14 ms a run, docs/performance.md).
    Not asked (wakeups.FlightReads decides), PostgreSQL runs neither part: each is in a
    CASE whose branch is not taken."""
    fill(20_000)  # 2,000 queued and 2,000 running
    parts = list(range(16))
    asked, asked_plan = _probe_buffers(connection, parts, in_flight=True)
    skipped, plan = _probe_buffers(connection, parts, in_flight=False)
    print(f"runs_open buffers: {asked} with the runs in flight, {skipped} without")
    # Since migration runs 0017 the due part steps over the runs in flight too (they are
    # due first in runs_due_idx_open): what is not asked is the two parts that read
    # every one of them again, each sorted by its time.
    # (Four with them: the queued count for the back-pressure is read with them too.)
    assert _runs_open_reads_run(asked_plan) == 4 and _runs_open_reads_run(plan) == 1, plan
    assert skipped * 2 < asked, plan
    # And the due part starts after the runs the scanner took (its floors): past the
    # runs in flight, which it no longer visits one by one.
    floors: dict[int, tuple[Any, int]] = {}
    for run in Run.objects.filter(status__in=(S.QUEUED, S.RUNNING)).only("partition", "due_at"):
        floors[run.partition] = max(floors.get(run.partition, (run.due_at, 0)), (run.due_at, run.pk))
    past, plan = _probe_buffers(connection, parts, in_flight=False, floors=floors)
    print(f"runs_open buffers: {past} with the floors past the runs in flight")
    assert past * 10 < skipped, plan
    assert next_work(parts, in_flight=False, floors=floors).due == next_work(parts, in_flight=False).due
    work = next_work(parts, notices=True, in_flight=False)
    assert (work.lease, work.queued, work.in_flight) == (None, None, False)
    assert work.due is not None and work.resume is not None and work.notices is not None
    read = next_work(parts, notices=True)
    assert read.in_flight and read.lease is not None and read.queued is not None


def _runs_open_reads_run(plan: str) -> int:
    """How many reads of runs_open the plan ran (a CASE branch not taken: none)."""
    found: list[int] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "runs_open" and node.get("Actual Loops", 0) > 0:
            found.append(1)
        for child in node.get("Plans", []):
            walk(child)

    walk(json.loads(plan)[0]["Plan"])
    return len(found)


def _probe_buffers(wrapper: Any, parts: list[int], in_flight: bool = True,
                   floors: dict[int, tuple[Any, int]] | None = None) -> tuple[int, str]:
    """Shared buffers the probe touched in runs_open, and its plan (EXPLAIN ANALYZE)."""
    with wrapper.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + NEXT_WORK_SQL,
                       next_work_params(parts, in_flight=in_flight, notices=True, floors=floors))
        plan = cursor.fetchone()[0]
    plan = plan if isinstance(plan, list) else json.loads(plan)
    found: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        if node.get("Relation Name") == "runs_open":
            found.append(node)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0) for n in found), json.dumps(plan)


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_the_scanners_probe_steps_over_the_dead_entries_of_ended_runs_once_it_has_met_them() -> None:
    """Every run that ended since the last VACUUM leaves a dead `flight` entry in
    runs_due_idx. The scanner's session reads by plain index scans (scanners.scan.
    scanner_session), which mark each dead entry they meet, so a second probe steps over
    them without reading the table. With bitmap scans, which mark nothing, the probe
    read 3,872 entries a partition for 34 live runs, on every probe (52 ms at 985 runs/s)."""
    fill(20_000)
    with connection.cursor() as cursor:  # nine in ten of the runs in flight end: dead entries
        cursor.execute("UPDATE runs SET status = 'succeeded', finished_at = due_at, kept_for = scheduled_for "
                       "WHERE status IN ('queued', 'running') AND id % 100 >= 10")
        cursor.execute("ANALYZE runs")
    scanner = connection.copy()
    try:
        scanner_session(scanner)
        with scanner.cursor() as cursor:
            cursor.execute("SHOW enable_bitmapscan")
            assert cursor.fetchone()[0] == "off"
        with connection.cursor() as cursor:  # the original wrapper's session is left as it was
            cursor.execute("SHOW enable_bitmapscan")
            assert cursor.fetchone()[0] == "on"
        parts = list(range(16))
        first, _ = _probe_buffers(scanner, parts)
        second, plan = _probe_buffers(scanner, parts)
        with scanner.cursor() as cursor:  # no dead entry left: what the live runs alone cost
            cursor.execute("VACUUM runs_open")
        none_dead, _ = _probe_buffers(scanner, parts)
    finally:
        scanner.close()
    assert "Bitmap" not in plan and "Seq Scan" not in plan, plan
    # 3,600 ended runs had entries among 400 live ones in flight: the first probe visits
    # the table for each, the second only for the live ones, about as a probe does once
    # VACUUM has removed the dead entries.
    assert first > 1500, (first, second, none_dead)
    assert second < first / 2.5, (first, second, none_dead)
    assert second < none_dead * 1.25, (first, second, none_dead)


# ------------------------------------------------------------------ the triggers


@pytest.fixture
def listening() -> Iterator[Callable[[], list[str]]]:
    """A LISTEN connection of the test's own: what was notified since the last call (the
    partition, or '0' or '*', of each notification; a run's due time, which follows it,
    is the test of its own below)."""
    conn = psycopg.connect(**listen_params(connection.get_connection_params(), "test"), autocommit=True)
    conn.execute(f"LISTEN {CHANNEL}")

    def received() -> list[str]:
        time.sleep(0.05)  # delivered at commit; give the server a moment to send it
        return sorted(n.payload.split(" ")[0] for n in conn.notifies(timeout=0.2))

    yield received
    conn.close()


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_bulk_insert_of_runs_due_soon_notifies_once_per_partition(
        service: Any, listening: Callable[[], list[str]]) -> None:
    jobs = [make_job(service.user, name=f"b{i}") for i in range(40)]
    listening()
    now = claims.store_now()
    Run.objects.bulk_create(Run(job=j, scheduled_for=now, due_at=now + timedelta(seconds=1), partition=j.partition)
                            for j in jobs)
    assert listening() == sorted({str(j.partition) for j in jobs})


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_next_runs_written_with_copy_notify_their_partitions_and_runs_due_later_do_not(
        service: Any, listening: Callable[[], list[str]]) -> None:
    from runs.bulk import insert_open_runs

    soon, later = [make_job(service.user, name=f"c{i}") for i in range(3)], make_job(service.user, name="later")
    listening()
    now = claims.store_now()
    rows = [Run(job=j, scheduled_for=now, due_at=now + timedelta(seconds=5), partition=j.partition) for j in soon]
    rows.append(Run(job=later, scheduled_for=now, due_at=now + timedelta(minutes=5), partition=later.partition))
    inserted, refused = insert_open_runs(rows)  # the worker's next runs: one COPY
    assert len(inserted) == 4 and not refused
    assert listening() == sorted({str(j.partition) for j in soon})


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_writes_that_bring_no_work_sooner_notify_nobody(service: Any, listening: Callable[[], list[str]]) -> None:
    job = make_job(service.user)
    now = claims.store_now()
    later = make_run(job, now + timedelta(days=7))  # due past the horizon
    Run.objects.filter(pk=later.pk).update(due_at=now + timedelta(days=8))
    Run.objects.filter(pk=later.pk).update(status=S.QUEUED, queued_at=now)
    # A queued run's due time is no scanner's work; and the claim takes only a due run.
    Run.objects.filter(pk=later.pk).update(due_at=now - timedelta(seconds=1))
    claim = claims.claim(run_id=later.pk, worker="w", lease=timedelta(seconds=60))
    assert claim is not None
    assert claims.heartbeat(run_id=later.pk, fence=claim.fence, lease=timedelta(seconds=60))
    assert claims.finish(run_id=later.pk, fence=claim.fence, status=S.SUCCEEDED, now=now)
    held = make_run(job, now, due_at=now + timedelta(seconds=1), held=True)
    Run.objects.filter(pk=held.pk).update(due_at=now)  # still held
    assert listening() == []


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_retry_a_release_a_resume_time_and_a_notice_each_wake_their_scanner(
        service: Any, listening: Callable[[], list[str]]) -> None:
    job = make_job(service.user)
    p = str(job.partition)
    now = claims.store_now()
    run = make_run(job, now - timedelta(seconds=5), status=S.QUEUED, queued_at=now)
    claim = claims.claim(run_id=run.pk, worker="w", lease=timedelta(seconds=60))
    assert claim is not None and listening() == []
    assert claims.schedule_retry(run_id=run.pk, fence=claim.fence, due_at=now + timedelta(seconds=10), error="503")
    assert listening() == [p]
    Run.objects.filter(pk=run.pk).update(held=True)
    assert listening() == []
    Run.objects.filter(pk=run.pk).update(held=False)  # a resume releases it
    assert listening() == [p]
    Job.objects.filter(pk=job.pk).update(paused=True, paused_until=now + timedelta(seconds=20))
    assert listening() == ["*"]
    Notice.objects.create(job=job, kind=Notice.Kind.DEAD, created_at=now, due_at=now)
    assert listening() == ["0"]


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_requeued_dead_run_and_a_reopened_cancelled_run_wake_their_scanner(
        service: Any, listening: Callable[[], list[str]]) -> None:
    """Both move a row from the history back to the open runs (migration runs 0015),
    which fires none of the table's UPDATE triggers: the store wakes the scanner itself."""
    from runs import ops
    from runs.nextrun import run_reopen

    job = make_job(service.user)
    now = claims.store_now()
    dead = make_run(job, now - timedelta(minutes=5), status=S.DEAD, finished_at=now, attempt=3)
    cancelled = make_run(job, now + timedelta(seconds=10), status=S.CANCELLED, finished_at=now)
    far = make_run(job, now + timedelta(days=3), status=S.CANCELLED, finished_at=now)
    assert listening() == []
    assert ops.run_requeue_dead(run=dead, via="command")
    assert listening() == [str(job.partition)]
    run_reopen(run=cancelled, job=job, now=now, held=False)
    assert listening() == [str(job.partition)]
    Run.objects.filter(pk=cancelled.pk).update(status=S.CANCELLED, finished_at=now)
    run_reopen(run=far, job=job, now=now, held=False)  # due past the horizon: nobody
    assert listening() == []
    assert Run.objects.get(pk=far.pk).status == S.SCHEDULED


# ------------------------------------------------------------------ an idle scanner


def run_scanner(body: Callable[[Command, LocalLeases], None], stop: threading.Event,
                statements: list[tuple[float, str]], params: list[Any] | None = None) -> threading.Thread:
    """The scanner's loop on a thread of its own (its own connection), on the
    single-node coordinator, every statement on its connection counted (and, given
    `params`, each statement's parameters kept there in the same order)."""

    def count(execute: Any, sql: str, given: Any, many: bool, context: Any) -> Any:
        statements.append((time.monotonic(), sql))
        if params is not None:
            params.append(given)
        return execute(sql, given, many, context)

    def main() -> None:
        command = Command()
        command.stopping = stop
        leases = LocalLeases("idle-test")
        leases.start()
        try:
            with connection.execute_wrapper(count):
                body(command, leases)
        finally:
            leases.stop()
            connection.close()

    thread = threading.Thread(target=main, name="scanner-under-test")
    thread.start()
    return thread


@on_postgresql
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("interval", [0.25, 1.0])  # 1 s: the default, and FlightReads' own period
def test_an_idle_scanner_makes_one_statement_per_scan_interval(service: Any, tmp_path: Path, interval: float) -> None:
    owner = service.user
    jobs = [make_job(owner, name=f"idle{i}") for i in range(64)]
    now = claims.store_now()
    Run.objects.bulk_create(Run(job=j, scheduled_for=now + timedelta(minutes=10), due_at=now + timedelta(minutes=10),
                                partition=j.partition) for j in jobs)
    stop = threading.Event()
    statements: list[tuple[float, str]] = []
    with override_settings(SCHEDULER_SCAN_INTERVAL=interval, DATA_DIR=tmp_path):
        thread = run_scanner(lambda command, leases: command.run_loop(leases), stop, statements)
        try:
            time.sleep(1.0)  # the first turn scans in full; then it only probes
            start, before = time.monotonic(), len(statements)
            time.sleep(3.0)
            window = statements[before:]
        finally:
            stop.set()
            thread.join(10)
    assert not thread.is_alive()
    elapsed = time.monotonic() - start
    print(f"idle scanner: {len(window)} statements in {elapsed:.2f} s (interval {interval} s)")
    assert all(sql == NEXT_WORK_SQL for _, sql in window), {sql[:60] for _, sql in window}
    assert len(window) <= elapsed / interval + 1
    assert len(window) >= elapsed / interval - 2  # it does wake by its interval


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_scanner_woken_often_reads_its_runs_in_flight_at_most_once_a_second(service: Any, tmp_path: Path) -> None:
    """A scanner probes on every wake, many times a second at the highest rate; the
    probe's reads of the runs in flight (every one of them) come at most every
    FLIGHT_READ_EVERY, while the lease ends and queue times they found are not due.
    Before, every probe read them: 0.14 ms of every run at 1,400 runs/s."""
    owner = service.user
    jobs = [make_job(owner, name=f"busy{i}") for i in range(48)]
    now = claims.store_now()
    for i, job in enumerate(jobs):
        if i % 3 == 0:
            make_run(job, now - timedelta(seconds=5), status=S.RUNNING, lease_expires_at=now + timedelta(minutes=10))
        elif i % 3 == 1:
            make_run(job, now - timedelta(seconds=5), status=S.QUEUED, queued_at=now)
        else:
            make_run(job, now + timedelta(minutes=10))
    interval = 0.05  # a wake every 50 ms, as a busy scanner's
    stop = threading.Event()
    statements: list[tuple[float, str]] = []
    params: list[Any] = []
    with override_settings(SCHEDULER_SCAN_INTERVAL=interval, DATA_DIR=tmp_path):
        thread = run_scanner(lambda command, leases: command.run_loop(leases), stop, statements, params)
        try:
            time.sleep(1.0)  # the first turn scans in full; then it only probes
            start, before = time.monotonic(), len(statements)
            time.sleep(2.5)
            window = list(zip(statements[before:], params[before:]))
        finally:
            stop.set()
            thread.join(10)
    assert not thread.is_alive()
    elapsed = time.monotonic() - start
    probes = [given for (_, sql), given in window if sql == NEXT_WORK_SQL]
    # The probe's fourth parameter is whether it reads the runs in flight (probe.next_work_params).
    reads = [given for given in probes if given[3] is not False]
    print(f"{len(probes)} probes in {elapsed:.2f} s, {len(reads)} of them read the runs in flight")
    assert len(probes) >= elapsed / interval / 2
    assert 1 <= len(reads) <= elapsed / FLIGHT_READ_EVERY + 2


def test_flight_reads_read_first_then_every_second_or_when_what_they_read_comes_due() -> None:
    ticks = [0.0]
    flight = FlightReads(requeue_after=30, clock=lambda: ticks[0])
    assert flight.wanted()  # nothing read yet
    read = Work(now=T0, due=at(100), lease=at(0.5), queued=at(-10))
    assert flight.merge(read) == read
    ticks[0] = 0.2
    assert not flight.wanted()
    skipped = Work(now=at(0.2), due=at(90), in_flight=False)
    assert flight.merge(skipped) == Work(now=at(0.2), due=at(90), lease=at(0.5), queued=at(-10), in_flight=False)
    ticks[0] = 0.5
    assert flight.wanted()  # the lease it read has ended: read again
    flight.merge(Work(now=at(0.5), lease=at(60), queued=at(-10)))
    ticks[0] = 0.9
    assert not flight.wanted()
    ticks[0] = 1.46
    assert flight.wanted()  # (about) a second since the last read
    flight.merge(Work(now=at(1.5), queued=at(-28.2)))
    ticks[0] = 1.6
    assert not flight.wanted()
    ticks[0] = 1.9
    assert flight.wanted()  # the queued run's republish time (-28.2 + 30 s) has come
    flight.merge(Work(now=at(1.9)))  # none in flight
    ticks[0] = 2.6
    assert not flight.wanted()
    assert flight.merge(Work(now=at(2.6), in_flight=False)) == Work(now=at(2.6), in_flight=False)
    # Not read: the scanner sleeps no longer than until its next read (a second after the last).
    assert flight.sleep_cap(Work(now=at(2.6), in_flight=False)) == pytest.approx(0.3)
    assert flight.sleep_cap(Work(now=at(2.6))) is None
    # It queued runs itself: the oldest queue time is the scan's clock at the earliest.
    flight.scanned(Work(now=at(2.6)), ScanResult(queued=[1, 2]))
    assert flight.merge(Work(now=at(2.7), in_flight=False)).queued == at(2.6)
    ticks[0] = 2.7
    flight.scanned(Work(now=at(2.7)), ScanResult(queued=[3]))  # an earlier time stays
    assert flight.merge(Work(now=at(2.7), in_flight=False)).queued == at(2.6)
    flight.forget()
    assert flight.wanted() and flight.sleep_cap(Work(now=at(2.8), in_flight=False)) is None


class _Handed(LocalLeases):
    """Leases the test hands over: the first half of the partitions, then all of them,
    with the wake the coordinator gives when a step has taken partitions."""

    def __init__(self) -> None:
        super().__init__("handover-test")
        self.owned = frozenset(range(8))

    def poll(self) -> frozenset[int]:
        return self.owned

    def take_all(self) -> None:
        self.owned = frozenset(range(16))
        self.wake()


class _Lines:
    """The command's stdout: each line with the monotonic time it was written."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> None:
        self.lines.append((time.monotonic(), text))

    def flush(self) -> None:
        pass

    def at(self, text: str) -> float | None:
        return next((t for t, line in self.lines if line.startswith(text)), None)


@pytest.mark.django_db(transaction=True)
def test_partitions_just_taken_are_scanned_at_once_not_a_scan_gap_later(tmp_path: Path) -> None:
    """A change of leases wakes the scanner, which acts on it at once: the scan gap paces
    notifications only (found by the failover bench: a survivor took the partitions up
    to half the look-ahead after the coordinator had them)."""
    out = _Lines()
    leases = _Handed()
    command = Command(stdout=out)  # type: ignore[arg-type]
    command.stopping = threading.Event()

    def main() -> None:
        try:
            command.run_loop(leases)
        finally:
            connection.close()

    # A gap of 2 s (half the look-ahead) and an idle sleep of 5 s: either would show.
    with override_settings(SCHEDULER_SCAN_INTERVAL=5.0, SCHEDULER_LOOKAHEAD=4.0, DATA_DIR=tmp_path):
        thread = threading.Thread(target=main, name="scanner-under-test")
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while out.at("partitions [0, 1, 2, 3, 4, 5, 6, 7]") is None and time.monotonic() < deadline:
                time.sleep(0.02)
            assert out.at("partitions [0, 1, 2, 3, 4, 5, 6, 7]") is not None, out.lines
            time.sleep(0.5)  # its first turns done: asleep until its interval or a wake
            handed = time.monotonic()
            leases.take_all()
            all_partitions = f"partitions {list(range(16))}"
            while out.at(all_partitions) is None and time.monotonic() < handed + 10:
                time.sleep(0.01)
        finally:
            command.stopping.set()
            leases.wake()
            thread.join(10)
    assert not thread.is_alive()
    taken = out.at(all_partitions)
    assert taken is not None, out.lines
    assert taken - handed < 1.0, f"the partitions taken {taken - handed:.2f} s after the wake"
