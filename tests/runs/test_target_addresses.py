"""The worker connects to the address it checked (no DNS rebinding between the check
and the connect), and a name that does not resolve is a failed call, never an allowed one.

DNS is the boundary faked here, in-process and only for names under `.test`: every
other lookup (the loopback addresses the worker then connects to) is the real one."""
from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from runs import delivery
from runs.models import Run
from runs.services import run_execute
from tests.raw_target import RawRequest, RawTarget, answer
from tests.runs.calls import events_of, queued_run

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status


class Resolver:
    """Answers for one name, in order (the last answer repeats); an answer of None is a failure."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, answers: list[str | None]) -> None:
        self.name, self.answers, self.asked = name, list(answers), 0
        real = socket.getaddrinfo

        def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if host != name:
                return real(host, port, *args, **kwargs)
            self.asked += 1
            address = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            if address is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return real(address, port, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def ok(conn: socket.socket, request: RawRequest) -> bool:
    conn.sendall(answer(200, b"ok"))
    return True


@pytest.fixture
def two_targets() -> Iterator[tuple[RawTarget, RawTarget]]:
    """The checked address (127.0.0.1) and the one a rebinding would lead to (127.0.0.2), same port."""
    checked = RawTarget(ok).start()
    other = RawTarget(ok, host="127.0.0.2", port_wanted=checked.port).start()
    yield checked, other
    delivery.close_connections()
    checked.stop()
    other.stop()


def test_a_second_resolution_cannot_redirect_the_call(
    service: Any, monkeypatch: pytest.MonkeyPatch, two_targets: tuple[RawTarget, RawTarget]
) -> None:
    checked, other = two_targets
    resolver = Resolver(monkeypatch, "rebind.test", ["127.0.0.1", "127.0.0.2"])
    run = queued_run(service.user, f"http://rebind.test:{checked.port}/hook")

    assert run_execute(run_id=run.pk) == "succeeded"

    assert resolver.asked == 1  # resolved once, for the check; the connect used that address
    assert other.requests() == []
    [request] = checked.requests("/hook")
    assert request.headers["Host"] == f"rebind.test:{checked.port}"  # the name still travels as Host


def test_a_name_that_does_not_resolve_is_a_failed_call_even_if_a_later_lookup_would_succeed(
    service: Any, monkeypatch: pytest.MonkeyPatch, two_targets: tuple[RawTarget, RawTarget]
) -> None:
    checked, _ = two_targets
    Resolver(monkeypatch, "flaky.test", [None, "127.0.0.1"])
    run = queued_run(service.user, f"http://flaky.test:{checked.port}/hook")

    assert run_execute(run_id=run.pk) == "retry_scheduled"

    assert checked.requests() == []
    run.refresh_from_db()
    assert run.status == S.SCHEDULED and run.last_error == "DNS failure"
    assert [d for t, d in events_of(run) if t == "target_answered"][0]["error"] == "DNS failure"


def test_a_name_resolving_to_a_metadata_address_on_the_check_is_refused(
    service: Any, monkeypatch: pytest.MonkeyPatch, two_targets: tuple[RawTarget, RawTarget]
) -> None:
    checked, _ = two_targets
    Resolver(monkeypatch, "meta.test", ["169.254.169.254", "127.0.0.1"])
    run = queued_run(service.user, f"http://meta.test:{checked.port}/hook")

    assert run_execute(run_id=run.pk) == "dead"

    assert checked.requests() == []
    run.refresh_from_db()
    assert "link-local or metadata" in run.last_error
