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

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str, answers: list[Any]) -> None:
        self.name, self.answers, self.asked = name, list(answers), 0
        real = socket.getaddrinfo

        def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
            if host != name:
                return real(host, port, *args, **kwargs)
            self.asked += 1
            answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
            if answer is None:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            addresses = answer if isinstance(answer, list) else [answer]
            return [info for address in addresses for info in real(address, port, *args, **kwargs)]

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

    assert other.requests() == []  # the address a second lookup would give got nothing
    assert resolver.asked == 1  # resolved once, for the check; the connect used that address
    [request] = checked.requests("/hook")
    assert request.headers["Host"] == f"rebind.test:{checked.port}"  # the name still travels as Host


def test_a_name_with_several_addresses_falls_back_to_the_next_checked_one_and_no_other(
    service: Any, monkeypatch: pytest.MonkeyPatch, two_targets: tuple[RawTarget, RawTarget]
) -> None:
    checked, other = two_targets
    # 127.0.0.3 has nothing listening on the port: refused, so the next checked address is tried.
    resolver = Resolver(monkeypatch, "two.test", [["127.0.0.3", "127.0.0.1"], "127.0.0.2"])
    run = queued_run(service.user, f"http://two.test:{checked.port}/hook")

    assert run_execute(run_id=run.pk) == "succeeded"

    assert len(checked.requests("/hook")) == 1 and other.requests() == []
    assert resolver.asked == 1


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


def self_signed(name: str, directory: Any) -> tuple[str, str]:
    """A certificate for `name` no CA vouches for, and its key (PEM files)."""
    from datetime import datetime, timedelta, timezone as dt_timezone

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(dt_timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_an_https_call_to_the_pinned_address_still_names_the_host_for_sni_and_the_certificate(
    service: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    import ssl
    import threading

    cert, key = self_signed("pinned.test", tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names: list[str | None] = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)  # type: ignore[assignment,misc]
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    port = listener.getsockname()[1]

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        except OSError:
            pass  # the worker does not trust this certificate: it hangs up in the handshake

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    Resolver(monkeypatch, "pinned.test", ["127.0.0.1", "127.0.0.2"])
    run = queued_run(service.user, f"https://pinned.test:{port}/hook", timeout_seconds=2)
    try:
        assert run_execute(run_id=run.pk) == "retry_scheduled"
        thread.join(5)
    finally:
        listener.close()
    assert names == ["pinned.test"]  # SNI names the host, though the socket went to 127.0.0.1
    run.refresh_from_db()
    assert run.last_error == "TLS error"  # and the certificate was checked (no CA vouches for this one)


def test_a_host_two_parsers_read_differently_is_refused_at_call_time(
    service: Any, two_targets: tuple[RawTarget, RawTarget]
) -> None:
    checked, _ = two_targets
    # Written past the API's checks: urlsplit reads the host as "127.0.0.1\.allowed.internal"
    # (which does not resolve), the connecting library as 127.0.0.1.
    run = queued_run(service.user, f"http://127.0.0.1\\.allowed.internal:{checked.port}/hook")

    assert run_execute(run_id=run.pk) == "dead"

    assert checked.requests() == []
    run.refresh_from_db()
    assert "parsers disagree" in run.last_error  # the one parse (jobs.validators.parse_target) refuses it
