"""Real processes for integration tests: scanners, Celery workers, a private Redis.

Every process started here is ended here, by its own id (its process group).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from django.db import connection

from bench.harness import Proc
from bench.soak_stack import PrivateRedis
from jobs.services import service_account_ensure
from tests.rabbitmq import RabbitVhost, rabbit_vhost_or_skip
from tests.target import LoopbackTarget

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.2, what: str = "condition") -> Any:
    """Poll until predicate() is truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


class Stack:
    """Scanner and worker processes sharing the test database, a broker and a coordinator."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.env = env
        self.log_dir = log_dir
        self.procs: list[Proc] = []

    def scanner(self, name: str, **env: str) -> Proc:
        """A scanner; `env` overrides the stack's environment for it alone."""
        argv = [sys.executable, "manage.py", "scanner", "--identifier", name]
        return self._start(name, argv, env)

    def worker(self, name: str, concurrency: int = 2, pool: str = "prefork", **env: str) -> Proc:
        return self._start(name, self.worker_argv(name, concurrency, pool), env)

    @staticmethod
    def worker_argv(name: str, concurrency: int = 2, pool: str = "prefork") -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", "scheduler_project", "worker", "-l", "INFO",
            "-c", str(concurrency), "-P", pool, "-n", f"{name}@%h",
            "--without-heartbeat", "--without-gossip", "--without-mingle",
        ]

    def command(self, name: str, argv: list[str], **env: str) -> Proc:
        """Any other process of the test's (argv as given, from the project's root)."""
        return self._start(name, argv, env)

    def _start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, {**self.env, **(env or {})}, self.log_dir)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {p.name} -----\n{p.output()[-4000:]}" for p in self.procs)


class Broker:
    """The run queue's broker for a test's processes: the suite's Redis, or a fresh
    RabbitMQ vhost (`vhost`) made for the test and deleted after it."""

    def __init__(self, kind: str, url: str, vhost: RabbitVhost | None = None) -> None:
        self.kind, self.url, self.vhost = kind, url, vhost


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked `amqp` runs twice: on the suite's Redis and on a RabbitMQ vhost."""
    if metafunc.definition.get_closest_marker("amqp") and "broker" in metafunc.fixturenames:
        metafunc.parametrize("broker", ["redis", "amqp"], indirect=True)


@pytest.fixture
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    kind = getattr(request, "param", "redis")
    if kind == "redis":
        yield Broker("redis", os.environ.get("CELERY_BROKER_URL", ""))
        return
    if not os.environ.get("ZOOKEEPER_HOSTS") or connection.vendor != "postgresql":
        pytest.skip("needs the production layout (scripts/test.sh sets it up)")  # before making a vhost
    with rabbit_vhost_or_skip() as vhost:
        yield Broker("amqp", vhost.url, vhost)


@pytest.fixture
def integration_env(transactional_db: None, tmp_path: Path, broker: Broker) -> dict[str, str]:
    if not os.environ.get("ZOOKEEPER_HOSTS") or connection.vendor != "postgresql":
        pytest.skip("needs the production layout (scripts/test.sh sets it up)")
    db = connection.settings_dict
    env = dict(os.environ)
    if broker.kind == "amqp":
        # The processes' run queue on RabbitMQ; their bulkhead follows the broker
        # (SCHEDULER_BULKHEAD's default: `database` for any broker but Redis).
        env.pop("SCHEDULER_BULKHEAD_REDIS_URL", None)
        env.pop("SCHEDULER_BULKHEAD", None)
        env.pop("SCHEDULER_TASK_BROKER_URL", None)
        env["CELERY_BROKER_URL"] = broker.url
    env.update(
        {
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "SCHEDULER_RUN_QUEUE": f"runs-test-{uuid.uuid4().hex[:8]}",
            "SCHEDULER_ZK_ROOT": f"/scheduler-test-{uuid.uuid4().hex[:8]}",
            "SCHEDULER_SCAN_INTERVAL": "0.5",
            "SCHEDULER_ZK_SESSION_TIMEOUT": "4",
            "SCHEDULER_DATA_DIR": str(tmp_path / "var"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def stack(integration_env: dict[str, str], tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    s = Stack(integration_env, tmp_path)
    yield s
    s.stop_all()
    if getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed:
        print(s.logs())


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


class Api:
    def __init__(self, base: str, token: str) -> None:
        self.base = base.rstrip("/")
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Token {token}"

    def create_job(self, **body: Any) -> dict[str, Any]:
        response = self.http.post(f"{self.base}/api/jobs/", json=body, timeout=10)
        assert response.status_code == 201, response.text
        return response.json()

    def get(self, path: str, **params: Any) -> Any:
        response = self.http.get(f"{self.base}{path}", params=params, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture
def api(live_server: Any, integration_env: dict[str, str]) -> Api:
    _, token = service_account_ensure(name="integration", email="owner@example.test")
    return Api(live_server.url, token)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = PrivateRedis(tmp_path)
    yield server
    server.stop()
