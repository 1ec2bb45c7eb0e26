"""In the production layout (scanner and worker processes, PostgreSQL, Redis,
ZooKeeper): a dead run's owner is told by a signed https webhook and by e-mail
through a real SMTP server (aiosmtpd, started here) named by EMAIL_URL."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from jobs.models import ServiceAccount
from receiver.views import verify_signature
from runs.models import Notice
from runs.signing import live_secrets
from tests.integration.conftest import Api, Stack, wait_for
from tests.target import LoopbackTarget
from tests.webhook import HttpsWebhook

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]


class Inbox:
    """An SMTP server on loopback that keeps what it is sent."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.messages: list[Any] = []
        self._lock = threading.Lock()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 (aiosmtpd's name)
        with self._lock:
            self.messages.append(envelope)
        return "250 OK"

    def received(self) -> list[Any]:
        with self._lock:
            return list(self.messages)


@pytest.fixture
def inbox() -> Iterator[Inbox]:
    server = Inbox()
    server.controller.start()
    yield server
    server.controller.stop()


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[HttpsWebhook]:
    server = HttpsWebhook(tmp_path / "tls").start()
    yield server
    server.stop()


def test_a_dead_run_notifies_a_signed_webhook_and_an_smtp_server(
    stack: Stack, api: Api, target: LoopbackTarget, webhook: HttpsWebhook, inbox: Inbox
) -> None:
    stack.env.update({
        "EMAIL_URL": f"smtp://127.0.0.1:{inbox.port}",
        "DEFAULT_FROM_EMAIL": "scheduler@deploy.test",
        "SCHEDULER_TLS_CA_FILE": webhook.cert,
    })
    stack.scanner("scanner-a")
    stack.worker("worker-a")
    target.script("/bad", [400])
    hooked = api.create_job(name="hooked", delay="1s", target=target.url("/bad"), notify=webhook.url("/dead"))
    mailed = api.create_job(name="mailed", delay="1s", target=target.url("/bad"), notify="oncall@example.test")

    [call] = wait_for(lambda: webhook.calls("/dead"), 60, what="the webhook notice")
    secrets = live_secrets(ServiceAccount.objects.get(user__username="integration"), timezone.now())
    assert verify_signature(call.headers["X-Signature"], call.body, secrets, tolerance=300) is None
    notice = json.loads(call.body)
    assert notice["job"]["id"] == hooked["id"] and notice["count"] == 1
    assert notice["notices"][0]["kind"] == "dead" and "HTTP 400" in notice["notices"][0]["reason"]

    [message] = wait_for(inbox.received, 60, what="the e-mail notice")
    assert message.mail_from == "scheduler@deploy.test" and message.rcpt_tos == ["oncall@example.test"]
    text = message.content.decode()
    assert "mailed: 1 dead run(s)" in text and mailed["id"] in text and "HTTP 400" in text
    # A notice is marked sent once the server has taken it: the mail can be in the
    # inbox a moment before its row says so (seen once in CI: still `pending`).
    sent = {("sent", webhook.url("/dead")), ("sent", "oncall@example.test")}
    wait_for(lambda: set(Notice.objects.values_list("status", "sent_to")) == sent, 30, what="both notices marked sent")
