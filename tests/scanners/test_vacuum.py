"""The open runs' VACUUM by the scanner holding partition 0 (scanners.vacuum): when it
runs, and that it runs on a connection of its own without holding up the scanner."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.test import override_settings

from runs import claims
from runs.models import Run
from scanners.vacuum import SHARE_OF_OPEN_RUNS, OpenRunsVacuum
from tests.factories import make_job
from tests.scanners.test_wakeups import run_scanner

on_postgresql = pytest.mark.skipif(connection.vendor != "postgresql", reason="VACUUM is PostgreSQL's")
ALL = frozenset(range(16))


def test_it_counts_only_on_the_scanner_holding_partition_0_and_only_when_turned_on() -> None:
    off = OpenRunsVacuum(0, {"host": "127.0.0.1"})
    assert not off.enabled and not off.counted(10**6, ALL, 16)
    embedded = OpenRunsVacuum(100, None)  # the SQLite file: no VACUUM of a partition
    assert not embedded.enabled and not embedded.counted(10**6, ALL, 16)
    on = OpenRunsVacuum(100, {"host": "127.0.0.1"})
    assert on.enabled
    assert not on.counted(10**6, frozenset({1, 2}), 16) and on.queued == 0  # not partition 0's scanner


def test_the_threshold_is_the_setting_or_a_tenth_of_the_open_runs_whichever_is_more() -> None:
    vacuum = OpenRunsVacuum(10_000, {"host": "127.0.0.1"})
    assert vacuum.threshold() == 10_000
    vacuum.open_runs = 500_000
    assert vacuum.threshold() == SHARE_OF_OPEN_RUNS * 500_000 == 50_000
    # A scanner holding 4 of 16 partitions counts its runs four times over: the
    # scanners queue over every partition, and the table is theirs together. While a
    # VACUUM runs, none is started; the count goes on.
    vacuum.open_runs = 0
    release = threading.Event()
    vacuum._thread = threading.Thread(target=release.wait, daemon=True)
    vacuum._thread.start()
    try:
        assert not vacuum.counted(2_000, frozenset({0, 1, 2, 3}), 16)
        assert vacuum.queued == 8_000
        assert not vacuum.counted(1_000, frozenset({0, 1, 2, 3}), 16)  # 12,000 counted, one running
        assert vacuum.queued == 12_000 and vacuum.running
    finally:
        release.set()
        vacuum._thread.join()


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_scanner_that_queued_enough_runs_vacuums_the_open_runs_on_a_connection_of_its_own(
    service: Any, tmp_path: Path
) -> None:
    """Each queued run leaves a dead `waiting` entry in runs_due_idx, which the probe's
    due part and the due read step over until a VACUUM: before, none came but
    autovacuum's (off on this test server), and those reads grew with every run (what
    a VACUUM saves them is measured in docs/performance.md, not here)."""
    owner = service.user
    jobs = [make_job(owner, name=f"v{i}") for i in range(400)]
    now = claims.store_now()
    Run.objects.bulk_create(
        Run(job=j, scheduled_for=now - timedelta(seconds=1), due_at=now - timedelta(seconds=1), partition=j.partition)
        for j in jobs)

    def vacuums() -> int:
        with connection.cursor() as cursor:
            cursor.execute("SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'runs_open'")
            return int(cursor.fetchone()[0])

    before = vacuums()
    stop = threading.Event()
    statements: list[tuple[float, str]] = []
    commands: list[Any] = []

    def body(command: Any, leases: Any) -> None:
        commands.append(command)
        command.run_loop(leases)

    with override_settings(SCHEDULER_OPEN_RUNS_VACUUM_AFTER=100, DATA_DIR=tmp_path):
        thread = run_scanner(body, stop, statements)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and Run.objects.filter(status=Run.Status.QUEUED).count() < 400:
                time.sleep(0.1)
            # The scan counts its runs after its commit and publish: the VACUUM starts then.
            while time.monotonic() < deadline and not (commands and getattr(commands[0], "vacuum", None)
                                                       and commands[0].vacuum.vacuums):
                time.sleep(0.05)
        finally:
            stop.set()
            thread.join(10)
    assert not thread.is_alive()
    assert Run.objects.filter(status=Run.Status.QUEUED).count() == 400
    vacuum = commands[0].vacuum
    print(f"VACUUMs by the scanner: {vacuum.vacuums}, the last {vacuum.last_seconds} s; open runs {vacuum.open_runs}; "
          f"after {vacuum.after}, counted {vacuum.queued}, enabled {vacuum.enabled}")
    assert vacuum.vacuums >= 1 and vacuum.last_seconds is not None
    assert vacuums() > before
    assert vacuum.open_runs == 400  # reltuples, as the VACUUM left it


@on_postgresql
@pytest.mark.django_db(transaction=True)
def test_a_vacuum_that_finds_the_table_locked_is_skipped_not_waited_for() -> None:
    from django.db import connections

    other = connections.create_connection("default")
    other.connect()
    try:
        other.set_autocommit(False)
        with other.cursor() as cursor:
            cursor.execute("LOCK TABLE runs_open IN SHARE UPDATE EXCLUSIVE MODE")  # as a running VACUUM holds it
        vacuum = OpenRunsVacuum.for_scanner(1, "lock-test")
        started = time.monotonic()
        assert vacuum.counted(1, ALL, 16)
        vacuum.wait(30)
        assert time.monotonic() - started < 10 and vacuum.vacuums == 1
    finally:
        other.rollback()
        other.close()
