"""The README's first command: the whole scheduler on the embedded defaults."""
from __future__ import annotations

import fcntl
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness import free_port
from tests.integration.conftest import ROOT
from tests.integration.quickstart import Quickstart, embedded_env, process_gone

pytestmark = [pytest.mark.integration, pytest.mark.embedded]
SCREEN_LINES = 24


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="runs in the embedded pass of scripts/test.sh")
def test_the_embedded_command_shows_the_demo_run_reach_succeeded(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "ZOOKEEPER_HOSTS", "SECRET_KEY")}
    env["SCHEDULER_DATA_DIR"] = str(tmp_path / "var")
    done = subprocess.run(
        [sys.executable, "manage.py", "embedded", "--port", str(free_port()), "--exit-after-demo", "--demo-timeout", "60"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "/admin/" in out and "Authorization: Token " in out
    timeline = [line.split()[1] for line in out.splitlines() if line.startswith("  20") and line.split()[0].endswith("Z")]
    assert timeline == ["scheduled", "queued", "claimed", "target_answered", "succeeded"], out
    assert "succeeded." in out, out
    assert (tmp_path / "var" / "scheduler.sqlite3").exists()
    # The token is kept in the data folder, private, and named rather than printed.
    token_file = tmp_path / "var" / "api-token"
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert f"Authorization: Token $(cat {token_file})" in out
    assert token_file.read_text().strip() not in out


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="runs in the embedded pass of scripts/test.sh")
def test_the_embedded_command_says_what_to_do_when_the_allow_list_refuses_its_demo(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "ZOOKEEPER_HOSTS", "SECRET_KEY")}
    env["SCHEDULER_DATA_DIR"] = str(tmp_path / "var")
    env["SCHEDULER_TARGET_ALLOWLIST"] = "*.internal"
    done = subprocess.run(
        [sys.executable, "manage.py", "embedded", "--port", str(free_port()), "--exit-after-demo", "--demo-timeout", "30"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in said, said
    reason = [line for line in said.splitlines() if "SCHEDULER_TARGET_ALLOWLIST" in line]
    assert len(reason) == 1 and "127.0.0.1" in reason[0], said


def embedded(data_dir: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", "embedded", *args],
        cwd=ROOT, env=embedded_env(data_dir), capture_output=True, text=True, timeout=timeout,
    )


def demo_jobs(data_dir: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(data_dir / "scheduler.sqlite3") as db:
        return db.execute("SELECT name, state FROM jobs WHERE name = 'demo-echo'").fetchall()


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="runs in the embedded pass of scripts/test.sh")
def test_a_restart_keeps_one_demo_job_and_its_output_fits_on_one_screen(tmp_path: Path) -> None:
    data = tmp_path / "var"
    for start in ("created", "scheduled again"):
        done = embedded(data, "--port", str(free_port()), "--exit-after-demo", "--demo-timeout", "60")
        said = done.stdout + done.stderr
        assert done.returncode == 0, said
        assert f"Demo job job_1 {start}" in done.stdout, said
        assert len(said.splitlines()) <= SCREEN_LINES and "Traceback" not in said, said
        # No Celery banner, no warnings, no raw epoch line: the processes' output is in the log.
        assert "[queues]" not in said and "Warning:" not in said and not re.search(r"\b1\d{9}\.\d+", said), said
        assert re.search(r"^  http://127\.0\.0\.1:\d+/admin/runs/run/\d+/change/$", done.stdout, re.M), said
    assert demo_jobs(data) == [("demo-echo", "completed")]
    assert "partitions [" in (data / "embedded.log").read_text()


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="runs in the embedded pass of scripts/test.sh")
def test_a_second_instance_refuses_and_kill_9_of_the_quickstart_ends_its_children(tmp_path: Path) -> None:
    data = tmp_path / "var"
    first = Quickstart(data, tmp_path / "quickstart.log")
    try:
        out = first.wait_running()
        assert len(out.splitlines()) <= SCREEN_LINES and "Traceback" not in out, out
        assert len(first.children) == 3, first.children  # the API, a scanner, a worker

        second = embedded(data, "--port", str(free_port()), "--exit-after-demo")
        assert second.returncode == 1 and second.stdout == "", second.stdout + second.stderr
        assert second.stderr.strip() == (
            f"CommandError: another embedded scheduler (pid {first.proc.pid}) is running on the data directory "
            f"{data}: stop it first, or give this one another SCHEDULER_DATA_DIR"
        )

        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(process_gone(pid) for pid in first.children):
            time.sleep(0.2)
        assert [pid for pid in first.children if not process_gone(pid)] == []
    finally:
        first.stop()
    # With the old instance and its children gone, the data directory is free again.
    again = embedded(data, "--port", str(free_port()), "--exit-after-demo", "--demo-timeout", "60")
    assert again.returncode == 0, again.stdout + again.stderr
    assert len(demo_jobs(data)) == 1


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="runs in the embedded pass of scripts/test.sh")
def test_a_lock_still_held_after_its_instance_ended_is_said_to_be_its_leftover_processes(tmp_path: Path) -> None:
    data = tmp_path / "var"
    data.mkdir()
    gone = subprocess.Popen(["true"])  # a pid that has ended
    gone.wait()
    with (data / "embedded.lock").open("w") as held:  # as a leftover child holds it
        held.write(f"{gone.pid}\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        refused = embedded(data, "--port", str(free_port()), "--exit-after-demo", timeout=60)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert refused.stderr.strip() == (
        f"CommandError: the processes of an embedded scheduler that has ended (pid {gone.pid}) still hold the data "
        f"directory {data}; they stop within seconds: try again then"
    )
