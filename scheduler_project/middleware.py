"""Refuse a request body over the limit with 413 before anything reads it."""
from __future__ import annotations

from typing import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse


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
