"""The README's first command: the whole scheduler on the embedded defaults."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness import free_port
from tests.integration.conftest import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.embedded]


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
