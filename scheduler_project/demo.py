"""The built-in echo target of the embedded mode: a real target, built on the receiver helper."""
from __future__ import annotations

import json

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_POST

from receiver.views import idempotent_run

SHOWN = ("Idempotency-Key", "X-Fence-Token", "X-Run-Id", "X-Attempt", "X-Scheduled-For", "X-Signature")


@require_POST
@idempotent_run
def echo(request: HttpRequest) -> HttpResponse:
    try:
        payload = json.loads(request.body or b"null")
    except ValueError:
        payload = None
    return JsonResponse({"received": {h: request.headers.get(h) for h in SHOWN}, "payload": payload})
