"""The soak's target: an idempotent receiver built on `receiver.views.idempotent_run`.

Served by gunicorn (bench/soak_stack.py) on two loopback ports, which the
scheduler sees as two target hosts. Each applied effect is a row in
`soak_effects`, written inside the helper's transaction, so it commits with the
helper's "applied" mark; every call, whatever became of it, is a row in
`soak_calls` (applied, replayed, refused by the fence, or failed). The soak
makes both tables (bench/soak_stack.py's TARGET_SCHEMA) and counts effects
applied twice from them.

The soak tells a port to misbehave for a while through a small JSON file
(SOAK_TARGET_CONTROL): {"<port>": {"mode": "slow" | "error", "until": <unix time>,
"slow_s": 3}}. "error" answers 503 before the effect, "slow" applies it after
`slow_s` seconds; otherwise each call takes 20 to 300 ms, long enough for the
soak to catch a worker in the middle of one.
"""
from __future__ import annotations

import json
import os
import random
import time
from typing import Any

from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from receiver.views import idempotent_run


def _port(request: HttpRequest) -> int:
    host = request.get_host()
    return int(host.rsplit(":", 1)[1]) if ":" in host else 80


def _mode(port: int) -> tuple[str, float]:
    try:
        with open(os.environ["SOAK_TARGET_CONTROL"]) as f:
            entry: dict[str, Any] = json.load(f).get(str(port)) or {}
    except (OSError, ValueError, KeyError):
        return "ok", 0.0
    if float(entry.get("until", 0)) <= time.time():
        return "ok", 0.0
    return str(entry.get("mode", "ok")), float(entry.get("slow_s", 3))


@idempotent_run
def _apply(request: HttpRequest) -> HttpResponse:
    port = _port(request)
    mode, slow = _mode(port)
    if mode == "error":
        return JsonResponse({"error": "told to fail"}, status=503)
    hold = request.GET.get("hold", "")  # the overlap action's slow jobs (bench/soak_actions.py)
    time.sleep(float(hold) if hold.isdigit() else slow if mode == "slow" else random.uniform(0.02, 0.3))
    key, fence = request.headers["Idempotency-Key"], int(request.headers["X-Fence-Token"])
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO soak_effects (key, fence, run_id, port) VALUES (%s, %s, %s, %s)",
            [key, fence, request.headers.get("X-Run-Id", ""), port],
        )
    return JsonResponse({"applied": key, "fence": fence})


def _outcome(response: HttpResponse) -> str:
    if response.status_code == 409:
        return "refused"
    if response.get("Idempotent-Replay") == "true":
        return "replayed"
    return "applied" if 200 <= response.status_code < 300 else "failed"


@csrf_exempt
def hook(request: HttpRequest, name: str) -> HttpResponse:
    arrived = time.time()
    response = _apply(request)
    fence, attempt = request.headers.get("X-Fence-Token", ""), request.headers.get("X-Attempt", "")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO soak_calls (key, fence, attempt, run_id, port, outcome, status, arrived, answered)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)",
            [request.headers.get("Idempotency-Key", ""), int(fence) if fence.isdigit() else None,
             int(attempt) if attempt.isdigit() else None, request.headers.get("X-Run-Id", ""), _port(request),
             _outcome(response), response.status_code, arrived, time.time()],
        )
    return response


urlpatterns = [path("hook/<str:name>", hook)]
