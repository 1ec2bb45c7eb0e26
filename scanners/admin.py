"""The admin's own pages: the dashboard at the top of `/admin/` (runs.dashboard), and
the system page, `/admin/system/`: which scanner holds which partitions, queue
depth, runs late now, lag from due to start, per-target bulkhead and breaker, and
the workers' heartbeats.

Registered on the default admin site through its get_urls (the project keeps
Django's own AdminSite, so `/admin/jobs/job/` and `/admin/runs/run/` stay put).
Every figure comes from `runs.metrics`, the same selectors `/metrics` serves.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from runs import dashboard, metrics, workers
from runs.models import PausedTarget


def system_view(request: HttpRequest) -> HttpResponse:
    if not request.user.has_perm("runs.view_run"):
        raise PermissionDenied
    now = timezone.now()
    scanners = metrics.scanner_figures()
    context = {
        **admin.site.each_context(request),
        "title": "System",
        "now": now,
        "scanners": scanners,
        "owners": sorted(scanners.owners.items()),
        "partitions": settings.SCHEDULER_PARTITIONS,
        "queue": metrics.queue_figures(now),
        "broker_length": metrics.broker_queue_length(),
        "broker_queue": settings.CELERY_TASK_DEFAULT_QUEUE,
        "lag": metrics.lag_figures(now),
        "lag_minutes": int(metrics.LAG_WINDOW.total_seconds() // 60),
        "targets": metrics.target_states(now),
        "concurrency": settings.SCHEDULER_TARGET_CONCURRENCY,
        "paused_targets": list(PausedTarget.objects.order_by("host")[:200]),
        "workers": workers.worker_figures(now),
        "heartbeat": workers.interval(),
        "grace": settings.SCHEDULER_MISFIRE_GRACE,
    }
    return TemplateResponse(request, "admin/system.html", context)


def _with_dashboard(index: Any) -> Any:
    def view(request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        context = dict(extra_context or {})
        if request.user.has_perm("runs.view_run"):
            board = dashboard.dashboard()
            context.update(dashboard=board, charts=board.charts())
        return index(request, extra_context=context)

    return view


def _with_system_page(get_urls: Any) -> Any:
    def urls() -> list[Any]:
        return [path("system/", admin.site.admin_view(system_view), name="system"), *get_urls()]

    return urls


admin.site.get_urls = _with_system_page(admin.site.get_urls)  # type: ignore[method-assign]
admin.site.index = _with_dashboard(admin.site.index)  # type: ignore[method-assign]
# Titled for the product, not "Django administration".
admin.site.site_header = "Scheduler"
admin.site.site_title = "Scheduler admin"
admin.site.index_title = "Dashboard"
# No app sidebar on every page: three apps do not need it, and the lists need its 280 px
# to fit a 1366 px window with their filters (the breadcrumbs and the home page link them).
admin.site.enable_nav_sidebar = False
