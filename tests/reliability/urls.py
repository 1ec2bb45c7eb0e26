"""The project's URLs plus GET /api/breakers/, until the lead wires it in scheduler_project/urls.py."""
from __future__ import annotations

from django.urls import path

from runs.api import BreakerList
from scheduler_project.urls import urlpatterns as project_urlpatterns

urlpatterns = [path("api/breakers/", BreakerList.as_view(), name="breakers"), *project_urlpatterns]
