"""A quickstart process for tests: started from the README's first command plus `--port`,
on a data directory of the test's own, and ended by its own pid (and its children's)."""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

from bench.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
PRODUCTION = ("DATABASE_URL", "CELERY_BROKER_URL", "ZOOKEEPER_HOSTS", "SECRET_KEY")


def readme_section(heading: str) -> str:
    """The README's text under `heading`, up to the next second-level heading."""
    text = (ROOT / "README.md").read_text()
    return text.split(heading + "\n", 1)[1].split("\n## ", 1)[0]


def readme_blocks(heading: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", readme_section(heading), re.S)


def embedded_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PRODUCTION}
    env["SCHEDULER_DATA_DIR"] = str(data_dir)
    return env


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie no one has reaped yet (it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def children_of(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return found


class Quickstart:
    """`bash scripts/quickstart.sh --port N` (the README's command), its output in a file."""

    def __init__(self, data_dir: Path, log: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.env = embedded_env(data_dir)
        command = readme_blocks("## Two commands")[0].strip()
        assert command == "bash scripts/quickstart.sh", command
        with log.open("wb") as out:
            # quickstart.sh ends by exec-ing `manage.py embedded`: this pid is the quickstart's.
            self.proc = subprocess.Popen(
                [*shlex.split(command), "--port", str(self.port)],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.children: list[int] = []

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_running(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.output()
            if "Running. Ctrl-C stops everything." in out:
                self.children = children_of(self.proc.pid)
                return out
            if self.proc.poll() is not None:
                raise AssertionError(f"the quickstart ended (rc {self.proc.returncode}):\n{out}")
            time.sleep(0.2)
        raise AssertionError(f"the quickstart was not running after {timeout}s:\n{self.output()}")

    def stop(self) -> None:
        """Ctrl-C's path (SIGTERM), then anything left of it or its children, by pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.children:
            if not process_gone(pid):
                os.kill(pid, signal.SIGKILL)
