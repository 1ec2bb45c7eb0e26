"""Refuse a request body over the limit with 413 before anything reads it; answer
503 with Retry-After, not 500, while the job store cannot be reached."""
from __future__ import annotations

import logging
from typing import Callable

from django.conf import settings
from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse

logger = logging.getLogger("scheduler.api")
STORE_RETRY_AFTER = 5  # seconds: a PostgreSQL restart or failover here took 1 to 10 s (docs/reliability.md)


class BodySizeLimitMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        try:
            length = int(request.META.get("CONTENT_LENGTH") or 0)
        except ValueError:
            length = 0
        if length > settings.MAX_REQUEST_BODY_BYTES:
            return JsonResponse(
                {"detail": f"Request body is {length} bytes; the limit is {settings.MAX_REQUEST_BODY_BYTES}."},
                status=413,
            )
        return self.get_response(request)


class StoreUnavailableMiddleware:
    """A request whose view could not reach the database (refused, reset, a server
    restarting or failing over) is answered 503 with Retry-After: the client's
    request was fine, the store is away for seconds, and a 500 would tell it neither.
    Nothing was written: a statement that failed to reach the store committed nothing.
    Other database errors (a constraint, a bad query) stay what they are."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not isinstance(exception, (OperationalError, InterfaceError)):
            return None
        logger.warning("%s %s: the job store is unavailable (%s)", request.method, request.path,
                       type(exception.__cause__ or exception).__name__)
        response = JsonResponse({"detail": "The job store is unavailable; try again shortly."}, status=503)
        response["Retry-After"] = str(STORE_RETRY_AFTER)
        return response
