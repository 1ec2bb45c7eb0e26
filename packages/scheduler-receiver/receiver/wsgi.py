"""WSGI middleware: only calls signed by the scheduler reach the app.

    from receiver.wsgi import SignedOnly
    application = SignedOnly(application, secrets=["whsec_..."])

A call without a valid X-Signature gets a 401 with a JSON `detail` saying why; a
signed call reaches the app with its body intact (wsgi.input is replayed).
"""
from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from receiver.signing import DEFAULT_TOLERANCE, verify_signature

MAX_BODY = 1024 * 1024 + 1


class SignedOnly:
    def __init__(self, app: Callable[..., Iterable[bytes]], *, secrets: Sequence[str],
                 tolerance: int = DEFAULT_TOLERANCE) -> None:
        self.app, self.secrets, self.tolerance = app, list(secrets), tolerance

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        body = environ["wsgi.input"].read(min(max(length, 0), MAX_BODY)) if length else b""
        problem = verify_signature(environ.get("HTTP_X_SIGNATURE", ""), body, self.secrets, tolerance=self.tolerance)
        if problem is not None:
            payload = json.dumps({"detail": problem}).encode()
            start_response("401 Unauthorized", [("Content-Type", "application/json"),
                                                ("Content-Length", str(len(payload))),
                                                ("WWW-Authenticate", 'X-Signature realm="scheduler"')])
            return [payload]
        environ["wsgi.input"] = io.BytesIO(body)
        return self.app(environ, start_response)
