"""`python manage.py embedded`: the whole scheduler on one machine, no servers to install.

Runs the API and admin (runserver), one scanner and one Celery worker as child
processes on the embedded defaults (a SQLite file, a file-system broker and the
single-node coordinator), prints the admin URL, a login and where its API token is kept,
creates a demo job against the built-in echo target and shows its run's
timeline until it succeeds. For one machine only: production uses PostgreSQL,
Redis and ZooKeeper (README).
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.services import service_account_ensure
from jobs.tokens import token_user

ROOT = Path(settings.BASE_DIR)


class Command(BaseCommand):
    help = "Run API, admin, scanner and worker on the embedded defaults, and show a demo run go to done."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--port", type=int, default=8000)
        parser.add_argument("--exit-after-demo", action="store_true", help="stop everything once the demo run is done")
        parser.add_argument("--demo-timeout", type=float, default=60.0)

    def handle(self, *args: Any, port: int, exit_after_demo: bool, demo_timeout: float, **options: Any) -> None:
        if not settings.EMBEDDED:
            raise CommandError("`embedded` is for the embedded defaults; unset DATABASE_URL, or run the processes separately")
        if _port_taken(port):
            raise CommandError(f"port {port} is already in use; pass --port")
        call_command("migrate", verbosity=0)
        password = _admin_password()
        token, token_file = _demo_token()
        base = f"http://127.0.0.1:{port}"
        children = self._start_children(port)
        try:
            _wait_until_up(base, children)
            self.stdout.write(
                "Embedded scheduler (one machine only: SQLite, file broker, single-node coordinator)\n"
                f"  admin:     {base}/admin/  (user admin, password {password})\n"
                f"  API:       {base}/api/    (Authorization: Token $(cat {token_file}))\n"
                f"  API docs:  {base}/api/docs/\n"
                f"  data:      {settings.DATA_DIR}\n"
            )
            ok = self._demo(base, token, demo_timeout)
            if exit_after_demo:
                if not ok:
                    raise CommandError("the demo run did not succeed (see above)")
                return
            self.stdout.write("Running. Ctrl-C stops everything.")
            self.stdout.flush()
            signal.signal(signal.SIGTERM, _interrupt)
            while all(child.poll() is None for child in children):
                time.sleep(0.5)
            raise CommandError("a child process stopped; see its output above")
        except KeyboardInterrupt:
            pass
        finally:
            _stop(children)

    def _start_children(self, port: int) -> list[subprocess.Popen[bytes]]:
        python = sys.executable
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        commands = [
            [python, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload", "--insecure"],
            [python, "manage.py", "scanner"],
            [python, "-m", "celery", "-A", "scheduler_project", "worker", "-P", "threads", "-c", "4",
             "-l", "WARNING", "--without-heartbeat", "--without-gossip", "--without-mingle"],
        ]
        return [subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True) for cmd in commands]

    def _demo(self, base: str, token: str, timeout: float) -> bool:
        http = requests.Session()
        http.headers["Authorization"] = f"Token {token}"
        answer = http.post(
            f"{base}/api/jobs/",
            json={"name": "demo-echo", "delay": "2s", "target": f"{base}/demo/echo/", "payload": {"hello": "world"}},
            timeout=10,
        )
        if answer.status_code != 201:
            self.stderr.write(_demo_refused(answer))
            return False
        job = answer.json()
        run_id = job["next_run"]["id"]
        self.stdout.write(f"Demo job {job['id']} created; watching run {run_id} (GET /api/runs/{run_id}/):")
        # The same run, live in the admin (it redraws itself as the run moves).
        self.stdout.write(f"  watch it in the admin: {base}/admin/runs/run/{run_id.removeprefix('run_')}/change/")
        shown = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = http.get(f"{base}/api/runs/{run_id}/", timeout=10).json()
            for event in run["events"][shown:]:
                self.stdout.write(f"  {event['at']}  {event['type']:<18} {_detail(event['detail'])}")
            shown = len(run["events"])
            self.stdout.flush()
            if run["status"] in ("succeeded", "dead"):
                self.stdout.write(f"Run {run_id} {run['status']}.")
                return run["status"] == "succeeded"
            time.sleep(0.5)
        self.stdout.write(f"Run {run_id} did not finish within {timeout:g}s.")
        return False


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def _detail(detail: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in detail.items())


def _demo_refused(answer: requests.Response) -> str:
    """One line saying why the demo job was refused, and what to do instead."""
    if settings.SCHEDULER_TARGET_ALLOWLIST and answer.status_code == 400 and "target" in answer.text:
        allowed = ",".join(settings.SCHEDULER_TARGET_ALLOWLIST)
        return (
            f"The demo job calls the built-in echo target on 127.0.0.1, which SCHEDULER_TARGET_ALLOWLIST={allowed} "
            "refuses: add 127.0.0.1 to it (or unset it) to see the demo; the scheduler itself runs as configured."
        )
    return f"The demo job was refused (HTTP {answer.status_code}): {answer.text[:300]!r}"


def _demo_token() -> tuple[str, Path]:
    """The demo service's API token, kept in the data folder (0600). Tokens are stored
    hashed, so the file is the only copy: a missing or revoked one is replaced."""
    path = Path(settings.DATA_DIR) / "api-token"
    kept = path.read_text().strip() if path.exists() else ""
    if not kept or token_user(kept) is None:
        _, kept = service_account_ensure(name="demo")
        _write_private(path, kept + "\n")
    return kept, path


def _write_private(path: Path, text: str) -> None:
    """Write `text` to a file only this account can read, private from its first byte."""
    descriptor = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an older file may have been wider
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)


def _admin_password() -> str:
    """An `admin` superuser with a password kept in the data folder (made once)."""
    path = Path(settings.DATA_DIR) / "admin-password"
    if not path.exists():
        _write_private(path, secrets.token_urlsafe(12))
    password = path.read_text().strip()
    user_model = get_user_model()
    admin, _ = user_model.objects.get_or_create(username="admin", defaults={"is_staff": True, "is_superuser": True})
    if not admin.check_password(password):
        admin.set_password(password)
        admin.save()
    return password


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _wait_until_up(base: str, children: list[subprocess.Popen[bytes]]) -> None:
    for _ in range(150):
        if any(child.poll() is not None for child in children):
            raise CommandError("a child process failed to start; see its output above")
        try:
            requests.get(f"{base}/api/schema/", timeout=1)
            return
        except requests.ConnectionError:
            time.sleep(0.2)
    raise CommandError("the API did not come up within 30 s")


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGTERM)
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
