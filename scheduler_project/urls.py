"""URLs: the admin, the REST API under /api/, its OpenAPI schema and docs page."""
from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework.routers import SimpleRouter

from jobs.api import AuditViewSet, JobViewSet, RunViewSet
from runs.api import BreakerList
from runs.metrics import metrics_view
from scheduler_project import demo
from scheduler_project.index import ApiRoot

# SimpleRouter, not DefaultRouter: the API root is our own public index (scheduler_project.index).
router = SimpleRouter()
router.register("jobs", JobViewSet, basename="job")
router.register("runs", RunViewSet, basename="run")
router.register("audit", AuditViewSet, basename="audit")

urlpatterns = [
    # A browser that opens the server's address (or the admin's "View site") lands in the admin.
    path("", RedirectView.as_view(url="/admin/", permanent=False), name="home"),
    path("admin/", admin.site.urls),
    path("api/", ApiRoot.as_view(), name="api-root"),
    path("api/breakers/", BreakerList.as_view(), name="breakers"),
    path("api/", include(router.urls)),
    # drf-spectacular's defaults leave these two readable without a token (documentation,
    # no data), so a browser can open the docs page; its assets are served from
    # drf-spectacular-sidecar's static files, not a CDN.
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    # The split view serves Swagger UI's start-up script as its own request (?script=),
    # not inline: the Content-Security-Policy allows no inline script (settings.py).
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema"), name="docs"),
    # Prometheus text format; SCHEDULER_METRICS_TOKEN, if set, guards it.
    path("metrics", metrics_view, name="metrics"),
]

if settings.EMBEDDED:
    # The embedded mode's built-in echo target (a real target, on the receiver helper).
    urlpatterns.append(path("demo/echo/", demo.echo, name="demo-echo"))
