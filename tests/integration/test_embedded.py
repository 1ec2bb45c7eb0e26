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
