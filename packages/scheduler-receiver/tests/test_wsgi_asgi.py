"""Plain WSGI and ASGI targets: the middleware lets signed calls through, body intact,
and answers anything else with a 401 that says why."""
from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
from typing import Any
from wsgiref.util import setup_testing_defaults

from receiver.asgi import SignedOnly as AsgiSignedOnly
from receiver.signing import sign
from receiver.wsgi import SignedOnly as WsgiSignedOnly

SECRETS = ["whsec_a"]
BODY = b'{"report":"daily"}'


def echo_wsgi(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
    start_response("200 OK", [("Content-Type", "application/json")])
    return [body]


def wsgi_call(app: Any, body: bytes, signature: str | None) -> tuple[str, bytes]:
    environ: dict[str, Any] = {"REQUEST_METHOD": "POST", "CONTENT_LENGTH": str(len(body)),
                               "wsgi.input": io.BytesIO(body)}
    if signature is not None:
        environ["HTTP_X_SIGNATURE"] = signature
    setup_testing_defaults(environ)
    got: dict[str, str] = {}
    out = b"".join(app(environ, lambda status, headers: got.setdefault("status", status)))
    return got["status"], out


def test_a_wsgi_app_gets_a_signed_call_with_its_body() -> None:
    status, out = wsgi_call(WsgiSignedOnly(echo_wsgi, secrets=SECRETS), BODY, sign(BODY, SECRETS))
    assert status == "200 OK" and out == BODY


def test_a_wsgi_app_never_sees_an_unsigned_or_forged_call() -> None:
    app = WsgiSignedOnly(echo_wsgi, secrets=SECRETS)
    for signature in (None, sign(BODY, ["whsec_other"]), sign(b"other", SECRETS)):
        status, out = wsgi_call(app, BODY, signature)
        assert status.startswith("401") and "detail" in json.loads(out)


async def echo_asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": message["body"]})


def asgi_call(app: Any, chunks: list[bytes], signature: str | None) -> tuple[int, bytes]:
    headers = [(b"x-signature", signature.encode())] if signature is not None else []
    scope = {"type": "http", "method": "POST", "headers": headers}
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_an_asgi_app_gets_a_signed_call_sent_in_pieces_whole() -> None:
    status, out = asgi_call(AsgiSignedOnly(echo_asgi, secrets=SECRETS), [BODY[:5], BODY[5:]], sign(BODY, SECRETS))
    assert (status, out) == (200, BODY)


def test_an_asgi_app_never_sees_a_forged_call() -> None:
    status, out = asgi_call(AsgiSignedOnly(echo_asgi, secrets=SECRETS), [BODY], sign(BODY, ["whsec_other"]))
    assert status == 401 and "does not match" in json.loads(out)["detail"]


def test_the_plain_python_parts_import_without_django() -> None:
    code = ("import sys; import receiver, receiver.signing, receiver.rules, receiver.wsgi, receiver.asgi; "
            "assert 'django' not in sys.modules, 'django was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
