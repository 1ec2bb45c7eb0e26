"""The soak (bench/soak.py) in the suite: a short one with every fault kind passes,
and with the deliberate fence bug on (runs/claims.py) it catches the bug and fails.

Each soak makes its own databases on the test's PostgreSQL server, its own Redis
and ZooKeeper, and drops or stops all of them at the end.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.soak import KINDS

pytestmark = [pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]


def soak(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any], str]:
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith("postgres") or not shutil.which("redis-server") or not shutil.which("java"):
        pytest.skip("the soak needs PostgreSQL (DATABASE_URL), redis-server and java (ZooKeeper)")
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(ROOT / "bench" / "soak.py"), "--pg", url.rsplit("/", 1)[0],
            "--db", f"sched_soak_t{os.getpid()}", "--json", str(out), "--workdir", str(tmp_path / "work"),
            "--drop", *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=420)
    summary = json.loads(out.read_text()) if out.exists() else {}
    return done.returncode, summary, done.stdout[-6000:] + done.stderr[-3000:]


def test_a_short_soak_with_every_fault_kind_misses_no_run_and_applies_no_effect_twice(tmp_path: Path) -> None:
    code, summary, output = soak(tmp_path, "--duration", "60", "--settle", "25", "--faults-per-kind", "1",
                                 "--seed", "7")
    assert code == 0, output
    assert summary["missed"] == 0 and summary["effects_applied_twice"] == 0, output
    assert summary["invariant_violations"] == 0, output
    assert summary["runs_due"] >= 20 and summary["succeeded"] >= summary["runs_due"] - summary["open_at_end"], output
    assert {kind: summary["faults"].get(kind, 0) for kind in KINDS} == {kind: 1 for kind in KINDS}, output


def test_with_the_fence_bug_on_the_soak_reports_outcomes_from_superseded_holders_and_fails(tmp_path: Path) -> None:
    # Each message delivered again while its run is in flight gives the bug a second holder;
    # whichever of the two finishes first has its outcome recorded, so give it many chances.
    code, summary, output = soak(tmp_path, "--inject-bug", "--stop-on-violation", "--duration", "40",
                                 "--settle", "15", "--kinds", "duplicate_delivery", "--faults-per-kind", "10",
                                 "--seed", "7")
    assert code == 1, output
    assert summary["outcomes_under_superseded_fence"] > 0, output
    assert summary["invariant_violations"] > 0, output
