"""The open runs' partition has no index naming a column the queueing or the claim
changes (migration runs 0017; PostgreSQL): both are HOT updates, and the reads of runs
in flight still find every one of them, read among the runs due by the look-ahead.
"""
from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from runs import claims, partitions
from runs.models import Run
from tests.factories import drop_time_partitions, make_job, make_run

S = Run.Status

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the open runs' partition is PostgreSQL's"),
]

# What the queueing and the claim change on the row.
CHANGED = {"status", "stage", "queued_at", "started_at", "fence", "attempt", "lease_owner", "lease_expires_at",
           "on_row", "on_row_queued_at", "on_row_claimed_at", "on_row_worker"}


N = 8


def updates_of_runs_open() -> tuple[int, int]:
    """This transaction's updates of runs_open so far, and how many of them were HOT."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables WHERE relname = 'runs_open'")
        return cursor.fetchone()


def index_columns(table: str) -> dict[str, set[str]]:
    """Each index of `table` and every column its key or its predicate names."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT i.relname, pg_get_indexdef(x.indexrelid)
                 FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
                WHERE x.indrelid = %s::regclass""",
            [table],
        )
        columns = {f.column for f in Run._meta.concrete_fields}
        return {name: {c for c in columns if re.search(rf"\b{c}\b", ddl.split(" USING ", 1)[1])}
                for name, ddl in cursor.fetchall()}


def test_no_index_of_the_open_runs_names_a_column_the_queueing_or_the_claim_changes() -> None:
    found = index_columns("runs_open")
    assert set(found) == {"runs_pkey_open", "runs_one_run_per_time_open", "runs_finished_idx_open",
                          "runs_due_idx_open", "runs_one_open_run_per_job_open"}, found
    assert {name: cols & CHANGED for name, cols in found.items() if cols & CHANGED} == {}


def test_the_queueing_and_the_claim_of_due_runs_are_hot_updates() -> None:
    """Before migration runs 0017 the queueing changed `stage` (waiting to flight), which
    three indexes of runs_open named: none of its updates was HOT. (A few runs: in one
    transaction the versions the updates leave are not yet dead, and all of them must fit
    on the page beside the first.)"""
    now = timezone.now()
    runs = [make_run(make_job(name=f"job {i}"), now - timedelta(seconds=1)) for i in range(N)]
    ids = [run.pk for run in runs]
    before = updates_of_runs_open()
    assert claims.mark_queued(run_ids=ids, now=now, on_row=True) == N
    queued = updates_of_runs_open()
    assert (queued[0] - before[0], queued[1] - before[1]) == (N, N)
    assert len(claims.claim_many(run_ids=ids, worker="w1", lease=timedelta(minutes=5))) == N
    claimed = updates_of_runs_open()
    assert (claimed[0] - queued[0], claimed[1] - queued[1]) == (N, N)


def test_the_reads_of_runs_in_flight_find_them_held_or_not_and_skip_the_later_waiting_runs() -> None:
    now = timezone.now()
    past = now - timedelta(minutes=10)
    queued = make_run(make_job(name="queued"), past, status=S.QUEUED, queued_at=past)
    held = make_run(make_job(name="held"), past, status=S.QUEUED, queued_at=past, held=True)
    # Queued ahead of its due time by the look-ahead: due within it.
    ahead = make_run(make_job(name="ahead"), now + timedelta(seconds=0.4), status=S.QUEUED, queued_at=now)
    lost = make_run(make_job(name="lost"), past, status=S.RUNNING, queued_at=past, started_at=past,
                    lease_owner="gone", lease_expires_at=past + timedelta(seconds=30))
    for i in range(30):
        make_run(make_job(name=f"later {i}"), now + timedelta(hours=1 + i))
    parts = sorted({r.partition for r in (queued, held, ahead, lost)} | set(range(16)))
    with override_settings(SCHEDULER_LOOKAHEAD=0.5):
        assert claims.count_queued(partitions=parts) == 3
        assert claims.claimed_up_to(partitions=parts, since=now) == past
        assert claims.release_expired_leases(partitions=parts, now=now, limit=10) == [lost.pk]
        unclaimed = claims.touch_unclaimed(partitions=parts, now=now, older_than=timedelta(minutes=1), limit=10)
        # The lost run was queued again just now by the release: not yet due for a copy.
        assert sorted(unclaimed) == sorted([queued.pk, held.pk])


def test_a_read_of_runs_in_flight_is_a_range_of_the_open_runs_due_index_bounded_by_the_look_ahead() -> None:
    """Not every open run of the partition: its waiting runs due later are outside the range."""
    from django.test.utils import CaptureQueriesContext

    now = timezone.now()
    for i in range(50):
        make_run(make_job(name=f"later {i}"), now + timedelta(hours=i + 1))
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE runs_open")
    with CaptureQueriesContext(connection) as queries:
        claims.count_queued(partitions=list(range(16)))
    (sql,) = [q["sql"] for q in queries.captured_queries]
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # as the scanner's session has it
        cursor.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {sql}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    # One range a partition, bounded by the due time: the later runs are not read.
    assert re.search(r"Index Cond: \(\(partition = ANY .*\) AND \(due_at <= ", plan), plan
    assert "Rows Removed" not in plan, plan


@pytest.mark.django_db(transaction=True)
def test_a_new_history_partition_gets_the_historys_own_indexes() -> None:
    """runs_status_idx and runs_dead_unhandled_idx are not partitioned indexes any more
    (runs_open must not have them): runs.partitions.make builds them on each new partition."""
    drop_time_partitions()
    try:
        (span,) = partitions.make_ahead(timezone.now(), 0)
        made = index_columns(span.name)
        history = index_columns("runs_history")
        suffix = span.name[len("runs"):]
        assert {name[: -len(suffix)]: cols for name, cols in made.items()} == {
            name[: -len("_history")]: cols for name, cols in history.items()}
        assert {"runs_status_idx_history", "runs_dead_unhandled_idx_history"} <= set(history)
    finally:
        drop_time_partitions()


def test_a_scan_with_floors_starts_each_partition_after_the_runs_it_took_and_a_full_read_finds_the_rest() -> None:
    """scan_once's `floors` (the scanner's, dropped at each read of the runs in flight,
    at most a second apart): each batch moves its partition's floor past the runs it
    took, so the next scan does not walk them again now that they are in flight; a run
    that turns waiting behind the floor is found by the next scan from the start."""
    from scanners.scan import scan_once

    now = timezone.now()
    job = make_job(name="first")
    parts = list(range(16))
    first = make_run(job, now - timedelta(seconds=5))
    floors: dict[int, tuple[Any, int]] = {}
    assert scan_once(partitions=parts, now=now, publish=False, floors=floors).queued == [first.pk]
    assert floors == {first.partition: (first.due_at, first.pk)}
    # Due before the floor, in the same partition: not read while the floor stands.
    behind = make_run(make_job(name="behind"), now - timedelta(seconds=10), partition=first.partition)
    assert scan_once(partitions=parts, now=now, publish=False, floors=floors).queued == []
    assert scan_once(partitions=parts, now=now, publish=False, floors={}).queued == [behind.pk]


def test_a_spikes_runs_at_one_due_time_are_taken_batch_after_batch_past_the_floor() -> None:
    """Runs of one due time: the floor is (due time, id), so the second batch starts
    after the first one's last run, not after every run of that time."""
    from scanners.scan import scan_once

    now = timezone.now()
    due = now - timedelta(seconds=1)
    runs = [make_run(make_job(name=f"spike {i}"), due, partition=3) for i in range(6)]
    floors: dict[int, tuple[Any, int]] = {}
    with override_settings(SCHEDULER_SCAN_BATCH=4):
        taken = scan_once(partitions=[3], now=now, publish=False, floors=floors).queued
    assert sorted(taken) == sorted(r.pk for r in runs)
    assert floors == {3: (due, max(r.pk for r in runs))}


def test_the_back_pressure_goes_by_the_probes_queued_count_plus_the_runs_queued_since() -> None:
    """The count of queued runs is read with the runs in flight (at most a second apart);
    in between FlightReads adds the runs this scanner queued, so the count is never less
    than there are and a full queue is not filled past SCHEDULER_MAX_QUEUED."""
    from scanners.probe import Work
    from scanners.scan import ScanResult, scan_once
    from scanners.wakeups import FlightReads

    now = timezone.now()
    run = make_run(make_job(), now - timedelta(seconds=1))
    reads = FlightReads(requeue_after=30, clock=lambda: 0.0)
    read = reads.merge(Work(now=now, in_flight=True, queued_count=7))
    reads.scanned(read, ScanResult(queued=[1, 2, 3]))
    assert reads.merge(Work(now=now, in_flight=False)).queued_count == 10
    with override_settings(SCHEDULER_MAX_QUEUED=10):
        full = Work(now=now, due=run.due_at, in_flight=False, queued_count=10)
        assert scan_once(partitions=list(range(16)), now=now, publish=False, work=full).queued == []
        room = Work(now=now, due=run.due_at, in_flight=False, queued_count=0)
        assert scan_once(partitions=list(range(16)), now=now, publish=False, work=room).queued == [run.pk]
