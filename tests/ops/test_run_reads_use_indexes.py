"""No statement the product sends reads the runs table whole once history is in it.

With 200,000 finished runs in `runs` (and analysed), the statements that the scanner's
scan and probe, the recovery reads, the API's run lists, the admin's pages and filters,
`/metrics` and `prune_runs --dry-run` send are each run again under EXPLAIN ANALYZE
(and rolled back), and none may be a sequential scan of `runs` or read more than
UNWANTED rows of it only to drop them (an index read in the wrong order, say, the
primary key backwards for a rare status). A read that must look at every finished run
is a read that grows with retention: at the seed's 50 million runs a day, minutes a
page. This is the
guard for issue 18's index changes (an index taken away or a predicate renamed leaves a
statement without one, and the tests would still pass on their few rows), and its list
of statements is the list of reads the partitioned store must keep indexed.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test import Client
from django.utils import timezone

from jobs.models import Job
from runs import claims, ops
from runs.models import Run
from scanners import probe, scan
from tests.conftest import Service
from tests.factories import drop_time_partitions, make_job, make_run

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the plans are PostgreSQL's"),
]
S = Run.Status
HISTORY = 200_000
JOBS = 50
# The table, or any partition of its history (migration runs 0015); not the open runs'
# partition, which holds a run per job and those in flight: the planner reads a few
# rows of it plainly, as it should.
SEQ_SCAN_OF_RUNS = re.compile(r"Seq Scan on runs(?!_open\b)(?:_\w+)?\b")
# A node that dropped this many rows over all its loops read history.
UNWANTED = 5_000
LOOPS = re.compile(r"\(actual rows=\d+ loops=(\d+)\)")
DROPPED = re.compile(r"Rows Removed by (?:Filter|Index Recheck): (\d+)")
# Statements that are whole reads by what they ask, whatever the indexes: none today.
# An entry here needs its reason beside it.
WHOLE_BY_DESIGN: dict[str, str] = {}


def fill_history(owner: Any, now: Any) -> list[Job]:
    """JOBS jobs and HISTORY succeeded runs of theirs, one a minute back from a day ago,
    written by INSERT ... SELECT (every column not named takes its model default), all
    in the default partition of the history (time partitions an earlier test's scanner
    made are dropped: tests/runs/test_partitions reads them)."""
    drop_time_partitions()
    from bench.load import defaults_sql

    jobs = [make_job(owner, name=f"history-{i}", target=f"http://host{i % 5}.test/x") for i in range(JOBS)]
    ids = [job.pk for job in jobs]
    cols, vals = defaults_sql(
        Run,
        {"job_id": "(%s::bigint[])[1 + i %% %s]", "scheduled_for": "t", "due_at": "t",
         "partition": "(%s::bigint[])[1 + i %% %s] %% 16", "status": "'succeeded'", "attempt": "1",
         "queued_at": "t", "started_at": "t", "finished_at": "t + interval '1 second'", "created_at": "t"},
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO runs ({cols}) SELECT {vals} FROM (SELECT i, %s::timestamptz - i * interval '1 minute' AS t"
            " FROM generate_series(1, %s) AS i) s",
            [ids, JOBS, ids, JOBS, now - timedelta(days=1), HISTORY],
        )
    return jobs


def open_and_rare_runs(jobs: list[Job], now: Any) -> None:
    """A few runs of every status and shape the pages, recovery and metrics look for."""
    a, b, c, d, e, f, g = jobs[:7]
    make_run(a, now - timedelta(seconds=5))  # due now
    make_run(b, now + timedelta(hours=1))  # due later
    make_run(c, now - timedelta(minutes=5), held=True)  # held by a pause
    make_run(d, now - timedelta(minutes=3), status=S.QUEUED, queued_at=now - timedelta(minutes=3))
    make_run(e, now - timedelta(minutes=2), status=S.RUNNING, attempt=1, fence=1, queued_at=now - timedelta(minutes=2),
             started_at=now - timedelta(minutes=2), lease_owner="w@h", lease_expires_at=now - timedelta(minutes=1))
    make_run(f, now - timedelta(minutes=1), status=S.RUNNING, attempt=1, fence=1, queued_at=now - timedelta(minutes=1),
             started_at=now - timedelta(minutes=1), lease_owner="w@h", lease_expires_at=now + timedelta(minutes=1))
    for i, status in enumerate((S.DEAD, S.SKIPPED, S.CANCELLED)):
        when = now - timedelta(hours=2, minutes=i)
        make_run(g, when, status=status, is_backfill=True, attempt=1, finished_at=when + timedelta(seconds=1))


def sent_while(action: Callable[[], Any]) -> list[tuple[str, Any]]:
    """The statements that name `runs`, as the product sent them, while `action` ran."""
    seen: list[tuple[str, Any]] = []

    def keep(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        if not many and re.search(r'\bruns\b|"runs"', sql) and sql.lstrip().upper().startswith(
            ("SELECT", "UPDATE", "DELETE", "WITH")
        ):
            seen.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(keep):
        action()
    return seen


class _Undo(Exception):
    pass


def plan_of(sql: str, params: Any) -> str:
    """The statement's plan as it ran (EXPLAIN ANALYZE), its writes rolled back."""
    try:
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) " + sql, params)
            plan = "\n".join(row[0] for row in cursor.fetchall())
            raise _Undo
    except _Undo:
        return plan


def reads_history(plan: str) -> bool:
    """A sequential scan of `runs`, or a node that read UNWANTED rows only to drop them
    (EXPLAIN gives a loop's average: times the node's loops)."""
    if SEQ_SCAN_OF_RUNS.search(plan):
        return True
    loops = 1
    for line in plan.splitlines():
        if found := LOOPS.search(line):
            loops = int(found.group(1))
        elif found := DROPPED.search(line):
            if int(found.group(1)) * loops >= UNWANTED:
                return True
    return False


def analyze_as_autovacuum_does() -> None:
    """Each table and partition analyzed, never the partitioned `runs` itself
    (migration runs 0015), whose figures stay as the migration left them."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT c.oid::regclass::text FROM pg_class c WHERE c.relkind = 'r' AND (c.oid = 'runs'::regclass "
            "OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'runs'::regclass))"
        )
        for (table,) in cursor.fetchall():
            cursor.execute(f"ANALYZE {table}")
        cursor.execute("ANALYZE run_events")


def test_the_run_lists_estimate_is_the_partitions_when_the_table_itself_was_never_analyzed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from django.test.utils import CaptureQueriesContext

    from runs.admin import RunPaginator

    job = make_job()
    now = timezone.now()
    for i in range(30):
        make_run(job, now - timedelta(hours=i + 1), status=Run.Status.SUCCEEDED, finished_at=now)
    make_run(job, now + timedelta(hours=1))
    analyze_as_autovacuum_does()
    monkeypatch.setattr(RunPaginator, "ESTIMATE_FROM", 10)
    with CaptureQueriesContext(connection) as captured:
        count = RunPaginator(Run.objects.all(), 100).count
    assert count == 31
    assert not [q["sql"] for q in captured.captured_queries if "COUNT(" in q["sql"].upper()]


def test_no_statement_reads_all_of_runs_with_history_in_it(operator_client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    now = timezone.now()
    owner = Service("reports")
    jobs = fill_history(owner.user, now)
    open_and_rare_runs(jobs, now)
    analyze_as_autovacuum_does()
    # ... and as the daily prune_runs does: it analyzes the partitioned table itself
    # (runs.ops._analyze_partitioned_runs), which autovacuum never does, at most once
    # an hour in a process: the clock says an hour has passed since an earlier test's.
    monkeypatch.setattr(ops, "_ANALYZED_AT", [])
    ops.prune_runs(older_than=timedelta(days=3650))
    parts = list(range(16))

    def recovery() -> None:
        with transaction.atomic():
            claims.count_queued(partitions=parts)
            claims.release_expired_leases(partitions=parts, now=now, limit=200)
            claims.touch_unclaimed(partitions=parts, now=now, older_than=timedelta(seconds=30), limit=200)
            claims.claimed_up_to(partitions=parts, since=now - timedelta(seconds=30))

    def pages() -> None:
        for url in ("/admin/", "/admin/system/", "/admin/runs/run/"):
            assert operator_client.get(url).status_code == 200, url
        for query in ("dead=unhandled", "dead=all", "due=now", "due=soon", "hold=pause", "status__exact=running",
                      "status__exact=queued", "status__exact=scheduled", "status__exact=skipped"):
            assert operator_client.get(f"/admin/runs/run/?{query}").status_code == 200, query
        assert operator_client.get("/metrics").status_code == 200
        for status in ("", *S.values):
            assert owner.get("/api/runs/", **({"status": status} if status else {})).status_code == 200, status

    statements: list[tuple[str, Any]] = []
    statements += sent_while(lambda: probe.next_work(parts, notices=True))
    statements += sent_while(lambda: scan.scan_once(partitions=parts, publish=False))
    statements += sent_while(recovery)
    statements += sent_while(pages)
    statements += sent_while(lambda: call_command("prune_runs", "--older-than", "90d", "--dry-run"))
    assert len(statements) > 30, "the paths above send their statements"

    whole = {}
    for sql, params in statements:
        plan = plan_of(sql, params)
        if reads_history(plan) and sql not in WHOLE_BY_DESIGN:
            whole[sql] = plan
    assert not whole, "\n\n".join(f"{sql}\n{plan}" for sql, plan in whole.items())
