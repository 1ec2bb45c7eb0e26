"""A private PostgreSQL primary and its streaming standby on loopback, for the failover
test: synchronous replication (a commit returns only once the standby has flushed it),
the primary killed (`pg_ctl stop -m immediate`), the standby promoted (`pg_ctl promote`).

    pair = PgPair().start()            # both up, the standby streaming synchronously
    pair.url("sched")                  # postgres://postgres@127.0.0.1:P1,127.0.0.1:P2/sched?target_session_attrs=read-write&...
    pair.kill_primary(); pair.promote_standby()
    pair.stop()                        # both stopped, the data directories removed

The machine's PostgreSQL binaries (/usr/lib/postgresql/<version>/bin), run as the
`postgres` OS user, data under a temporary directory of its own, listening on
127.0.0.1 on free ports; the machine's cluster is never touched. Only the
postmasters started here are stopped, by their data directory and pid.
"""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests.zkensemble import free_ports

STANDBY_NAME = "standby1"


def pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name))
    return found[-1].parent if found else None


class PgPair:
    def __init__(self) -> None:
        self.bin = pg_bin()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL binaries under /usr/lib/postgresql/*/bin")
        self.user = pwd.getpwnam("postgres")
        self.root = Path(tempfile.mkdtemp(prefix="sched-pgpair-"))
        os.chown(self.root, self.user.pw_uid, self.user.pw_gid)
        self.primary_port, self.standby_port = free_ports(2)
        self.primary_dir, self.standby_dir = self.root / "primary", self.root / "standby"
        self.started: list[Path] = []

    # --- running the binaries as postgres
    def _run(self, tool: str, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["runuser", "-u", "postgres", "--", str(self.bin / tool), *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=check, cwd=self.root)

    def psql(self, port: int, sql: str, db: str = "postgres") -> str:
        out = self._run("psql", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "-d", db, "-XAtqc", sql,
                        timeout=20)
        return out.stdout.strip()

    def _start(self, data: Path, port: int, *settings: str) -> None:
        options = " ".join([f"-c port={port}", "-c listen_addresses=127.0.0.1",
                            f"-c unix_socket_directories={self.root}", *settings])
        self._run("pg_ctl", "start", "-w", "-t", "60", "-D", str(data), "-l", str(self.root / f"{data.name}.log"),
                  "-o", options, timeout=90)
        self.started.append(data)

    def start(self) -> "PgPair":
        self._run("initdb", "-D", str(self.primary_dir), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                  "--no-sync", timeout=120)
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

    def postmaster_pid(self, data: Path) -> int | None:
        try:
            return int((data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

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
