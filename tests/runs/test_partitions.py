"""The runs history's time partitions (runs.partitions, runs.retention; PostgreSQL).

An ended run's key is its scheduled time: each partition holds the ended runs of one
span of times, made ahead by the upkeep; prune_runs drops a partition whose runs all
finished before the cutoff, with their events and notices, and never an open run.
"""
from __future__ import annotations

import io
import re
from datetime import timedelta
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import IntegrityError, connection, transaction
from django.test import override_settings
from django.utils import timezone

from jobs.models import AuditEntry
from runs import claims, events, ops, partitions, retention, timeline
from runs.models import Notice, Run, RunEvent
from tests.factories import drop_time_partitions, make_job, make_run, utc
from tests.runs.test_moved_rows import race

S = Run.Status
DAY = timedelta(days=1)

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the history is partitioned on PostgreSQL only"),
]


@pytest.fixture(autouse=True)
def no_time_partitions(transactional_db: None) -> Any:
    """Partitions are tables: the flush between tests empties them but keeps them."""
    drop_time_partitions()
    yield
    drop_time_partitions()


def table_of(run: Run) -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT tableoid::regclass::text FROM runs WHERE id = %s", [run.pk])
        return cursor.fetchone()[0]


def ended(job: Any, when: Any, finished: Any, *, status: str = S.SUCCEEDED, events: int = 1) -> Run:
    run = make_run(job, when, status=status, finished_at=finished)
    for _ in range(events):
        RunEvent.objects.create(run=run, at=finished, type="retry_scheduled", detail={})
    return run


def test_the_partitions_of_now_and_ahead_are_made_once_and_the_check_says_when_one_is_missing() -> None:
    now = utc("2026-12-06T10:00:00Z")
    assert [s.name for s in partitions.missing(now, 2)] == [
        "runs_p20261206_0000", "runs_p20261207_0000", "runs_p20261208_0000"]
    made = partitions.make_ahead(now, 2)
    assert [(s.start, s.end) for s in made] == [
        (utc("2026-12-06T00:00:00Z") + i * DAY, utc("2026-12-07T00:00:00Z") + i * DAY) for i in range(3)]
    assert partitions.make_ahead(now, 2) == [] and partitions.missing(now, 2) == []
    assert [s.name for s in partitions.spans()] == [s.name for s in made]
    # The next day's is missing until made.
    assert [s.name for s in partitions.missing(now + DAY, 2)] == ["runs_p20261209_0000"]


def test_the_command_makes_them_and_its_check_fails_loudly_on_a_missing_one() -> None:
    with pytest.raises(CommandError, match=r"no runs partition for \[\d{4}-\d\d-\d\dT00:00Z"):
        call_command("run_partitions", "--check", stdout=io.StringIO())
    out = io.StringIO()
    call_command("run_partitions", "--ahead", "1", stdout=out)
    assert out.getvalue().count("made runs_p") == 2
    call_command("run_partitions", "--check", "--ahead", "1", stdout=io.StringIO())
    with pytest.raises(CommandError, match="no runs partition"):
        call_command("run_partitions", "--check", "--ahead", "2", stdout=io.StringIO())


def test_a_run_that_ends_moves_into_its_times_partition_and_back_when_requeued() -> None:
    when = utc("2026-12-06T09:00:00Z")
    partitions.make_ahead(when, 1)
    run = make_run(make_job(), when, status=S.QUEUED, queued_at=timezone.now())
    assert table_of(run) == "runs_open"
    Run.objects.filter(pk=run.pk).update(status=S.DEAD, finished_at=timezone.now())
    assert table_of(run) == "runs_p20261206_0000"
    assert ops.run_requeue_dead(run=Run.objects.get(pk=run.pk))
    assert table_of(run) == "runs_open"


def test_a_new_partition_takes_its_span_out_of_the_default_partition() -> None:
    job = make_job()
    far = ended(job, utc("2027-03-01T08:00:00Z"), utc("2026-12-06T10:00:00Z"), status=S.CANCELLED)
    other = ended(job, utc("2027-03-02T08:00:00Z"), utc("2026-12-06T10:00:00Z"), status=S.CANCELLED)
    assert table_of(far) == table_of(other) == "runs_history"
    partitions.make(partitions.span_at(far.scheduled_for))
    assert (table_of(far), table_of(other)) == ("runs_p20270301_0000", "runs_history")
    assert Run.objects.get(pk=far.pk).status == S.CANCELLED and RunEvent.objects.filter(run_id=far.pk).count() == 1


def test_an_open_run_and_an_ended_one_at_one_time_still_clash_across_a_day_partition() -> None:
    when = utc("2026-12-06T09:00:00Z")
    partitions.make_ahead(when, 0)
    job = make_job()
    ended(job, when, utc("2026-12-06T09:00:05Z"))
    with pytest.raises(IntegrityError, match="runs_one_run_per_time"), transaction.atomic():
        make_run(job, when)


def test_prune_drops_a_whole_old_partition_with_its_events_and_notices_and_keeps_the_rest() -> None:
    now = utc("2026-12-06T10:00:00Z")
    job = make_job()
    for day in ("2026-08-01", "2026-08-02", "2026-09-20"):
        partitions.make(partitions.span_at(utc(f"{day}T00:00:00Z")))
    old = [ended(job, utc(f"2026-08-01T0{h}:00:00Z"), utc(f"2026-08-01T0{h}:00:09Z"), status=S.DEAD) for h in (1, 2)]
    Notice.objects.create(job=job, run=old[0], kind="dead", created_at=old[0].finished_at, due_at=old[0].finished_at,
                          status=Notice.Status.SENT)
    kept_young = ended(job, utc("2026-09-20T01:00:00Z"), utc("2026-09-20T01:00:05Z"))
    open_old = make_run(job, utc("2026-08-02T01:00:00Z"), is_backfill=True)  # open: never pruned
    result = ops.prune_runs(older_than=timedelta(days=90), now=now)
    assert result.dropped == ("runs_p20260801_0000", "runs_p20260802_0000")
    assert (result.runs, result.events) == (2, 2)
    assert not Run.objects.filter(pk__in=[r.pk for r in old]).exists()
    assert not RunEvent.objects.filter(run_id__in=[r.pk for r in old]).exists()
    assert not Notice.objects.filter(run_id=old[0].pk).exists()
    assert Run.objects.filter(pk__in=[kept_young.pk, open_old.pk]).count() == 2
    assert RunEvent.objects.filter(run_id=kept_young.pk).count() == 1
    # The empty partition of 2026-08-02 went too (nothing in it finished late); 09-20 is young.
    assert [s.name for s in partitions.spans()] == ["runs_p20260920_0000"]
    entry = AuditEntry.objects.get(action="pruned")
    assert entry.detail["partitions dropped"] == ["runs_p20260801_0000", "runs_p20260802_0000"]


def test_a_partition_holding_a_run_that_finished_after_the_cutoff_is_kept_whole_by_the_upkeep() -> None:
    """The retention upkeep never prunes a time partition row by row (every few
    minutes, that would be a steady load of row deletes): it waits until the
    partition's last run finished before the cutoff, then drops it."""
    now = utc("2026-12-06T10:00:00Z")
    job = make_job()
    partitions.make(partitions.span_at(utc("2026-08-01T00:00:00Z")))
    early = ended(job, utc("2026-08-01T01:00:00Z"), utc("2026-08-01T01:00:09Z"))
    # Late: scheduled on 08-01, it ended yesterday (a paused job's run, cancelled now).
    late = ended(job, utc("2026-08-01T02:00:00Z"), now - DAY, status=S.CANCELLED)
    whole = {"older_than": timedelta(days=90), "whole_partitions_only": True}
    assert ops.prune_runs(now=now, dry_run=True, **whole).runs == 0
    result = ops.prune_runs(now=now, **whole)
    assert result.dropped == () and (result.runs, result.events) == (0, 0)
    assert set(Run.objects.filter(job=job).values_list("pk", flat=True)) == {early.pk, late.pk}
    assert not AuditEntry.objects.filter(action="pruned").exists()
    later = now + timedelta(days=90)  # the late run finished a day before `now`: now past the cutoff too
    dry = ops.prune_runs(now=later, dry_run=True, **whole)
    assert (dry.runs, dry.events) == (2, 2)
    result = ops.prune_runs(now=later, **whole)
    assert result.dropped == ("runs_p20260801_0000",) and (result.runs, result.events) == (2, 2)
    assert not Run.objects.filter(job=job).exists()


def test_the_command_prunes_such_a_partitions_old_runs_row_by_row_and_keeps_the_late_one() -> None:
    """`prune_runs --older-than` (docs/reference.md, commands: it deletes the finished runs
    older than that) drops what it can whole, then deletes every old run left, by rows."""
    now = timezone.now()
    job = make_job()
    day = partitions.span_at(now - timedelta(days=120))
    partitions.make(day)
    early = ended(job, day.start + timedelta(hours=1), day.start + timedelta(hours=1, seconds=9))
    late = ended(job, day.start + timedelta(hours=2), now - DAY, status=S.CANCELLED)
    out = io.StringIO()
    call_command("prune_runs", "--older-than", "90d", stdout=out)
    assert out.getvalue().startswith("deleted 1 finished run(s) and 1 event(s)")
    assert not Run.objects.filter(pk=early.pk).exists() and Run.objects.filter(pk=late.pk).exists()
    assert [s.name for s in partitions.spans()] == [day.name]


@pytest.mark.parametrize("whole_partitions_only", [False, True])
def test_the_default_partition_is_pruned_row_by_row_and_a_dry_run_counts_both(whole_partitions_only: bool) -> None:
    now = utc("2026-12-06T10:00:00Z")
    job = make_job()
    partitions.make(partitions.span_at(utc("2026-08-01T00:00:00Z")))
    in_day = ended(job, utc("2026-08-01T01:00:00Z"), utc("2026-08-01T01:00:09Z"))
    in_default = [ended(job, utc(f"2026-07-0{d}T01:00:00Z"), utc(f"2026-07-0{d}T01:00:09Z")) for d in (1, 2, 3)]
    young_default = ended(job, utc("2026-11-01T01:00:00Z"), utc("2026-11-01T01:00:09Z"))
    assert {table_of(r) for r in in_default} == {"runs_history"}
    mode = {"older_than": timedelta(days=90), "whole_partitions_only": whole_partitions_only}
    dry = ops.prune_runs(now=now, dry_run=True, **mode)
    assert (dry.runs, dry.events) == (4, 4) and Run.objects.filter(job=job).count() == 5
    result = ops.prune_runs(now=now, batch=2, **mode)
    assert (result.runs, result.events, result.dropped) == (4, 4, ("runs_p20260801_0000",))
    assert list(Run.objects.filter(job=job).values_list("pk", flat=True)) == [young_default.pk]
    assert not RunEvent.objects.filter(run_id__in=[in_day.pk, *[r.pk for r in in_default]]).exists()


def test_a_run_that_ends_into_the_partition_while_it_is_dropped_keeps_it() -> None:
    """The drop checks again once `runs` is its own: an outcome that moved a run of the
    partition's times into it meanwhile (committed while the drop waited) keeps it."""
    now = timezone.now()
    old_day = now - timedelta(days=120)
    partitions.make(partitions.span_at(old_day))
    job = make_job()
    gone = ended(job, old_day, old_day + timedelta(minutes=1))
    # A run of that day still open (a paused job's), ending now.
    late = make_run(job, old_day + timedelta(seconds=1), is_backfill=True)
    dropped = race(
        move=lambda: Run.objects.filter(pk=late.pk).update(status=S.CANCELLED, finished_at=timezone.now()),
        write=lambda: partitions.drop_older_than(now - timedelta(days=90)),
    )
    assert dropped == []
    assert set(Run.objects.filter(job=job).values_list("pk", flat=True)) == {gone.pk, late.pk}
    assert RunEvent.objects.filter(run_id=gone.pk).count() == 1  # its deletes were given up with the drop


@override_settings(SCHEDULER_RUN_PARTITION_WIDTH="10m", SCHEDULER_RUN_PARTITIONS_AHEAD=2,
                   SCHEDULER_RUN_RETENTION="30m")
def test_the_upkeep_makes_minute_partitions_ahead_and_drops_them_past_the_retention() -> None:
    t0 = utc("2026-12-06T10:03:00Z")
    job = make_job()
    kept = retention.keep(t0)
    assert [s.name for s in kept.made] == ["runs_p20261206_1000", "runs_p20261206_1010", "runs_p20261206_1020"]
    first = ended(job, utc("2026-12-06T10:04:00Z"), utc("2026-12-06T10:04:01Z"))
    assert table_of(first) == "runs_p20261206_1000"
    kept = retention.keep(t0 + timedelta(minutes=41))  # 10:44: 10:00-10:10 ended 34 minutes ago
    assert kept.dropped == ["runs_p20261206_1000"] and kept.pruned_runs == 1 and kept.missing == []
    assert [s.name for s in kept.made] == ["runs_p20261206_1040", "runs_p20261206_1050", "runs_p20261206_1100"]
    assert not Run.objects.filter(pk=first.pk).exists()


@override_settings(SCHEDULER_RUN_RETENTION="off")
def test_a_retention_of_off_prunes_nothing() -> None:
    job = make_job()
    run = ended(job, utc("2020-01-01T00:00:00Z"), utc("2020-01-01T00:00:01Z"))
    assert retention.retention() is None
    assert retention.keep(utc("2026-12-06T10:00:00Z")).pruned_runs == 0
    assert Run.objects.filter(pk=run.pk).exists()


def test_an_upkeep_is_skipped_while_another_one_is_at_it() -> None:
    import psycopg

    params = connection.get_connection_params()
    other = psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "host", "port", "password")},
                            autocommit=True)
    try:
        other.execute("SELECT pg_advisory_lock(%s)", [retention.UPKEEP_LOCK])
        kept = retention.keep(utc("2026-12-06T10:00:00Z"))
        assert kept.skipped and kept.made == [] and partitions.spans() == []
        # Let go here: a closed connection's backend may outlive close() for a moment.
        other.execute("SELECT pg_advisory_unlock(%s)", [retention.UPKEEP_LOCK])
    finally:
        other.close()
    kept = retention.keep(utc("2026-12-06T10:00:00Z"))
    assert not kept.skipped and len(kept.made) == 4


def _most_rows_a_history_scan_gave(sql: str, params: Any) -> int:
    """The most rows any scan of a history partition returned per loop, under EXPLAIN ANALYZE."""
    import json

    with connection.cursor() as cursor:
        cursor.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
        plan = cursor.fetchone()[0]
    plan = json.loads(plan) if isinstance(plan, str) else plan
    most, stack = 0, [plan[0]["Plan"]]
    while stack:
        node = stack.pop()
        stack.extend(node.get("Plans", []))
        if node.get("Relation Name", "").startswith("runs_p"):
            most = max(most, node["Actual Rows"])
    return most


def test_a_jobs_latest_counted_time_reads_one_row_a_partition_not_all_its_runs() -> None:
    """The outcome's read of each job's latest counted time (runs.services
    _latest_counted), and the admin's last outcome, walk each partition's (job, key,
    time) index back from its newest row. Ordered by scheduled_for alone they read
    every run of the job in every partition and sorted them (500 a partition here)."""
    from django.test.utils import CaptureQueriesContext

    from bench.load import defaults_sql
    from jobs.admin import _last_outcome
    from jobs.models import Job
    from runs.nextrun import _latest_counted

    job = make_job()
    days = [partitions.span_at(utc(f"2026-11-0{d}T00:00:00Z")) for d in (1, 2, 3)]
    for day in days:
        partitions.make(day)
    columns, values = defaults_sql(Run, {
        "job_id": str(job.pk), "scheduled_for": "t", "due_at": "t", "partition": "0", "status": "'succeeded'",
        "finished_at": "t + interval '1 second'", "created_at": "t",
    })
    with connection.cursor() as cursor:
        for day in days:
            cursor.execute(f"INSERT INTO runs ({columns}) SELECT {values} FROM generate_series(0, 499) g, "
                           "LATERAL (SELECT %s::timestamptz + g * interval '2 minutes' AS t) s", [day.start])
        cursor.execute("ANALYZE runs")
    newest = days[-1].start + 499 * timedelta(minutes=2)
    with CaptureQueriesContext(connection) as queries:
        assert _latest_counted([job.pk]) == {job.pk: newest}
    [read] = [q["sql"] for q in queries.captured_queries if "runs" in q["sql"]]
    assert _most_rows_a_history_scan_gave(read, None) <= 1, read
    outcome = Job.objects.filter(pk=job.pk).annotate(o=_last_outcome()).values_list("o", flat=True)
    assert list(outcome) == [S.SUCCEEDED]
    sql, params = outcome.query.sql_with_params()
    assert _most_rows_a_history_scan_gave(sql, params) <= 1, sql


def test_the_worker_read_and_the_queueing_by_id_name_the_open_partition_only() -> None:
    """Statements on open runs by id must name the open key: `id IN (...)` alone is a
    probe of every partition's key index (or, with a new partition's empty figures, a
    scan of it), each message; a 30-minute run at 985 runs/s fell behind on it."""
    from django.test.utils import CaptureQueriesContext

    from runs import claims
    from runs.services import run_execute_many

    partitions.make_ahead(timezone.now(), 1)
    run = make_run(make_job(), timezone.now() + DAY)
    with CaptureQueriesContext(connection) as queries:
        assert run_execute_many(run_ids=[run.pk + 1000], worker="w1") == {run.pk + 1000: "not_claimed"}
        assert claims.mark_queued(run_ids=[run.pk], now=timezone.now(), on_row=True) == 1
    reads = [q["sql"] for q in queries.captured_queries if '"runs"' in q["sql"] and "runs_" not in q["sql"]]
    assert len(reads) == 2, reads
    for sql in reads:
        with connection.cursor() as cursor:
            cursor.execute(f"EXPLAIN {sql}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        assert "runs_open" in plan and not re.search(r"runs_p\d|runs_history", plan), plan


def event_tables(run: Run) -> set[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT DISTINCT tableoid::regclass::text FROM run_events WHERE run_id = %s", [run.pk])
        return {row[0] for row in cursor.fetchall()}


def test_a_runs_events_sit_in_its_times_twin_and_a_new_partition_takes_them_out_of_the_default() -> None:
    """run_events is partitioned by its run's scheduled time (migration runs 0019), with
    a twin of each partition of the history: a run's events sit beside its ended row."""
    job = make_job()
    far = ended(job, utc("2027-03-01T08:00:00Z"), utc("2026-12-06T10:00:00Z"), status=S.CANCELLED)
    assert event_tables(far) == {"run_events_default"}
    partitions.make(partitions.span_at(far.scheduled_for))
    assert [s.name for s in partitions.spans(partitions.EVENTS)] == ["runs_p20270301_0000"]
    assert event_tables(far) == {"run_events_p20270301_0000"}
    # Written through runs.events (the run's time read for the batch), it goes there too.
    events.record(far.pk, "requeue_refused", utc("2026-12-06T10:00:01Z"), reason="test")
    assert RunEvent.objects.filter(run_id=far.pk).count() == 2 and event_tables(far) == {"run_events_p20270301_0000"}
    assert set(RunEvent.objects.filter(run_id=far.pk).values_list("scheduled_for", flat=True)) == {far.scheduled_for}


def test_a_runs_partition_without_its_events_twin_counts_as_missing_and_the_upkeep_makes_the_twin() -> None:
    now = utc("2026-12-06T10:00:00Z")
    partitions.make_ahead(now, 1)
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE run_events_p20261207_0000")
    assert [s.name for s in partitions.missing(now, 1)] == ["runs_p20261207_0000"]
    assert [s.name for s in partitions.make_ahead(now, 1)] == ["runs_p20261207_0000"]
    assert partitions.missing(now, 1) == []
    assert [s.name for s in partitions.spans(partitions.EVENTS)] == [s.name for s in partitions.spans()]


def open_run_with_events(job: Any, when: Any) -> Run:
    """An open run of an old time (a backfill) with rows on its timeline."""
    run = make_run(job, when, is_backfill=True, held=True)
    events.record(run.pk, "held", when + timedelta(seconds=1), reason="job paused")
    events.record(run.pk, "released", when + timedelta(seconds=2), reason="job resumed")
    return run


def test_prune_drops_the_events_twin_whole_and_keeps_the_events_of_an_open_run_of_that_span() -> None:
    """Never an open run (prune_runs' rule), nor its timeline: the events of the span's open
    runs are moved to the default before the twin is dropped."""
    now = utc("2026-12-06T10:00:00Z")
    day = partitions.span_at(utc("2026-08-01T00:00:00Z"))
    partitions.make(day)
    gone = ended(make_job(), utc("2026-08-01T01:00:00Z"), utc("2026-08-01T01:00:09Z"), events=3)
    held = open_run_with_events(make_job(), utc("2026-08-01T02:00:00Z"))
    before = timeline.timeline_types(Run.objects.get(pk=held.pk))
    assert event_tables(held) == {"run_events_p20260801_0000"} and before == ["held", "released"]
    assert ops.prune_runs(older_than=timedelta(days=90), now=now, dry_run=True).events == 3
    result = ops.prune_runs(older_than=timedelta(days=90), now=now)
    assert result.dropped == (day.name,) and (result.runs, result.events) == (1, 3)
    assert not RunEvent.objects.filter(run_id=gone.pk).exists()
    assert partitions.spans(partitions.EVENTS) == [] and event_tables(held) == {"run_events_default"}
    assert timeline.timeline_types(Run.objects.get(pk=held.pk)) == before


def test_an_open_run_written_after_the_drops_read_of_open_runs_keeps_its_events(monkeypatch: Any) -> None:
    """A backfill of the span's times committed between the read of its open runs and
    the drop's last lock: found there, by the ids written since the barrier."""
    day = partitions.span_at(utc("2026-08-01T00:00:00Z"))
    partitions.make(day)
    ended(make_job(), utc("2026-08-01T01:00:00Z"), utc("2026-08-01T01:00:09Z"))
    read, late = partitions._open_runs, []

    def read_then_backfill(span: partitions.Span) -> list[int]:
        found = read(span)
        late.append(open_run_with_events(make_job(), utc("2026-08-01T03:00:00Z")))
        return found

    monkeypatch.setattr(partitions, "_open_runs", read_then_backfill)
    dropped = partitions.drop_older_than(utc("2026-12-06T10:00:00Z") - timedelta(days=90))
    assert [d.name for d in dropped] == [day.name] and late
    assert event_tables(late[0]) == {"run_events_default"}
    assert {"held", "released"} <= set(timeline.timeline_types(Run.objects.get(pk=late[0].pk)))


def test_an_open_run_being_written_when_the_drop_starts_is_waited_for_and_keeps_its_events() -> None:
    """The barrier: a backfill of the span's times not yet committed when the drop
    starts (its id below the sequence's value) is waited for, then read."""
    day = partitions.span_at(utc("2026-08-01T00:00:00Z"))
    partitions.make(day)
    ended(make_job(), utc("2026-08-01T01:00:00Z"), utc("2026-08-01T01:00:09Z"))
    job, late = make_job(), []
    dropped = race(
        move=lambda: late.append(open_run_with_events(job, utc("2026-08-01T03:00:00Z"))),
        write=lambda: partitions.drop_older_than(utc("2026-12-06T10:00:00Z") - timedelta(days=90)),
    )
    assert [d.name for d in dropped] == [day.name]
    assert event_tables(late[0]) == {"run_events_default"}
    assert {"held", "released"} <= set(timeline.timeline_types(Run.objects.get(pk=late[0].pk)))


def test_an_outcome_routed_to_the_default_partition_while_its_days_partition_is_attached_is_made_again() -> None:
    """Found in CI: the upkeep attached today's partition while a worker's outcome was
    moving a run into the history. The outcome's statement had routed the row by the
    partitions it started with (to the default), and the default's constraint, changed
    by the attach, refused it: "new row for relation runs_history violates partition
    constraint", the outcome lost and the run called again after its lease. Made again,
    the write routes the row to the new partition."""
    when = timezone.now().replace(microsecond=0)
    job = make_job()
    run = make_run(job, when, status=S.QUEUED, queued_at=timezone.now())
    [claim] = claims.claim_many(run_ids=[run.pk], worker="w", lease=timedelta(seconds=60))
    span = partitions.span_at(when)

    def end() -> set[int]:
        return claims.record_outcomes(
            [claims.Outcome(run_id=run.pk, fence=claim.fence, status=S.SUCCEEDED, now=timezone.now())])

    landed = race(lambda: partitions.make(span), end)

    assert landed == {run.pk}
    assert table_of(Run.objects.get(pk=run.pk)) == span.name
