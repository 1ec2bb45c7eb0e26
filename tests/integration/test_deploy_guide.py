"""docs/deploy.md, followed on one machine: the guide's marked blocks are run as
written, with its host names mapped to loopback ports and its paths to a scratch
directory (MAP below: the only changes made to them), and the ExecStart lines of
deploy/systemd/*.service are run as systemd runs them (WorkingDirectory, the
EnvironmentFile the guide wrote, %i and %H, ${VAR} from that file).

A three-node ZooKeeper ensemble on three loopback ports, PostgreSQL (a database
and role of the test's own, created by the guide's block and dropped here), Redis,
migrate, the first admin user, gunicorn, two scanners, two workers; then a job
made through the API, over the "TLS proxy" headers, runs and succeeds.
Everything started here is stopped here, by its process group id."""
from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests

from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "deploy.md"
UNITS = ROOT / "deploy" / "systemd"
BLOCK_RE = re.compile(r"<!-- deploy-test: ([\w-]+) -->\n```(?:bash|sh)\n(.*?)\n```", re.S)
HOST = "scheduler.example.com"


def guide_blocks() -> dict[str, str]:
    return {name: body for name, body in BLOCK_RE.findall(GUIDE.read_text())}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def mapped(text: str, mapping: dict[str, str]) -> str:
    for old, new in mapping.items():
        assert old in text, f"the guide no longer has {old!r}: update the test's map"
        text = text.replace(old, new)
    return text


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.3) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Machine:
    """The one machine standing in for every host, and what it started."""

    tmp: Path
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = field(default_factory=list)

    def sh(self, script: str, env: dict[str, str] | None = None, timeout: float = 60) -> str:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                              timeout=timeout, env={**os.environ, **(env or {})}, cwd=self.tmp)
        assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        return done.stdout

    def unit(self, name: str, paths: dict[str, str], instance: str = "", wait: bool = False
             ) -> subprocess.Popen[bytes]:
        """Start a unit's ExecStart as systemd would, under this machine's paths."""
        service = parse_unit(UNITS / name)

        def here(text: str) -> str:
            for old, new in paths.items():
                text = text.replace(old, new)
            return text

        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(self.tmp)}
        if "EnvironmentFile" in service:
            env.update(read_env_file(Path(here(service["EnvironmentFile"]))))
        command = service["ExecStart"].replace("%i", instance).replace("%H", "deploytest")
        command = here(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], command))
        cwd = here(service["WorkingDirectory"]) if "WorkingDirectory" in service else str(self.tmp)
        label = f"{name}{instance}" if instance else f"{name}:{len(self.procs)}"
        log = self.tmp / f"{label.replace('@', '-').replace(':', '-')}.log"
        proc = subprocess.Popen(shlex.split(command), cwd=cwd, env=env, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        if wait:
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        else:
            self.procs.append((label, proc, log))
        return proc

    def stop_all(self) -> None:
        for _, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(f"----- {name} -----\n{log.read_text(errors='replace')[-3000:]}" for name, _, log in self.procs)


def parse_unit(path: Path) -> dict[str, str]:
    section, found = "", {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "Service" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            found[key] = value
    return found


def read_env_file(path: Path) -> dict[str, str]:
    """systemd's EnvironmentFile= for the plain KEY=value lines the guide writes."""
    env = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value
    return env


@pytest.fixture
def machine(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Machine]:
    m = Machine(tmp_path)
    yield m
    m.stop_all()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(m.logs())


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def test_the_deploy_guide_brings_up_a_working_scheduler_on_one_machine(machine: Machine, target: LoopbackTarget) -> None:
    store = urlsplit(os.environ.get("DATABASE_URL", ""))
    broker = os.environ.get("CELERY_BROKER_URL", "")
    if store.scheme not in ("postgres", "postgresql") or not broker.startswith("redis://"):
        pytest.skip("needs the production layout's PostgreSQL and Redis (scripts/test.sh sets them up)")
    if not Path("/usr/share/java/zookeeper.jar").exists():
        pytest.skip("needs Debian's zookeeper package (scripts/zookeeper.sh installs it)")
    name = f"{store.path.lstrip('/')}_deploy"  # sched_h8 -> sched_h8_deploy: the guide's own database
    pg = f"psql -h {store.hostname} -p {store.port or 5432} -U {store.username or 'postgres'}"
    blocks = guide_blocks()
    tmp = machine.tmp
    client, peer, election = free_ports(3), free_ports(3), free_ports(3)
    api_port = free_ports(1)[0]
    zk_hosts = {f"zk{n}.internal:2181": f"127.0.0.1:{client[n - 1]}" for n in (1, 2, 3)}
    env_file = tmp / "etc" / "scheduler" / "scheduler.env"
    paths = {"/opt/scheduler": str(ROOT), "/etc/scheduler/scheduler.env": str(env_file)}
    machine.sh(f"{pg} -qc 'DROP DATABASE IF EXISTS {name}' -c 'DROP ROLE IF EXISTS {name}'")
    try:
        # 1. PostgreSQL: the guide's role and database.
        machine.sh(mapped(blocks["postgres"], {
            "psql -h pg.internal -U postgres": pg, "role=scheduler": f"role={name}", "db=scheduler": f"db={name}",
        }))

        # 3. ZooKeeper: three nodes, the guide's config with server.N lines and myid files.
        for n in (1, 2, 3):
            node = tmp / f"zk{n}"
            machine.sh(mapped(blocks["zookeeper-node"], {
                "ZK_ID=1": f"ZK_ID={n}",
                "/etc/zookeeper/conf": str(node / "conf"),
                "/var/lib/zookeeper": str(node / "data"),
                "clientPort=2181": f"clientPort={client[n - 1]}",
                "clientPortAddress=0.0.0.0": "clientPortAddress=127.0.0.1",
                **{f"zk{k}.internal:2888:3888": f"127.0.0.1:{peer[k - 1]}:{election[k - 1]}" for k in (1, 2, 3)},
            }))
            assert (node / "data" / "myid").read_text().strip() == str(n)
            machine.unit("zookeeper.service", {"/etc/zookeeper/conf": str(node / "conf"), "-Xms256m -Xmx512m": "-Xmx192m"})
        check = mapped(blocks["zookeeper-check"], zk_hosts)

        def ensemble() -> bool:
            try:
                modes = sorted(re.findall(r"Mode: (\w+)", machine.sh(check, timeout=20)))
            except AssertionError:
                return False  # a node not answering yet
            return modes == ["follower", "follower", "leader"]

        wait_for(ensemble, 60, "a leader and two followers")

        # 4. The environment file (the scratch paths, loopback ports, this run's own queue and ZooKeeper root).
        machine.sh(mapped(blocks["env-file"], {
            " && chgrp scheduler /etc/scheduler/scheduler.env": "",  # no such group here
            "/etc/scheduler": str(env_file.parent),
            "scheduler:CHANGE-ME@pg.internal:5432/scheduler": f"{name}:CHANGE-ME@{store.hostname}:{store.port or 5432}/{name}",
            "redis://redis.internal:6379/0": broker, "redis://redis.internal:6379/1": broker,
            **zk_hosts,
            "SCHEDULER_TARGET_ALLOWLIST=*.internal": "SCHEDULER_TARGET_ALLOWLIST=*.internal,127.0.0.1",
            "SCHEDULER_BIND=127.0.0.1:8000": f"SCHEDULER_BIND=127.0.0.1:{api_port}",
            "SCHEDULER_API_WORKERS=4": "SCHEDULER_API_WORKERS=2",
            "SCHEDULER_WORKER_PROCESSES=4": "SCHEDULER_WORKER_PROCESSES=2",
        }))
        with env_file.open("a") as extra:  # this run's own queue and coordinator root on the shared servers
            extra.write(f"SCHEDULER_RUN_QUEUE=runs-deploy-{secrets.token_hex(4)}\n"
                        f"SCHEDULER_ZK_ROOT=/scheduler-deploy-{secrets.token_hex(4)}\nSCHEDULER_SCAN_INTERVAL=0.5\n")
        settings = read_env_file(env_file)
        assert len(settings["SECRET_KEY"]) > 40 and settings["ZOOKEEPER_HOSTS"].count(",") == 2

        # 5. The schema (the one-shot unit), the first admin user and a service token.
        machine.unit("scheduler-migrate.service", paths, wait=True)
        (tmp / "admin-password").write_text(secrets.token_urlsafe(16))
        manage = f"SCHEDULER_ENV_FILE={env_file} SCHEDULER_HOME={ROOT} {ROOT / 'deploy' / 'scheduler-manage'}"
        machine.sh(mapped(blocks["first-admin"], {
            "/root/admin-password": str(tmp / "admin-password"), "/root/reports.token": str(tmp / "reports.token"),
            "sudo -E -u scheduler scheduler-manage": manage, "sudo -u scheduler scheduler-manage": manage,
        }))
        token = (tmp / "reports.token").read_text().strip()
        superuser = machine.sh(f"{pg} -d {name} -tAc \"SELECT is_superuser FROM auth_user WHERE username = 'admin'\"")
        assert superuser.strip() == "t"

        # 6. gunicorn, two scanners, two workers: the units' own command lines.
        machine.unit("scheduler-api.service", paths)
        for n in ("1", "2"):
            machine.unit("scheduler-scanner@.service", paths, instance=n)
            machine.unit("scheduler-worker@.service", paths, instance=n)
        base = f"http://127.0.0.1:{api_port}"
        proxy = {"Host": HOST, "X-Forwarded-Proto": "https"}  # what the TLS proxy of step 7 sends
        http = requests.Session()
        http.headers.update({**proxy, "Authorization": f"Token {token}"})

        def api_up() -> bool:
            try:
                return http.get(f"{base}/api/jobs/", timeout=15).status_code == 200
            except requests.RequestException:  # not listening yet, or its first request still loading
                return False

        wait_for(api_up, 60, "gunicorn to answer")
        plain = requests.get(f"{base}/api/jobs/", headers={"Host": HOST}, allow_redirects=False, timeout=15)
        assert plain.status_code == 301 and plain.headers["Location"].startswith(f"https://{HOST}/")
        login = http.get(f"{base}/admin/login/", timeout=15)
        assert login.status_code == 200 and "Secure" in login.headers.get("Set-Cookie", "Secure")

        # 8. The guide's own check of /metrics: the ensemble up, every partition held.
        metrics = mapped(blocks["metrics"], {"/etc/scheduler/scheduler.env": str(env_file),
                                             "127.0.0.1:8000": f"127.0.0.1:{api_port}"})

        def settled() -> bool:
            out = machine.sh(metrics, timeout=20)
            return "scheduler_coordinator_up 1" in out and "scheduler_partitions_unowned 0" in out

        wait_for(settled, 60, "both scanners to hold every partition")

        # A job through the API, through the proxy's headers, runs and succeeds.
        made = http.post(f"{base}/api/jobs/", json={"name": "deploy-check", "delay": "1s",
                                                    "target": target.url("/deploy")}, timeout=10)
        assert made.status_code == 201, made.text
        job = made.json()

        def succeeded() -> dict[str, Any] | None:
            runs = http.get(f"{base}/api/jobs/{job['id']}/runs/", timeout=15).json()["results"]
            return runs[0] if runs and runs[0]["status"] == "succeeded" else None

        run = wait_for(succeeded, 60, "the job's run to succeed")
        [call] = target.calls("/deploy")
        assert call.headers["Idempotency-Key"] == run["idempotency_key"]
        assert "X-Signature" in call.headers  # a service's job: signed
        assert all(proc.poll() is None for _, proc, _ in machine.procs), machine.logs()
    finally:
        machine.stop_all()
        subprocess.run(["bash", "-c", f"{pg} -qc \"SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        f"WHERE datname = '{name}'\" -c 'DROP DATABASE IF EXISTS {name}' -c 'DROP ROLE IF EXISTS {name}'"],
                       capture_output=True, timeout=60)
