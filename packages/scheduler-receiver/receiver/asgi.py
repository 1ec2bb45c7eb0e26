"""ASGI middleware: only calls signed by the scheduler reach the app.

    from receiver.asgi import SignedOnly
    app = SignedOnly(app, secrets=["whsec_..."])      # Starlette, FastAPI, Django's ASGI...

The body is read whole (up to 1 MiB, the scheduler's own limit), checked, and
handed on to the app unchanged; a call without a valid X-Signature gets a 401.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from receiver.signing import DEFAULT_TOLERANCE, verify_signature

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
MAX_BODY = 1024 * 1024 + 1


class SignedOnly:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], *, secrets: Sequence[str],
                 tolerance: int = DEFAULT_TOLERANCE) -> None:
        self.app, self.secrets, self.tolerance = app, list(secrets), tolerance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more and size < MAX_BODY:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        problem = verify_signature(headers.get("x-signature", ""), body, self.secrets, tolerance=self.tolerance)
        if problem is not None:
            payload = json.dumps({"detail": problem}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                (b"www-authenticate", b'X-Signature realm="scheduler"'),
            ]})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
