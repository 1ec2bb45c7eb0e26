"""A real `manage.py scanner` that sleeps long is woken by what is written meanwhile
(PostgreSQL NOTIFY), still finds it by its interval when notifications are lost,
and finds each kind of recovery work at its time, not an interval late."""
from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from django.conf import settings
from django.db import connection

from jobs.models import Job
from jobs.services import job_pause, service_account_ensure
from runs import claims
from runs.models import Run
from scanners.wakeups import listen_params
from tests.factories import make_job, make_run, timeline_of
from tests.integration.conftest import Proc, Stack, wait_for

pytestmark = [pytest.mark.integration]
S = Run.Status
ALL = set(range(16))
LINE = re.compile(r"^partitions \[([\d, ]*)\] at ", re.M)
LISTENERS = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
             "AND application_name = %s AND query LIKE 'LISTEN%%'")


def owns_all(proc: Proc) -> bool:
    found = LINE.findall(proc.output())
    return bool(found) and {int(p) for p in found[-1].split(",") if p.strip()} == ALL


def listen_pids(name: str) -> list[int]:
    with connection.cursor() as cursor:
        cursor.execute(LISTENERS, [f"scanner {name} listen"])
        return [row[0] for row in cursor.fetchall()]


def sleeping_scanner(stack: Stack, name: str = "scanner-a", **env: str) -> Proc:
    """A scanner that owns every partition, listens, and has done its first scan."""
    proc = stack.scanner(name, **env)
    wait_for(lambda: owns_all(proc), 30, what="the scanner to own every partition")
    wait_for(lambda: listen_pids(name), 15, what="the scanner's LISTEN connection")
    return proc


def job() -> Job:
    owner, _ = service_account_ensure(name="wakeups")
    return make_job(owner, name="wakeups")


def seconds(a: datetime, b: datetime) -> float:
    return (a - b).total_seconds()


def event_at(run: Run, kind: str) -> datetime | None:
    return next((e.at for e in timeline_of(run) if e.type == kind), None)


def queued_at(run: Run) -> datetime | None:
    return Run.objects.filter(pk=run.pk, status=S.QUEUED).values_list("queued_at", flat=True).first()


def test_an_idle_scanner_process_makes_one_statement_per_scan_interval(stack: Stack, tmp_path: Path) -> None:
    later = claims.store_now() + timedelta(minutes=10)
    for i in range(32):
        make_run(job(), later + timedelta(seconds=i))  # none due in the next 10 minutes
    counts, interval = tmp_path / "statements", 0.5
    counts.mkdir()
    scanner = sleeping_scanner(stack, SCHEDULER_SCAN_INTERVAL=str(interval),
                               SCHEDULER_COUNT_STATEMENTS_DIR=str(counts))  # scheduler_project.statement_counter

    def statements() -> int:
        path = counts / f"{scanner.pid}.json"
        return json.loads(path.read_text())["statements"] if path.exists() else 0

    wait_for(statements, 10, what="the scanner's statement count")
    time.sleep(2)  # its first full scan is behind it
    before, started = statements(), time.monotonic()
    time.sleep(8)
    made, took = statements() - before, time.monotonic() - started
    print(f"idle scanner process: {made} statements in {took:.1f} s (SCHEDULER_SCAN_INTERVAL={interval})")
    # The count is written once a second: each reading may be a second behind.
    assert took / interval - 2 / interval <= made <= took / interval + 2 / interval, made


def test_a_run_written_while_the_scanner_sleeps_is_queued_at_its_due_time_not_an_interval_later(stack: Stack) -> None:
    scanner = sleeping_scanner(stack, SCHEDULER_SCAN_INTERVAL="30")
    lookahead = float(getattr(settings, "SCHEDULER_LOOKAHEAD", 0.0))
    took = []
    for _ in range(3):
        due = claims.store_now() + timedelta(seconds=0.3)
        run = make_run(job(), due)
        queued = wait_for(lambda r=run: queued_at(r), 5, interval=0.02, what="the run to be queued")
        took.append(seconds(queued, due))
    print(f"due -> queued with SCHEDULER_SCAN_INTERVAL=30: {', '.join(f'{t * 1000:.0f} ms' for t in took)}")
    assert all(-lookahead <= t < 0.5 for t in took), took  # woken by the write, not 30 s later; never early
    assert scanner.alive()


ASLEEP = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'idle' "
          "AND query LIKE '%%SELECT clock_timestamp(),%%' AND clock_timestamp() - state_change > interval '0.3 s'")


def asleep_after_its_probe(application_name: str) -> bool:
    """The scanner's store connection has sat idle since a probe (next_work) for a
    while: its turn is over and it sleeps, not between the statements of a scan."""
    with connection.cursor() as cursor:
        cursor.execute(ASLEEP, [application_name])
        return cursor.fetchone()[0] == 1


def test_a_connection_the_server_ended_is_reopened_before_the_next_probe(stack: Stack) -> None:
    scanner = sleeping_scanner(stack, SCHEDULER_SCAN_INTERVAL="30", SCHEDULER_DB_APPLICATION_NAME="wakeups-scanner")
    # Ended mid-scan, the scan fails and is retried, which is right but not this test:
    # the connection is ended while the scanner sleeps (the CI run of 7e75554 ended it
    # during the first scan).
    wait_for(lambda: asleep_after_its_probe("wakeups-scanner"), 15, interval=0.05, what="the scanner to sleep")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                       ["wakeups-scanner"])
        assert [ok for (ok,) in cursor.fetchall()] == [True]
    due = claims.store_now() + timedelta(seconds=0.3)
    run = make_run(job(), due)
    queued = wait_for(lambda: queued_at(run), 5, interval=0.02, what="the run to be queued")
    print(f"due -> queued, its connection ended by the server meanwhile: {seconds(queued, due) * 1000:.0f} ms")
    assert seconds(queued, due) < 0.5
    assert scanner.alive() and "scan failed" not in scanner.output()


@pytest.fixture
def killer() -> Iterator[threading.Event]:
    """Ends every scanner LISTEN connection it sees, every 50 ms, until the event is
    set (at most 60 s): notifications lost whenever the scanner reconnects."""
    stop, killed = threading.Event(), threading.Event()
    params = {**listen_params(connection.get_connection_params(), "-"), "application_name": "wakeups test killer"}
    conn = psycopg.connect(**params, autocommit=True)

    def kill() -> None:
        for _ in range(1200):
            if stop.wait(0.05):
                return
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                                "current_database() AND application_name LIKE 'scanner % listen'").fetchall()
            if any(ok for (ok,) in rows):
                killed.set()

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    yield killed
    stop.set()
    thread.join(5)
    conn.close()


def test_with_its_notifications_lost_the_scanner_still_finds_a_run_within_the_scan_interval(
        stack: Stack, killer: threading.Event) -> None:
    interval = 3.0
    scanner = stack.scanner("scanner-a", SCHEDULER_SCAN_INTERVAL=str(interval))
    wait_for(lambda: owns_all(scanner), 30, what="the scanner to own every partition")
    wait_for(killer.is_set, 15, what="the scanner's LISTEN connection to be ended")
    took = []
    for _ in range(2):
        due = claims.store_now() + timedelta(seconds=0.3)
        run = make_run(job(), due)
        queued = wait_for(lambda r=run: queued_at(r), interval + 3, interval=0.05, what="the run to be queued")
        took.append(seconds(queued, due))
    print(f"due -> queued with its LISTEN connection ended every 50 ms: {took}")
    assert all(t <= interval + 0.5 for t in took), took
    assert scanner.alive() and "listen connection lost" in scanner.output()


def test_a_lease_that_runs_out_is_found_at_its_end_by_a_scanner_sleeping_long(stack: Stack) -> None:
    lease = timedelta(seconds=2)
    sleeping_scanner(stack, SCHEDULER_SCAN_INTERVAL="30", SCHEDULER_LEASE_SECONDS="2")
    run = make_run(job(), claims.store_now())
    wait_for(lambda: queued_at(run), 5, interval=0.02, what="the run to be queued")
    # A worker claims it and dies: no heartbeat, no outcome.
    assert claims.claim(run_id=run.pk, worker="gone", lease=lease) is not None
    run.refresh_from_db()
    end = run.lease_expires_at
    found = wait_for(lambda: event_at(run, "lease_expired"), 10, interval=0.05, what="the lease to be found expired")
    print(f"lease end -> lease_expired: {seconds(found, end) * 1000:.0f} ms")
    assert 0 <= seconds(found, end) < 1.0


def test_a_queued_run_nobody_claims_is_published_again_at_its_time_by_a_scanner_sleeping_long(stack: Stack) -> None:
    sleeping_scanner(stack, SCHEDULER_SCAN_INTERVAL="30", SCHEDULER_REQUEUE_AFTER="2")
    run = make_run(job(), claims.store_now())  # no worker: its message is never taken
    queued = wait_for(lambda: queued_at(run), 5, interval=0.02, what="the run to be queued")
    again = wait_for(lambda: event_at(run, "requeued"), 10, interval=0.05, what="the run to be published again")
    print(f"queued -> requeued (SCHEDULER_REQUEUE_AFTER=2): {seconds(again, queued):.3f} s")
    assert 2.0 <= seconds(again, queued) < 3.0


def test_a_paused_job_resumes_at_its_resume_time_by_a_scanner_sleeping_long(stack: Stack) -> None:
    sleeping_scanner(stack, SCHEDULER_SCAN_INTERVAL="30")
    paused = job_pause(job=job())
    until = claims.store_now() + timedelta(seconds=2)
    Job.objects.filter(pk=paused.pk).update(paused_until=until)  # as PATCH {"paused_until": ...} writes it

    def resumed() -> Any:
        return Job.objects.filter(pk=paused.pk, paused=False).exists() and claims.store_now()

    seen = wait_for(resumed, 10, interval=0.05, what="the job to resume")
    print(f"paused_until -> resumed (seen): {seconds(seen, until):.3f} s")
    assert 0 <= seconds(seen, until) < 1.0
