"""A RabbitMQ vhost of a test's own on the machine's RabbitMQ (127.0.0.1:5672, guest),
so that its queues never meet another run's; deleted at the end. The machine's
RabbitMQ is never stopped: a broker fault is its connections closed from the broker
side, for this vhost only (`close_all_connections --vhost`).

    with RabbitVhost() as mq:
        env["CELERY_BROKER_URL"] = mq.url
        ... mq.close_connections("fault") ... mq.connections() ...
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import uuid

import pytest


class RabbitVhost:
    def __init__(self, prefix: str = "sched-test") -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.url = f"amqp://guest:guest@127.0.0.1:5672/{self.name}"

    @staticmethod
    def available() -> str | None:
        """Why RabbitMQ cannot be used here, or None."""
        if shutil.which("rabbitmqctl") is None:
            return "RabbitMQ is not installed"
        try:
            socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
        except OSError:
            return "RabbitMQ is not running on 127.0.0.1:5672"
        return None

    @staticmethod
    def ctl(*args: str) -> str:
        done = subprocess.run(["rabbitmqctl", "--quiet", *args], check=True, capture_output=True, text=True,
                              timeout=60)
        return done.stdout

    def __enter__(self) -> "RabbitVhost":
        self.ctl("add_vhost", self.name)
        try:
            self.ctl("set_permissions", "-p", self.name, "guest", ".*", ".*", ".*")
        except BaseException:
            self.ctl("delete_vhost", self.name)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctl("delete_vhost", self.name)

    def connections(self) -> list[str]:
        """The names (peer addresses) of the connections open on this vhost."""
        out = self.ctl("list_connections", "--no-table-headers", "-p", self.name, "name")
        return [line.strip() for line in out.splitlines() if line.strip()]

    def close_connections(self, reason: str) -> None:
        """Close every connection on this vhost from the broker's side, as a broker
        restart does to its clients (without stopping the machine's broker)."""
        self.ctl("close_all_connections", "--vhost", self.name, reason)


def rabbit_vhost_or_skip(prefix: str = "sched-test") -> RabbitVhost:
    why = RabbitVhost.available()
    if why:
        pytest.skip(why)
    return RabbitVhost(prefix)
