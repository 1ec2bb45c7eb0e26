"""Private PostgreSQL servers on loopback, for the failover and restart tests and
the restart bench; the machine's cluster is never touched.

A primary and its streaming standby (the failover test): synchronous replication (a
commit returns only once the standby has flushed it), the primary killed
(`pg_ctl stop -m immediate`), the standby promoted (`pg_ctl promote`):

    pair = PgPair().start()            # both up, the standby streaming synchronously
    pair.url("sched")                  # postgres://postgres@127.0.0.1:P1,127.0.0.1:P2/sched?target_session_attrs=read-write&...
    pair.kill_primary(); pair.promote_standby()
    pair.stop()                        # both stopped, the data directories removed

One server, restarted (the restart test and bench): a fast shutdown and a start, or
`kill -9` of the postmaster and a start (crash recovery):

    pg = PgServer().start()            # PgServer(port) on a given port
    pg.url("sched"); pg.restart_fast(); pg.restart_killed(); pg.stop()

The machine's PostgreSQL binaries (/usr/lib/postgresql/<version>/bin), run as the
`postgres` OS user, data under a temporary directory of its own, listening on
127.0.0.1 on free ports. Only the postmasters started here are stopped or killed, by
their data directory and the pid in it.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from bench.harness import free_port
from tests.zkensemble import free_ports

STANDBY_NAME = "standby1"
S = TypeVar("S", bound="PgClusters")


def pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    return found[-1].parent if found else None


class PgClusters:
    """Clusters of our own under one temporary directory, run as the postgres user."""

    def __init__(self, prefix: str) -> None:
        self.bin = pg_bin()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        self.user = pwd.getpwnam("postgres")
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self.started: list[Path] = []

    # --- running the binaries as postgres
    def _run(self, tool: str, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["runuser", "-u", "postgres", "--", str(self.bin / tool), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, cwd=self.root)

    def psql(self, port: int, sql: str, db: str = "postgres") -> str:
        out = self._run("psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", db, "-XAtqc", sql,
                        timeout=20)
        return out.stdout.strip()

    def _initdb(self, data: Path) -> None:
        self._run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync",
                  timeout=120)

    def _start(self, data: Path, port: int, *settings: str) -> None:
        options = " ".join([f"-c port={port}", "-c listen_addresses=127.0.0.1",
                            f"-c unix_socket_directories={self.root}", *settings])
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(data), "-l", str(self.root / f"{data.name}.log"),
                  "-o", options, timeout=90)
        if data not in self.started:
            self.started.append(data)

    def postmaster_pid(self, data: Path) -> int | None:
        try:
            return int((data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def stop(self) -> None:
        for data in reversed(self.started):
            if self.postmaster_pid(data) is None:
                continue
            result = self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(data), timeout=30, check=False)
            pid = self.postmaster_pid(data)
            if result.returncode != 0 and pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)  # our own postmaster, by the pid in its own directory
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


class PgPair(PgClusters):
    def __init__(self) -> None:
        super().__init__("sched-pgpair-")
        self.primary_port, self.standby_port = free_ports(2)
        self.primary_dir, self.standby_dir = self.root / "primary", self.root / "standby"

    def start(self) -> "PgPair":
        self._initdb(self.primary_dir)
        with open(self.primary_dir / "pg_hba.conf", "a") as hba:
            hba.write("host replication postgres 127.0.0.1/32 trust\n")
        # Synchronous replication is the primary's setting alone, given on its command
        # line, so the standby (a copy of its directory) does not inherit it: once
        # promoted, it must not wait for a standby it does not have.
        self._start(self.primary_dir, self.primary_port, "-c wal_level=replica", "-c max_wal_senders=4",
                    f"-c synchronous_standby_names={STANDBY_NAME}", "-c synchronous_commit=on",
                    "-c fsync=off", "-c full_page_writes=off")
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary_port), "-U", "postgres",
                  "-D", str(self.standby_dir), "-R", "-X", "stream", "--checkpoint=fast", timeout=120)
        with open(self.standby_dir / "postgresql.auto.conf", "a") as conf:
            conf.write(f"primary_conninfo = 'host=127.0.0.1 port={self.primary_port} user=postgres "
                       f"application_name={STANDBY_NAME}'\n")
        self._start(self.standby_dir, self.standby_port, "-c hot_standby=on", "-c fsync=off")
        deadline = time.monotonic() + 30
        while self.sync_state() != "sync":
            if time.monotonic() > deadline:
                raise RuntimeError(f"the standby never became synchronous ({self.sync_state()!r})")
            time.sleep(0.1)
        return self

    def sync_state(self) -> str:
        return self.psql(self.primary_port,
                         f"select sync_state from pg_stat_replication where application_name = '{STANDBY_NAME}'")

    def url(self, db: str) -> str:
        return (f"postgres://postgres@127.0.0.1:{self.primary_port},127.0.0.1:{self.standby_port}/{db}"
                "?target_session_attrs=read-write&connect_timeout=3")

    def kill_primary(self) -> float:
        """`pg_ctl stop -m immediate`: the postmaster and its backends go at once, no
        checkpoint, every client's socket closed under it. Returns the time."""
        at = time.time()
        self._run("pg_ctl", "stop", "-m", "immediate", "-D", str(self.primary_dir), timeout=30)
        return at

    def promote_standby(self) -> float:
        """`pg_ctl promote -w`: returns (the time) once the standby takes writes."""
        self._run("pg_ctl", "promote", "-w", "-t", "60", "-D", str(self.standby_dir), timeout=90)
        return time.time()

    def in_recovery(self, port: int) -> bool:
        return self.psql(port, "select pg_is_in_recovery()") == "t"


class PgServer(PgClusters):
    """One server, restarted under its clients: a fast shutdown (clients disconnected,
    a checkpoint) and a start, or the postmaster killed (`kill -9`: its backends exit
    when they see it gone, nothing is checkpointed) and a start (crash recovery from
    the WAL). `fsync=off`: a process that dies loses nothing the OS has (only a
    machine crash would), which is all these restarts do."""

    SETTINGS = ("-c fsync=off", "-c full_page_writes=off", "-c max_connections=200")

    def __init__(self, port: int | None = None) -> None:
        super().__init__("sched-pg-")
        self.port = port or free_port()  # BENCH_PORTS, when set, names the range
        self.data = self.root / "data"

    def start(self) -> "PgServer":
        self._initdb(self.data)
        self._start(self.data, self.port, *self.SETTINGS)
        return self

    def url(self, db: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{db}?connect_timeout=3"

    def accepting(self) -> bool:
        done = self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), "-t", "1", timeout=10, check=False)
        return done.returncode == 0

    def restart_fast(self, hold: float = 0.0) -> tuple[float, float]:
        """`pg_ctl stop -m fast`, `hold` seconds down, then a start. Returns (stop
        began, accepting again)."""
        began = time.time()
        self._run("pg_ctl", "stop", "-m", "fast", "-w", "-t", "60", "-D", str(self.data), timeout=90)
        time.sleep(hold)
        self._start(self.data, self.port, *self.SETTINGS)
        return began, time.time()

    def restart_killed(self, hold: float = 0.0, timeout: float = 60) -> tuple[float, float]:
        """`kill -9` of the postmaster (ours: the pid in its own data directory), `hold`
        seconds down, then a start, tried again while the dead postmaster's backends
        still hold its shared memory. Returns (the kill, accepting again)."""
        pid = self.postmaster_pid(self.data)
        if pid is None:
            raise RuntimeError(f"no postmaster.pid in {self.data}")
        began = time.time()
        os.kill(pid, signal.SIGKILL)
        time.sleep(hold)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._start(self.data, self.port, *self.SETTINGS)
                return began, time.time()
            except subprocess.CalledProcessError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)


@contextmanager
def running(make: Callable[[], S]) -> Iterator[S]:
    """A test's private server(s), started, stopped after; the test skipped where the
    machine has no PostgreSQL server binaries or no runuser."""
    import pytest

    if pg_bin() is None or shutil.which("runuser") is None:
        pytest.skip("needs the PostgreSQL server binaries (/usr/lib/postgresql/*/bin) and runuser")
    made = make()
    try:
        made.start()
        yield made
    finally:
        made.stop()


@contextmanager
def orm_on(url: str) -> Iterator[None]:
    """This process's Django ORM on `url` (a private server) for the block, on the test
    database again after."""
    from django.db import connections

    from scheduler_project.settings import database_from_url

    conn = connections["default"]
    saved = dict(conn.settings_dict)
    conn.close()
    conn.settings_dict.update({k: v for k, v in database_from_url(url).items()
                               if k in ("HOST", "PORT", "NAME", "USER", "PASSWORD", "OPTIONS")})
    try:
        yield
    finally:
        conn.close()
        conn.settings_dict.clear()
        conn.settings_dict.update(saved)
