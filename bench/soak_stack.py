"""The soak's production layout: its own PostgreSQL databases, a private Redis, a
private ZooKeeper, the target, and restartable scanner and worker processes.

Everything listens on loopback. Every process started here is ended here, by its
own id (its process group), and every wait is bounded.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from bench.harness import PY, ROOT, Proc, free_port, wait_for

ZK_SCRIPT = ROOT / "scripts" / "zookeeper.sh"
# scripts/zookeeper.sh's tickTime, for the report: the server expires sessions on its ticks.
ZK_TICK_S = int(re.search(r"tickTime=(\d+)", ZK_SCRIPT.read_text()).group(1)) / 1000  # type: ignore[union-attr]
# The target's own records (bench/soak_target.py): every applied effect, every call.
TARGET_SCHEMA = """
CREATE TABLE IF NOT EXISTS soak_effects (
    id bigserial PRIMARY KEY, key text NOT NULL, fence bigint NOT NULL, run_id text NOT NULL,
    port int NOT NULL, applied_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS soak_calls (
    id bigserial PRIMARY KEY, key text NOT NULL, fence bigint, attempt int, run_id text NOT NULL,
    port int NOT NULL, outcome text NOT NULL, status int NOT NULL,
    arrived double precision NOT NULL, answered double precision NOT NULL
);
"""


class PrivateRedis:
    """A redis-server of our own on a free port: FLUSHALL touches nothing else. No
    persistence: a restart comes back empty, every message it held lost."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port, self.log_dir = port or free_port(), log_dir
        self.proc = self._start(1)

    def _start(self, generation: int) -> Proc:
        self.proc = Proc("redis", ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", "--dir", str(self.log_dir)], dict(os.environ), self.log_dir,
                         generation)
        wait_for(self._ours, 10, "the private redis-server")
        return self.proc

    def restart(self, hold: float = 0.0) -> tuple[float, float]:
        """Stopped (SIGTERM: every client's connection closed, nothing saved), `hold`
        seconds down, and started again on the same port, empty. Returns (stop began,
        answering again)."""
        began = time.time()
        self.stop()
        time.sleep(hold)
        self._start(self.proc.generation + 1)
        return began, time.time()

    def _cli(self, *args: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=5)
        return out.stdout

    def _ours(self) -> bool:
        # The PID that answers on the port must be the one we started.
        try:
            return f"process_id:{self.proc.pid}" in self._cli("info", "server")
        except subprocess.TimeoutExpired:
            return False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def llen(self, key: str) -> int:
        return int(self._cli("LLEN", key).strip() or 0)

    def hlen(self, key: str) -> int:
        return int(self._cli("HLEN", key).strip() or 0)

    def flushall(self) -> None:
        if not self._ours():
            raise RuntimeError(f"port {self.port} is not our redis-server any more; not flushing it")
        self._cli("FLUSHALL")

    def stop(self) -> None:
        self.proc.stop(grace=5)


class ZooKeeper:
    """scripts/zookeeper.sh on a port and directory of our own, so it can be restarted."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.dir = f"/tmp/scheduler-zookeeper-soak-{self.port}"

    def _script(self, action: str) -> None:
        subprocess.run(["bash", str(ZK_SCRIPT), action, str(self.port), self.dir], check=True, capture_output=True,
                       timeout=90)

    def start(self) -> None:
        self._script("start")

    def stop(self) -> None:
        self._script("stop")

    @property
    def hosts(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client_ports(self) -> list[int]:
        return [self.port]

    def pids(self) -> list[int]:
        try:
            return [int(Path(self.dir, "pid").read_text())]
        except (OSError, ValueError):
            return []


class ZooKeeperEnsemble:
    """Three ZooKeeper nodes (tests/zkensemble.Ensemble), each killed and started again
    by its own id: a leader, a follower, two of them (quorum lost)."""

    def __init__(self, workdir: Path) -> None:
        from tests.zkensemble import Ensemble

        self.ensemble = Ensemble(workdir / "zk")

    def start(self) -> None:
        """Every node that is down started again; returns once they serve (a no-op when all are up)."""
        for n in (1, 2, 3):
            if not self.ensemble.alive(n):
                self.ensemble.start_node(n)
        self.ensemble.wait_for_quorum(90)

    def restart_wiped(self, hold: float) -> float:
        """Every node killed, its data wiped, `hold` s down, all started again: every session
        ends (what zk_restart does to the single server). Returns when they were killed."""
        import shutil

        at = time.time()
        for n in (1, 2, 3):
            if self.ensemble.alive(n):
                self.ensemble.kill(n)
        for n in (1, 2, 3):
            shutil.rmtree(self.ensemble.workdir / f"zk{n}" / "data", ignore_errors=True)
        time.sleep(hold)
        self.start()
        return at

    def stop(self) -> None:
        self.ensemble.stop()

    @property
    def hosts(self) -> str:
        return self.ensemble.hosts

    def client_ports(self) -> list[int]:
        return [self.ensemble.client[n] for n in (1, 2, 3)]

    def pids(self) -> list[int]:
        return [p.pid for n, p in self.ensemble.procs.items() if self.ensemble.alive(n)]


class Databases:
    """The scheduler's database and the target's, both made fresh for the soak.

    With `store` (a private server's url maker: tests/pgpair.PgServer.url), the
    scheduler's database lives there, so the soak can restart that server; the
    target's stays on `server`, so its records never see the restart."""

    def __init__(self, server: str, name: str, store: Any = None) -> None:
        self.server, self.name, self.target_name = server.rstrip("/"), name, f"{name}_target"
        self.store = store

    def url(self, target: bool = False) -> str:
        if not target and self.store is not None:
            return str(self.store(self.name))
        return f"{self.server}/{self.target_name if target else self.name}"

    def _admin_url(self, target: bool) -> str:
        if not target and self.store is not None:
            return str(self.store("postgres"))
        return f"{self.server}/postgres"

    def _admin(self, sql: str, target: bool = True) -> None:
        with psycopg.connect(self._admin_url(target), autocommit=True) as conn:
            conn.execute(sql)

    def create(self, env: dict[str, str]) -> None:
        for db, target in ((self.name, False), (self.target_name, True)):
            self._admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', target)
            self._admin(f'CREATE DATABASE "{db}"', target)
        for url in (self.url(), self.url(target=True)):
            subprocess.run([PY, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env={**env, "DATABASE_URL": url},
                           check=True, capture_output=True, timeout=300)
        with psycopg.connect(self.url(target=True), autocommit=True) as conn:
            conn.execute(TARGET_SCHEMA)

    def drop(self) -> None:
        for db, target in ((self.name, False), (self.target_name, True)):
            self._admin(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)', target)

    def terminate(self, application_name: str) -> int:
        """pg_terminate_backend on every connection of the scheduler database with that name."""
        with psycopg.connect(self._admin_url(False), autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
                [self.name, application_name],
            ).fetchall()
        return sum(1 for (done,) in rows if done)

    def target_rows(self, sql: str) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url(target=True)) as conn:
            return list(conn.execute(sql).fetchall())


@dataclass
class Target:
    """The receiver on two ports: two target hosts, one gunicorn."""

    env: dict[str, str]
    log_dir: Path
    ports: list[int] = field(default_factory=lambda: [free_port(), free_port()])
    proc: Proc | None = None

    @property
    def control(self) -> Path:
        return self.log_dir / "target-control.json"

    def start(self) -> None:
        self.set_modes({})
        binds = [arg for port in self.ports for arg in ("-b", f"127.0.0.1:{port}")]
        argv = [PY, "-m", "gunicorn", "scheduler_project.wsgi:application", "-k", "gthread", "-w", "1",
                "--threads", "12", "--timeout", "120", "--graceful-timeout", "5", "--log-level", "warning", *binds]
        env = {**self.env, "DJANGO_SETTINGS_MODULE": "bench.soak_target_settings",
               "SOAK_TARGET_CONTROL": str(self.control)}
        self.proc = Proc("target", argv, env, self.log_dir)
        wait_for(lambda: all(self._listening(p) for p in self.ports), 30, "the target to listen")

    def _listening(self, port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    def url(self, port: int, name: str) -> str:
        return f"http://127.0.0.1:{port}/hook/{name}"

    def set_modes(self, modes: dict[int, dict[str, Any]]) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(port): mode for port, mode in modes.items()}))
        os.replace(tmp, self.control)  # the target never reads half a file

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(grace=5)


@dataclass
class ApiServer:
    """The REST API as a deployment serves it (gunicorn, gthread), asked what a
    service and a dashboard ask, about `every` seconds apart, for the whole soak:
    so that its memory is sampled under use (issue 19's "no slow leaks"). The soak's
    faults never kill it; a PostgreSQL restart costs it failed requests, counted."""

    env: dict[str, str]
    log_dir: Path
    token: str = ""
    metrics_token: str = ""
    every: float = 0.25
    port: int = field(default_factory=free_port)
    proc: Proc | None = None
    answered: dict[str, int] = field(default_factory=dict)  # status (or the error's name) -> count
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self, token: str, metrics_token: str, job_ids: list[str]) -> None:
        self.token, self.metrics_token = token, metrics_token
        argv = [PY, "-m", "gunicorn", "scheduler_project.wsgi:application", "-k", "gthread", "-w", "1",
                "--threads", "4", "--timeout", "60", "--graceful-timeout", "5", "--log-level", "warning",
                "-b", f"127.0.0.1:{self.port}"]
        # The poller's rate is far under the throttle; a 429 would still be counted, not hidden.
        self.proc = Proc("api", argv, {**self.env, "SCHEDULER_API_THROTTLE": "100000/min"}, self.log_dir)
        wait_for(lambda: self._listening(), 30, "the API to listen")
        self._thread = threading.Thread(target=self._poll, args=(list(job_ids),), name="api-poller", daemon=True)
        self._thread.start()

    def _listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def _poll(self, job_ids: list[str]) -> None:
        import random

        import requests

        session = requests.Session()
        session.headers["Authorization"] = f"Token {self.token}"
        base = f"http://127.0.0.1:{self.port}"
        scrape = {"Authorization": f"Bearer {self.metrics_token}"}
        paths = ["/api/jobs/", "/api/runs/", "/api/breakers/", "/metrics"]
        while not self._stop.wait(self.every):
            path = random.choice(paths + ([f"/api/jobs/{random.choice(job_ids)}/"] if job_ids else []))
            try:
                answer = session.get(base + path, timeout=10, headers=scrape if path == "/metrics" else None)
                key = f"{path.split('/')[2] if path.startswith('/api/') else 'metrics'} {answer.status_code}"
            except requests.RequestException as exc:
                key = type(exc).__name__
            self.answered[key] = self.answered.get(key, 0) + 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self.proc is not None:
            self.proc.stop(grace=5)


@dataclass
class LoadTarget(Target):
    """bench/soak_load_target.py on the same ports and control file: the target for
    `soak.py --rate`, recording every call in batches (hundreds a second)."""

    db_url: str = ""

    def start(self) -> None:
        self.set_modes({})
        argv = [PY, str(ROOT / "bench" / "soak_load_target.py"), "--ports", ",".join(map(str, self.ports)),
                "--db", self.db_url, "--control", str(self.control)]
        self.proc = Proc("target", argv, dict(self.env), self.log_dir)
        wait_for(lambda: all(self._listening(p) for p in self.ports), 30, "the target to listen")

    def stop(self) -> None:
        # SIGTERM: it flushes its last batch of records before it exits.
        if self.proc is not None:
            self.proc.stop(grace=30)


@dataclass
class Fleet:
    """Scanners and workers by name; a restart starts a new generation of the same name."""

    env: dict[str, str]
    log_dir: Path
    worker_concurrency: int = 4
    procs: dict[str, Proc] = field(default_factory=dict)
    # Per process name, what its environment says differently (a link through a proxy).
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    retired: list[Proc] = field(default_factory=list)

    def _argv(self, name: str, generation: int) -> list[str]:
        if name.startswith("scanner"):
            # A new ZooKeeper member name per generation: the dead one's session may still be open.
            ident = name if generation == 1 else f"{name}-r{generation - 1}"
            return [PY, "manage.py", "scanner", "--identifier", ident]
        return [PY, "-m", "celery", "-A", "scheduler_project", "worker", "-l", "WARNING",
                "-c", str(self.worker_concurrency), "-P", "prefork", "-n", f"{name}@%h",
                "--without-heartbeat", "--without-gossip", "--without-mingle"]

    def start(self, name: str) -> Proc:
        old = self.procs.get(name)
        generation = old.generation + 1 if old else 1
        if old is not None:
            self.retired.append(old)
        env = {**self.env, "SCHEDULER_DB_APPLICATION_NAME": f"soak-{name}", **self.overrides.get(name, {})}
        proc = Proc(name, self._argv(name, generation), env, self.log_dir, generation)
        self.procs[name] = proc
        return proc

    def names(self, kind: str) -> list[str]:
        return sorted(n for n in self.procs if n.startswith(kind))

    def all_generations(self, name: str) -> list[Proc]:
        return [p for p in self.retired if p.name == name] + [self.procs[name]]

    def heal(self) -> None:
        """Every process running and not stopped: the soak's end state."""
        for name, proc in list(self.procs.items()):
            if proc.stopped:
                proc.thaw()
            if not proc.alive():
                self.start(name)

    def stop_all(self) -> None:
        for proc in [*self.procs.values(), *self.retired]:
            proc.stop()
