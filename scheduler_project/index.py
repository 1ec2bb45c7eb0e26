"""`GET /api/`: the API's index, its links and how to authenticate; `/` sends a browser to the admin.

The index is public, like the schema and docs page it links to: it holds no data,
only where things are, so a newcomer who opens the printed API URL sees where to go.
"""
from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

from scheduler_project.version import VERSION

LINKS = {
    "jobs": "job-list",
    "runs": "run-list",
    "dead_runs": "run-list",
    "breakers": "breakers",
    "audit": "audit-list",
    "schema": "schema",
    "docs": "docs",
}

class ApiRoot(APIView):
    permission_classes = [AllowAny]
    throttle_classes: list[Any] = []  # no data and no token to count against

    # Left out of the schema like the schema and docs pages themselves: it is where to
    # find the operations, not one of them (and has no input to fuzz).
    @extend_schema(exclude=True)
    def get(self, request: Request) -> Response:
        links = {name: reverse(url, request=request) for name, url in LINKS.items()}
        links["dead_runs"] += "?status=dead"
        return Response(
            {
                "version": VERSION,
                "authentication": "Every call but this index, the schema and the docs needs "
                "`Authorization: Token <token>` (python manage.py create_service_token NAME makes one).",
                "links": links,
            }
        )
