"""The bench's own bookkeeping: per-run start lags, baselines kept across runs, and the
statement counter the `idle` scenario starts its scanners under."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from bench import baseline, harness, scenarios

ROOT = Path(__file__).resolve().parents[1]
DUE = datetime(2026, 12, 1, 12, 0, 0, tzinfo=timezone.utc)


def test_a_run_s_lag_is_its_first_call_and_an_early_start_stays_negative() -> None:
    t = DUE.timestamp()
    calls = [(t + 0.030, 1), (t - 0.004, 2)]
    lags, again = scenarios._start_lags(calls, {1: (DUE, 1), 2: (DUE, 1)})
    assert sorted(round(x, 6) for x in lags) == [-0.004, 0.030]
    assert again == 0


def test_a_run_called_twice_is_left_out_of_the_lags_and_counted() -> None:
    t = DUE.timestamp()
    calls = [(t + 0.010, 1), (t + 5.0, 1), (t + 0.020, 2), (t + 0.015, 3)]
    # Run 3 was retried: its row's due_at is the retry's now, not the first call's.
    lags, again = scenarios._start_lags(calls, {1: (DUE, 1), 2: (DUE, 1), 3: (DUE, 2)})
    assert [round(x, 6) for x in lags] == [0.020]
    assert again == 2


def test_rerunning_a_scenario_keeps_the_baseline_already_in_its_result(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    (tmp_path / "idle.json").write_text(json.dumps({"statements_per_second": 9.0, "baseline": {"commit": "40a7cbc"}}))
    harness.write_result("idle", {"statements_per_second": 0.5})
    written = json.loads((tmp_path / "idle.json").read_text())
    assert written["statements_per_second"] == 0.5
    assert written["baseline"] == {"commit": "40a7cbc"}


def test_a_baseline_goes_under_its_key_and_leaves_the_rest_of_the_result(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    results, scratch = tmp_path / "results", tmp_path / "scratch"
    results.mkdir()
    scratch.mkdir()
    monkeypatch.setattr(baseline, "RESULTS", results)
    (results / "idle.json").write_text(json.dumps({"statements_per_second": 0.5}))
    (scratch / "idle.json").write_text(json.dumps({"statements_per_second": 31.0, "commit": "40a7cbc"}))
    (scratch / "sustained-10.json").write_text(json.dumps({"lag_min_s": 0.01}))
    baseline.merge_baselines(scratch)
    idle = json.loads((results / "idle.json").read_text())
    assert idle["statements_per_second"] == 0.5
    assert idle["baseline"]["statements_per_second"] == 31.0
    assert json.loads((results / "sustained-10.json").read_text())["baseline"]["lag_min_s"] == 0.01


def _counted_statements(out: Path, selects: int) -> int:
    code = f"from django.db import connection\nfor i in range({selects}): connection.cursor().execute('SELECT %s', [i])"
    env = dict(os.environ)
    env.pop("SCHEDULER_COUNT_STATEMENTS_DIR", None)
    # Plain SELECTs need no tables: the server's own `postgres` database will do.
    env["DATABASE_URL"] = urlsplit(env["DATABASE_URL"])._replace(path="/postgres").geturl()
    subprocess.run([sys.executable, str(ROOT / "bench" / "counted.py"), "--out", str(out), "manage.py", "shell",
                    "-c", code], cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    return sum(json.loads(p.read_text())["statements"] for p in out.glob("*.json"))


def test_the_counter_counts_each_statement_a_command_sends(tmp_path: Path) -> None:
    if not os.environ.get("DATABASE_URL"):
        pytest.skip("counts statements sent to PostgreSQL")
    one, four = _counted_statements(tmp_path / "one", 1), _counted_statements(tmp_path / "four", 4)
    assert four - one == 3
    assert one >= 1


def test_the_partition_experiment_takes_runs_to_succeeded_in_every_shape(tmp_path: Path) -> None:
    """bench/partition_wal.py (issue 18, measured before it is built): every shape takes every
    run from its insert to `succeeded` (the script checks the count), the split ones move
    each finished run out of the open partition, and the figures are read from the WAL."""
    if not os.environ.get("DATABASE_URL"):
        pytest.skip("measures PostgreSQL's WAL")
    out = tmp_path / "wal.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "partition_wal.py"), "--runs", "400", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    found = json.loads(out.read_text())
    shapes = ("today", "hot", "stage", "split", "split_hot", "split_stage")
    assert {shape: found[shape]["runs"] for shape in shapes} == dict.fromkeys(shapes, 400)
    assert all(found[shape]["wal_records_per_run"] > 5 for shape in shapes)
    today, split = found["today"], found["split"]
    # What the split shape is for: a finished run kept once, with two index entries, not nine.
    assert split["bytes_per_run"] < today["bytes_per_run"]
    # What the hot shapes are for: the queueing and the claim write no index entry, so
    # fewer WAL records a run than the same table with today's indexes.
    assert found["hot"]["wal_records_per_run"] < today["wal_records_per_run"]
    assert found["split_hot"]["wal_records_per_run"] < split["wal_records_per_run"]


def test_the_partition_migration_bench_keeps_every_run_and_splits_open_from_ended(tmp_path: Path) -> None:
    """bench/partition_migration.py (migration runs 0015 on a loaded database): the
    migration keeps every run (the script asserts the count), the open runs land in
    runs_open and the ended ones in the history, and the reads tried meanwhile are counted."""
    if not os.environ.get("DATABASE_URL"):
        pytest.skip("migrates a PostgreSQL database")
    out = tmp_path / "migration.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "partition_migration.py"), "--runs", "2000", "--jobs", "100",
                    "--db", "scheduler_test_partition_migration", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    found = json.loads(out.read_text())
    assert found["rows"] == 2000
    assert found["partitions_after_analyze"] == {"runs_history": 1900, "runs_open": 100}
    assert found["reads_tried_during"] >= 2 and found["migrate_s"] > 0


def test_the_events_migration_keeps_every_event_under_its_runs_time_in_that_times_partition(tmp_path: Path) -> None:
    """bench/partition_migration.py --events (migration runs 0019 on a loaded database):
    the migration keeps every event (the script asserts the count), each under its run's
    scheduled time and, for an ended run, in the twin of its run's partition (the script
    asserts none is misplaced); the open runs' events go to their span's twin too."""
    if not os.environ.get("DATABASE_URL"):
        pytest.skip("migrates a PostgreSQL database")
    out = tmp_path / "migration.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "partition_migration.py"), "--events", "--runs", "2000",
                    "--jobs", "100", "--db", "scheduler_test_events_migration", "--json", str(out)],
                   check=True, cwd=ROOT, timeout=300, capture_output=True)
    found = json.loads(out.read_text())
    assert (found["migration"], found["rows"]) == ("runs 0019", 2000)
    parts = found["partitions_after_analyze"]
    assert parts.pop("run_events_default") == 0
    assert parts and all(name.startswith("run_events_p") for name in parts)
    assert sum(parts.values()) == 2000


def test_the_prune_bench_drops_the_oldest_day_whole_and_times_the_due_query(tmp_path: Path) -> None:
    """`bench/run.py prune` (issue 18, done-when 2) on a small history: prune_runs drops
    the oldest day's partition whole, with its events, and the due query keeps its plan."""
    if not os.environ.get("DATABASE_URL"):
        pytest.skip("loads a PostgreSQL database")
    env = {**os.environ, "BENCH_DB": "scheduler_test_prune_bench", "BENCH_RESULTS_DIR": str(tmp_path)}
    subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "prune", "--runs", "30000", "--days", "3",
                    "--events-every", "10", "--repeat", "3", "--out-name", "prune-test"],
                   check=True, cwd=ROOT, timeout=300, capture_output=True, env=env)
    found = json.loads((tmp_path / "prune-test.json").read_text())
    assert found["history_runs"] == 30000 and found["event_rows"] == 3000
    assert (found["pruned_runs"], found["pruned_events"]) == (10000, 1000)
    assert len(found["dropped"]) == 1 and found["dropped"][0].startswith("runs_p")
    assert found["due_query_plan_unchanged"] is True
    assert found["prune_seconds"] > 0


def test_the_wal_steps_probe_takes_runs_to_succeeded_and_finds_no_row_lock_in_the_worker(tmp_path: Path) -> None:
    """bench/wal_steps.py (issue 18, step 7): the real queueing and worker batch take every
    run to `succeeded` with its next run made, and the WAL read back per step shows the
    worker's statements locking no run row on their own: before migration runs 0016 the
    BEFORE UPDATE trigger had the claim and the outcome lock every row first (2.3 Heap/LOCK
    records a run in this probe; a claim whose new version goes to another page still
    writes one, hence the bound below one)."""
    if not os.environ.get("DATABASE_URL"):
        pytest.skip("reads PostgreSQL's WAL")
    out = tmp_path / "steps.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "wal_steps.py"), "--runs", "50", "--json", str(out),
                    "--db", "scheduler_test_wal_steps"], check=True, cwd=ROOT, timeout=300, capture_output=True)
    found = json.loads(out.read_text())
    assert (found["queued"], found["succeeded"], found["next_runs"]) == (50, 50, 50)
    # The scanner's FOR UPDATE SKIP LOCKED: one lock a run, the one it means to take.
    assert 0.9 <= found["steps"]["queue"]["row_locks_per_run"]["runs_open"] <= 1.2
    assert found["steps"]["execute"]["row_locks_per_run"].get("runs_open", 0) < 1.0
    # The outcome's lock of each job (runs.nextrun.jobs_lock), which it does mean.
    assert abs(found["steps"]["execute"]["row_locks_per_run"]["jobs"] - 1.0) < 0.05
    # The queueing is a HOT update (migration runs 0017): no index entry of runs_open.
    # Before it, one in each of runs_open's five indexes a run.
    entries = sum(r["records_per_run"] for r in found["steps"]["queue"]["by_relation"]
                  if r["kind"] == "Btree/INSERT_LEAF")
    assert entries < 0.5, found["steps"]["queue"]["by_relation"]
