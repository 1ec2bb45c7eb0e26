"""`python manage.py embedded`: the whole scheduler on one machine, no servers to install.

Runs the API and admin (runserver), one scanner and one Celery worker as child
processes on the embedded defaults (a SQLite file, a file-system broker and the
single-node coordinator), prints the admin URL, a login and where its API token is kept,
makes the demo job (once; later starts run it again) against the built-in echo target and
shows its run's timeline until it succeeds, in one screen of output (the children's goes
to the data directory's embedded.log). One instance per data directory (a flock its
children hold too); the children get SIGTERM when it dies, however it dies. For one machine only: production uses PostgreSQL,
Redis and ZooKeeper (README).
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import requests
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from jobs.models import Job
from jobs.services import service_account_ensure
from jobs.tokens import token_user

ROOT = Path(settings.BASE_DIR)
DEMO_SERVICE = "demo"  # the service account the demo job and the token file belong to
DEMO_NAME = "demo-echo"
LOG_NAME = "embedded.log"  # in the data directory: the children's output, kept off the terminal
LOCK_NAME = "embedded.lock"  # in the data directory: one instance per directory (flock)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Command(BaseCommand):
    help = (
        "Run the API and admin, a scanner and a worker on the embedded defaults (SQLite, a file broker, "
        "a single-node coordinator) and show a demo run go from schedule to done. One instance per data "
        "directory; Ctrl-C stops everything."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--port", type=int, default=8000, help="port of the API and admin on 127.0.0.1 (default 8000)"
        )
        parser.add_argument("--exit-after-demo", action="store_true", help="stop everything once the demo run is done")
        parser.add_argument(
            "--demo-timeout", type=float, default=60.0, metavar="SECONDS",
            help="how long to wait for the demo run to finish (default 60)",
        )

    def handle(self, *args: Any, port: int, exit_after_demo: bool, demo_timeout: float, **options: Any) -> None:
        if not settings.EMBEDDED:
            raise CommandError("`embedded` is for the embedded defaults; unset DATABASE_URL, or run the processes separately")
        lock = _instance_lock(Path(settings.DATA_DIR))
        if _port_taken(port):
            raise CommandError(f"port {port} is already in use; pass another with --port")
        call_command("migrate", verbosity=0)
        password = _admin_password()
        token, token_file = _demo_token()
        base = f"http://127.0.0.1:{port}"
        log_path = Path(settings.DATA_DIR) / LOG_NAME
        children = self._start_children(port, log_path, lock)
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does, children first
        try:
            _wait_until_up(base, children, log_path)
            self.stdout.write(
                "Embedded scheduler (one machine only: SQLite, file broker, single-node coordinator)\n"
                f"  admin:     {base}/admin/  (user admin, password {password})\n"
                f"  API:       {base}/api/    (Authorization: Token $(cat {token_file}))\n"
                f"  API docs:  {base}/api/docs/\n"
                f"  data:      {settings.DATA_DIR}  (the processes' output: {LOG_NAME})"
            )
            ok = self._demo(base, token, demo_timeout)
            if exit_after_demo:
                if not ok:
                    raise CommandError("the demo run did not succeed (see above)")
                return
            self.stdout.write("Running. Ctrl-C stops everything.")
            self.stdout.flush()
            while all(child.poll() is None for child in children):
                time.sleep(0.5)
            raise CommandError(f"a child process stopped:{_log_tail(log_path)}")
        except KeyboardInterrupt:
            pass
        finally:
            _stop(children)

    def _start_children(self, port: int, log_path: Path, lock: int) -> list[subprocess.Popen[bytes]]:
        """The API, a scanner and a worker, their output in the log file. Each is in its own
        session (a Ctrl-C reaches this process only, which stops them in order), holds the
        instance lock too (a second instance refuses while any of them lives), and gets
        SIGTERM when this process dies, even by kill -9 (Linux's parent-death signal)."""
        python = sys.executable
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
        commands = [
            [python, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload", "--insecure"],
            [python, "manage.py", "scanner"],
            [python, "-m", "celery", "-A", "scheduler_project", "--quiet", "worker", "-P", "threads", "-c", "4",
             "-l", "WARNING", "--without-heartbeat", "--without-gossip", "--without-mingle"],
        ]
        with log_path.open("ab") as log:
            log.write(f"--- embedded started {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n".encode())
            log.flush()
            return [
                subprocess.Popen(
                    cmd, cwd=ROOT, env=env, start_new_session=True, stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT, pass_fds=(lock,), preexec_fn=_die_with_parent(os.getpid()),
                )
                for cmd in commands
            ]

    def _demo(self, base: str, token: str, timeout: float) -> bool:
        http = requests.Session()
        http.headers["Authorization"] = f"Token {token}"
        answer = _demo_job(http, base)
        if answer.status_code not in (200, 201):
            self.stderr.write(_demo_refused(answer))
            return False
        job = answer.json()
        run_id = job["next_run"]["id"]
        made = "created" if answer.status_code == 201 else "scheduled again"
        self.stdout.write(f"Demo job {job['id']} {made}; its run {run_id} ({base}/api/runs/{run_id}/):")
        # The same run's admin page, live (it redraws itself as the run moves).
        self.stdout.write(f"  {base}/admin/runs/run/{run_id.removeprefix('run_')}/change/")
        shown = 0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = http.get(f"{base}/api/runs/{run_id}/", timeout=10).json()
            for event in run["events"][shown:]:
                self.stdout.write(f"  {event['at']}  {event['type']:<18} {_detail(event['detail'])}".rstrip())
            shown = len(run["events"])
            self.stdout.flush()
            if run["status"] in ("succeeded", "dead"):
                self.stdout.write(f"Run {run_id} {run['status']}.")
                return run["status"] == "succeeded"
            time.sleep(0.5)
        self.stdout.write(f"Run {run_id} did not finish within {timeout:g}s.")
        return False


def _demo_job(http: requests.Session, base: str) -> requests.Response:
    """The one demo job: created on the first start; on every later start the same job
    gets this start's echo URL (the port may differ) and a new run two seconds out."""
    fields = {"delay": "2s", "target": f"{base}/demo/echo/"}
    kept = (
        Job.objects.filter(owner__username=DEMO_SERVICE, name=DEMO_NAME)
        .exclude(state=Job.State.DELETED)
        .order_by("pk")
        .first()
    )
    if kept is not None:
        return http.patch(f"{base}/api/jobs/{kept.public_id}/", json=fields, timeout=10)
    return http.post(f"{base}/api/jobs/", json={"name": DEMO_NAME, **fields, "payload": {"hello": "world"}}, timeout=10)


def _instance_lock(data_dir: Path) -> int:
    """An exclusive flock on the data directory's lock file, held for this instance's life
    (and its children's): a second instance on the same directory refuses, saying who holds it."""
    path = data_dir / LOCK_NAME
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(descriptor, 64, 0).decode(errors="replace").strip() or "?"
        os.close(descriptor)
        if holder.isdigit() and not _alive(int(holder)):
            raise CommandError(
                f"the processes of an embedded scheduler that has ended (pid {holder}) still hold the data "
                f"directory {data_dir}; they stop within seconds: try again then"
            ) from None
        raise CommandError(
            f"another embedded scheduler (pid {holder}) is running on the data directory {data_dir}: "
            "stop it first, or give this one another SCHEDULER_DATA_DIR"
        ) from None
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
    return descriptor


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """A child's pre-exec step: SIGTERM when `parent` dies (PR_SET_PDEATHSIG survives exec),
    and exit at once if it died before the signal was armed. Linux only; elsewhere None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return arm


def _log_tail(path: Path, lines: int = 10) -> str:
    """The last lines of the processes' log, indented, to show under a failure."""
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return f" (no log at {path})"
    return f" the last lines of {path}:\n" + "\n".join(f"  {line}" for line in tail)


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
        _, kept = service_account_ensure(name=DEMO_SERVICE)
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


def _wait_until_up(base: str, children: list[subprocess.Popen[bytes]], log_path: Path) -> None:
    for _ in range(150):
        if any(child.poll() is not None for child in children):
            raise CommandError(f"a child process failed to start:{_log_tail(log_path)}")
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
