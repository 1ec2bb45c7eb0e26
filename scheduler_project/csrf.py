"""The CSRF 403 (CSRF_FAILURE_VIEW), saying why in the case people hit most: the
production layout's cookies are Secure (SCHEDULER_SECURE_COOKIES, default on), so a
browser on plain http never sends them back and every login POST fails."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.template import loader


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    plain_http_secure_cookies = not request.is_secure() and bool(
        getattr(settings, "CSRF_COOKIE_SECURE", False) or getattr(settings, "SESSION_COOKIE_SECURE", False)
    )
    context = {
        "reason": reason,
        "plain_http_secure_cookies": plain_http_secure_cookies,
        "behind_proxy": getattr(settings, "SCHEDULER_BEHIND_TLS_PROXY", False),
    }
    body = loader.render_to_string("403_csrf.html", context, request=request)
    return HttpResponse(body, status=403)
