"""The writer census: every path that makes a run waiting, or due sooner, is found by
the next scan with no help from its writer, and with the scanner's periodic floor
drop switched off.

A scanner reads each partition's waiting runs from after the last run it took there
(its floor). A run that turns waiting behind the floor is found only if the store
says so: the triggers' notification carries its due time (migrations runs 0011, 0018,
0020) and the scanner lowers the floor to it. Each path below is driven through the
product's own function, after a scan has raised the partition's floor above the run's
due time; then the next scan, with the floors the scanner command keeps and its
periodic drop off, must take it.

The census also reads the code: every place in `jobs`, `runs` and `scanners` that
writes `due_at`, sets a run's status to `scheduled` or releases a held run is listed in
WRITERS with the path that drives it (or why it makes no run waiting). A new place
fails `test_every_writer_of_a_waiting_run_is_in_the_census` until it is listed, and so
driven here.

Real PostgreSQL, its triggers, the scanner's listener on a connection of its own.
"""
from __future__ import annotations

import ast
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings
from django.utils import timezone

from jobs.models import Job
from jobs.ops import job_trigger
from jobs.services import job_backfill, job_create, job_pause, job_resume, job_update
from runs import claims, nextrun, ops, outcomes, services
from runs.delivery import CallResult
from runs.models import Run
from scanners.management.commands import scanner as scanner_command
from scanners.management.commands.scanner import Command
from scanners.scan import scan_once
from scanners.shares import ShareFloors
from scanners.wakeups import Listener
from tests.factories import expire_lease, make_job, make_run

S = Run.Status
ROOT = Path(__file__).resolve().parents[2]
YEARLY = "0 3 1 1 *"  # a job whose own next time is far off: only the path's run is due

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(connection.vendor != "postgresql", reason="the triggers and the listener: PostgreSQL"),
]


class Scanner:
    """The scanner command's floors, its listener for real, its periodic drop off."""

    def __init__(self, listener: Listener) -> None:
        self.listener = listener
        self.command = Command.__new__(Command)
        self.command.listener, self.command.floors = listener, {}
        self.command.floors_dropped_at = time.monotonic()
        self.command.share_floors = ShareFloors()
        self.later = claims.store_now() + timedelta(seconds=120)  # every scan's clock

    def raise_floor(self, partition: int) -> None:
        """A scan takes a run due 90 s from now: the partition's floor is above every
        run a path below makes waiting."""
        pacer = make_run(make_job(name="pacer", schedule=YEARLY), self.later - timedelta(seconds=30),
                         partition=partition)
        self.scan(partition)
        assert self.command.floors[partition] >= (pacer.due_at, pacer.pk)
        self.listener.take_lowered()  # what the pacer's own insert notified

    def scan(self, partition: int) -> Any:
        self.command._lower_floors(full=False)
        return scan_once(partitions=[partition], now=self.later, publish=False, floors=self.command.floors)

    def notified(self, partition: int, wait: float = 5.0) -> bool:
        """The listener has a due time for the partition (not taken: _lower_floors takes it)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            with self.listener._lock:
                if partition in self.listener._lowered:
                    return True
            time.sleep(0.02)
        return False


@pytest.fixture
def scanner(transactional_db: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Scanner]:
    monkeypatch.setattr(scanner_command, "FLOORS_DROP_EVERY", float("inf"))  # the periodic drop: off
    listener = Listener.for_scanner("census", lambda: None)
    assert listener is not None
    listener.partitions = frozenset(range(64))
    try:
        assert listener.listening.wait(10)
        listener.take_lowered()
        with override_settings(SCHEDULER_MISFIRE_GRACE=3600):  # a late run is still queued, not skipped
            yield Scanner(listener)
    finally:
        listener.stop()


# ------------------------------------------------------------------ the paths


def far_job(**fields: Any) -> Job:
    values: dict[str, Any] = {"name": "census", "schedule": YEARLY, "target": "http://127.0.0.1:9/census",
                              "retry_max": 3, "retry_base_seconds": 1, "retry_backoff": "fixed"}
    values.update(fields)
    owner = make_job().owner
    return job_create(owner=owner, fields=values)


def own_run(job: Job) -> Run:
    return Run.objects.get(job=job, status__in=(S.SCHEDULED, S.QUEUED, S.RUNNING))


def claimed(run: Run, s: Scanner) -> tuple[Run, claims.Claim]:
    """The run queued and claimed, as a scan and a worker would."""
    now = claims.store_now()
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, due_at=now - timedelta(seconds=1), queued_at=now)
    [claim] = claims.claim_many(run_ids=[run.pk], worker="census", lease=services.lease_length())
    return Run.objects.select_related("job").get(pk=run.pk), claim


def outcome(run: Run, claim: claims.Claim, result: CallResult) -> None:
    """The worker's outcome write for one ended call (runs.services)."""
    assert outcomes.run_record_outcomes([outcomes.Call(run=run, claim=claim, result=result)])


def path_next_run(s: Scanner) -> int:
    job = far_job(schedule="", every_seconds=30)
    run, claim = claimed(own_run(job), s)
    s.raise_floor(job.partition)
    outcome(run, claim, CallResult(status=200, duration_ms=3))
    return Run.objects.get(job=job, status=S.SCHEDULED).pk


def path_retry_outcome(s: Scanner) -> int:
    job = far_job()
    run, claim = claimed(own_run(job), s)
    s.raise_floor(job.partition)
    outcome(run, claim, CallResult(status=503, duration_ms=3))
    assert Run.objects.get(pk=run.pk).status == S.SCHEDULED
    return run.pk


def path_retry_row_by_row(s: Scanner) -> int:
    job = far_job()
    run, claim = claimed(own_run(job), s)
    s.raise_floor(job.partition)
    assert claims.schedule_retry(run_id=run.pk, fence=claim.fence, due_at=claims.store_now(), error="HTTP 503")
    return run.pk


def path_deferral(s: Scanner) -> int:
    job = far_job()
    run = own_run(job)
    now = claims.store_now()
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, due_at=now, queued_at=now)
    s.raise_floor(job.partition)
    run = Run.objects.select_related("job").get(pk=run.pk)
    assert services._defer_many([(run, now + timedelta(seconds=1), {})], now, "bulkhead_wait") == {
        run.pk: "bulkhead_wait"}
    return run.pk


def dead_run(s: Scanner) -> Run:
    job = far_job()
    run = own_run(job)
    Run.objects.filter(pk=run.pk).update(status=S.DEAD, finished_at=timezone.now(), attempt=1)
    s.raise_floor(job.partition)
    return Run.objects.select_related("job").get(pk=run.pk)


def path_requeue_dead(s: Scanner) -> int:
    run = dead_run(s)
    assert ops.run_requeue_dead(run=run)
    return run.pk


def path_api_retry(s: Scanner) -> int:
    run = dead_run(s)
    return ops.run_retry(run=run).pk


def path_reopen(s: Scanner) -> int:
    job = far_job()
    run = own_run(job)
    when = claims.store_now().replace(microsecond=0) - timedelta(minutes=5)
    cancelled = make_run(job, when, status=S.CANCELLED, finished_at=timezone.now(), is_backfill=True)
    Run.objects.filter(pk=run.pk).update(status=S.CANCELLED, finished_at=timezone.now())
    s.raise_floor(job.partition)
    return nextrun.run_reopen(run=Run.objects.get(pk=cancelled.pk), job=job, now=timezone.now(), held=False).pk


def path_resume(s: Scanner) -> int:
    job = far_job()
    job_pause(job=job)
    run = own_run(job)
    Run.objects.filter(pk=run.pk).update(due_at=claims.store_now())
    s.raise_floor(job.partition)
    job_resume(job=Job.objects.get(pk=job.pk))
    assert not Run.objects.get(pk=run.pk).held
    return run.pk


def path_target_resume(s: Scanner) -> int:
    job = far_job(target="http://census-host.test/x")
    run = own_run(job)
    Run.objects.filter(pk=run.pk).update(due_at=claims.store_now())
    ops.target_pause(host="census-host.test")
    assert Run.objects.get(pk=run.pk).held
    s.raise_floor(job.partition)
    ops.target_resume(host="census-host.test")
    return run.pk


def path_backfill(s: Scanner) -> int:
    job = far_job(schedule="0 * * * *")
    Job.objects.filter(pk=job.pk).update(created_at=timezone.now() - timedelta(days=2))
    s.raise_floor(job.partition)
    when = claims.store_now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    [run] = job_backfill(job=Job.objects.get(pk=job.pk), times=[when])
    return run.pk


def path_run_now(s: Scanner) -> int:
    job = far_job()
    s.raise_floor(job.partition)
    return job_trigger(job=job, via="command").pk


def path_create(s: Scanner) -> int:
    # The job's partition is its id's: a job made first tells which the one after the
    # floor's own (raise_floor makes one) takes.
    probe = make_job(name="partition probe", schedule=YEARLY)
    partition = (probe.pk + 2) % 16
    s.raise_floor(partition)
    job = job_create(owner=probe.owner, fields={"name": "one-off", "schedule": "", "target": "http://127.0.0.1:9/",
                                                "run_at": claims.store_now().replace(microsecond=0)})
    assert job.partition == partition, "another job was made meanwhile"
    return own_run(job).pk


def path_schedule_edit(s: Scanner) -> int:
    job = far_job()
    s.raise_floor(job.partition)
    job_update(job=job, fields={"schedule": "* * * * *"})
    return own_run(job).pk


def path_window_edit(s: Scanner) -> int:
    when = (claims.store_now() + timedelta(seconds=40)).replace(microsecond=0)
    job = far_job(schedule="", run_at=when, window_seconds=3600)
    run = own_run(job)
    if run.due_at == when:  # spread to the window's very start: give it an offset
        Run.objects.filter(pk=run.pk).update(due_at=when + timedelta(seconds=600))
    s.raise_floor(job.partition)
    job_update(job=job, fields={"window_seconds": 0})
    assert Run.objects.get(pk=run.pk).due_at == when
    return run.pk


def path_buffered_overlap(s: Scanner) -> int:
    past = claims.store_now() - timedelta(minutes=3)
    job = far_job(schedule="* * * * *", overlap="buffer_one")
    Job.objects.filter(pk=job.pk).update(timing_changed_at=None)
    run = own_run(job)
    when = past.replace(second=0, microsecond=0)
    Run.objects.filter(pk=run.pk).update(scheduled_for=when, due_at=when)
    run, claim = claimed(Run.objects.get(pk=run.pk), s)
    claim = replace(claim, started_at=when)  # in flight since its time: two more have passed since
    s.raise_floor(job.partition)
    outcome(run, claim, CallResult(status=200, duration_ms=3))
    return Run.objects.get(job=job, status=S.SCHEDULED).pk


def path_lease_expiry(s: Scanner) -> int:
    job = far_job()
    run, claim = claimed(own_run(job), s)
    s.raise_floor(job.partition)
    expire_lease(run.pk)
    return run.pk


def path_paused_until(s: Scanner) -> int:
    job = far_job()
    job_pause(job=job)
    run = own_run(job)
    Run.objects.filter(pk=run.pk).update(due_at=claims.store_now())
    s.raise_floor(job.partition)
    Job.objects.filter(pk=job.pk).update(paused_until=claims.store_now())
    return run.pk


@dataclass(frozen=True)
class Path:
    make: Callable[[Scanner], int]
    # The store notifies the run's due time (else the scan does the work itself: a
    # lease it recovers, a resume time it reaches).
    notified: bool = True


PATHS: dict[str, Path] = {
    "next run": Path(path_next_run),
    "retry outcome": Path(path_retry_outcome),
    "retry outcome, row by row": Path(path_retry_row_by_row),
    "deferral": Path(path_deferral),
    "requeue of a dead run": Path(path_requeue_dead),
    "retry of a dead run": Path(path_api_retry),
    "reopen": Path(path_reopen),
    "resume": Path(path_resume),
    "release of a paused target": Path(path_target_resume),
    "backfill": Path(path_backfill),
    "run now": Path(path_run_now),
    "create": Path(path_create),
    "schedule edit": Path(path_schedule_edit),
    "window edit": Path(path_window_edit),
    "buffered overlap": Path(path_buffered_overlap),
    "lease expiry": Path(path_lease_expiry, notified=False),
    "paused_until passes": Path(path_paused_until, notified=False),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_the_next_scan_takes_the_run_each_path_makes_waiting_behind_the_floor(scanner: Scanner, name: str) -> None:
    path = PATHS[name]
    run_id = path.make(scanner)
    partition = Run.objects.get(pk=run_id).partition
    floor = scanner.command.floors[partition]
    assert Run.objects.get(pk=run_id).due_at < floor[0], "the run is not behind the floor: the census proves nothing"
    if path.notified:
        assert scanner.notified(partition), f"{name}: the store sent no due time for partition {partition}"
    result = scanner.scan(partition)
    taken = set(result.queued) | set(result.lease_expired)
    assert run_id in taken, f"{name}: the next scan did not take run {run_id} ({Run.objects.get(pk=run_id).status})"


def test_without_the_move_back_trigger_the_census_finds_the_requeued_run_missed(scanner: Scanner) -> None:
    """The census can fail: with migration runs 0020's trigger gone, a requeued dead run
    behind the floor is not taken by the next scan (the trigger is put back after)."""
    from importlib import import_module

    trigger = import_module("runs.migrations.0020_wake_moved_back")
    with connection.cursor() as cursor:
        cursor.execute("DROP TRIGGER runs_wake_scanner_moved_back ON runs")
    try:
        run_id = path_requeue_dead(scanner)
        assert not scanner.notified(Run.objects.get(pk=run_id).partition, wait=1.0)
        assert run_id not in scanner.scan(Run.objects.get(pk=run_id).partition).queued
    finally:
        with connection.cursor() as cursor:
            create = [s for s in trigger.FORWARD.split("\n\n") if s.strip().startswith("CREATE TRIGGER")]
            cursor.execute(create[0])


# ------------------------------------------------------------------ the code's writers

# Every place that writes due_at, sets a run's status to scheduled, or releases a
# held run (module:function, as the code has it), with the census path that drives
# it, or why no run is made waiting there.
NOT_WAITING_HELD = "made held: waiting for a resume, which is a path"
NOT_WAITING_SKIPPED = "a skipped row: never waiting"
NOT_RUNS = "a notice's due time, not a run's"
WRITERS: dict[str, str] = {
    "jobs/ops.py:job_trigger": "run now",
    "jobs/services.py:_replace_waiting_run": "window edit",
    "jobs/services.py:job_pause": NOT_WAITING_HELD,
    "jobs/services.py:job_resume": "resume",
    "runs/claims.py:<module>": "retry outcome",  # OUTCOMES_SQL
    "runs/claims.py:schedule_retry": "retry outcome, row by row",
    "runs/claims.py:defer_many": "deferral",
    "runs/notices.py:_send_job": NOT_RUNS,
    "runs/notices.py:_failed": NOT_RUNS,
    "runs/ops.py:_requeue_locked": "requeue of a dead run",
    "runs/ops.py:target_pause": NOT_WAITING_HELD,
    "runs/ops.py:target_resume": "release of a paused target",
    "runs/nextrun.py:run_create": "backfill",
    "runs/nextrun.py:excluded_times_skip": NOT_WAITING_SKIPPED,
    "runs/nextrun.py:_open_row": "next run",
    "runs/bulk.py:<module>": "next run",  # COPY_RUNS_SQL: the next runs' inserts
    "runs/nextrun.py:_skip_overlapped": NOT_WAITING_SKIPPED,
    "runs/nextrun.py:run_reopen": "reopen",
    "runs/outcomes.py:_decide": "retry outcome",
    "scanners/scan.py:_stop_runs_of_stopped_jobs": NOT_WAITING_HELD,
    "scanners/scan.py:_skip_times": NOT_WAITING_SKIPPED,
}
SQL_WRITE = re.compile(
    r"(?is)\b(update\s+runs\b.*\bset\b.*(\bdue_at\s*=|\bstatus\s*=\s*'scheduled'|\bheld\s*=\s*false)"
    r"|insert\s+into\s+runs\b|copy\s+runs\b)")
WRITE_CALLS = {"update", "create", "bulk_create", "get_or_create", "update_or_create", "Run", "Outcome", "_open_row"}


def _is_scheduled(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "SCHEDULED") or (
        isinstance(node, ast.Constant) and node.value == "scheduled")


def _is_false(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def writers_in_the_code() -> dict[str, int]:
    """module:function -> the first line, for every write found in the product's code."""
    found: dict[str, int] = {}
    for app in ("jobs", "runs", "scanners"):
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" not in path.parts:
                found.update(writers_in(path.read_text(), str(path.relative_to(ROOT))))
    return found


def writers_in(source: str, module: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for function, node in _walk(ast.parse(source)):
        key = f"{module}:{function}"
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in WRITE_CALLS and any(
                k.arg == "due_at" or (k.arg == "status" and _is_scheduled(k.value))
                or (k.arg == "held" and _is_false(k.value)) for k in node.keywords
            ):
                found.setdefault(key, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and SQL_WRITE.search(node.value):
            found.setdefault(key, node.lineno)
    return found


def _walk(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every node with the name of the outermost function (or `<module>`) it is in."""
    def visit(node: ast.AST, function: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and function == "<module>":
                inner = child.name
            yield inner, child
            yield from visit(child, inner)
    yield from visit(tree, "<module>")


def test_every_writer_of_a_waiting_run_is_in_the_census() -> None:
    found = writers_in_the_code()
    new = sorted(set(found) - set(WRITERS))
    assert not new, (
        "these write due_at, a scheduled status or a release, and are not in the census: add each to WRITERS "
        f"with the path (PATHS) that drives it, or why it makes no run waiting: {[f'{k}:{found[k]}' for k in new]}")
    gone = sorted(set(WRITERS) - set(found))
    assert not gone, f"no longer in the code: take them out of WRITERS: {gone}"
    reasons = {NOT_WAITING_HELD, NOT_WAITING_SKIPPED, NOT_RUNS}
    assert {v for v in WRITERS.values() if v not in reasons} <= set(PATHS)


def test_the_census_reading_of_the_code_finds_each_kind_of_writer() -> None:
    """The reading is not blind: an ORM update of a due time, a release, a run made
    scheduled, and SQL that does either, each in a function of its own, are found."""
    source = (
        "def sooner(run):\n    Run.objects.filter(pk=run.pk).update(due_at=now)\n"
        "def release(ids):\n    Run.objects.filter(pk__in=ids).update(held=False)\n"
        "class Ops:\n    def again(self, run):\n        Run.objects.filter(pk=run).update(status=S.SCHEDULED)\n"
        "def raw(cursor):\n    cursor.execute(\"UPDATE runs SET due_at = %s WHERE id = %s\")\n"
        "def reads(run):\n    return Run.objects.filter(status=S.SCHEDULED, held=False, due_at__lte=now)\n"
    )
    assert set(writers_in(source, "m.py")) == {"m.py:sooner", "m.py:release", "m.py:again", "m.py:raw"}


def test_a_run_found_only_by_the_periodic_floor_drop_is_counted_in_metrics(scanner: Scanner) -> None:
    """A path that skips its wake-up (here: a write with the store's triggers off) is
    found by the periodic floor drop alone, and /metrics says so."""
    from runs.metrics import render_metrics

    job = far_job()
    run = own_run(job)
    scanner.raise_floor(job.partition)
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")  # no trigger fires: no wake-up
        try:
            Run.objects.filter(pk=run.pk).update(due_at=claims.store_now())
        finally:
            cursor.execute("SET session_replication_role = DEFAULT")
    assert not scanner.notified(job.partition, wait=0.5)
    assert run.pk not in scanner.scan(job.partition).queued  # behind the floor: not seen

    scanner.command.floors_dropped_at = float("-inf")  # the timer says: drop them
    scanner_command.FLOORS_DROP_EVERY = 5.0
    result = scanner.scan(job.partition)
    scanner.command._count_found_by_drop(result)

    assert run.pk in result.queued
    assert "scheduler_runs_found_by_floor_drop_total 1" in render_metrics().splitlines()


def test_a_late_run_left_because_an_edit_holds_its_job_stays_above_the_floor(scanner: Scanner) -> None:
    """A late run's misfire policy reads its job under a lock (NOWAIT); while an edit
    holds the job the scan leaves the run as it is. The floor stays below it, so the
    next scan takes it, with nothing notified and the periodic drop off."""
    from django.db import transaction

    job = far_job(schedule="* * * * *", misfire="run_once")
    run = own_run(job)
    late = claims.store_now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    Run.objects.filter(pk=run.pk).update(scheduled_for=late, due_at=late)
    locked, release = threading.Event(), threading.Event()

    def edit() -> None:
        try:
            with transaction.atomic():
                Job.objects.select_for_update().get(pk=job.pk)
                locked.set()
                release.wait(10)
        finally:
            connection.close()

    editor = threading.Thread(target=edit)
    editor.start()
    try:
        assert locked.wait(10)
        with override_settings(SCHEDULER_MISFIRE_GRACE=60):  # late: the policy reads the job
            scanner.listener.take_lowered()
            result = scanner.scan(job.partition)
        assert run.pk in result.left and run.pk not in result.queued
        floor = scanner.command.floors.get(job.partition)
        assert floor is None or floor < (late, run.pk)
    finally:
        release.set()
        editor.join(10)
    with override_settings(SCHEDULER_MISFIRE_GRACE=60):
        assert run.pk in scanner.scan(job.partition).queued
