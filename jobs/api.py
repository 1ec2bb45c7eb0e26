"""The REST API under /api/: thin DRF views over jobs.services (writes) and
jobs.selectors (reads, scoped to the caller).

Choices where the CONTRACT is silent:
- `{id}` is `job_12` / `run_5` or a bare `12`; anything else, and another
  service's object, is 404 with the same words, so an id's existence never leaks.
- PATCH on a deleted job is 409 Conflict ("job_12 is deleted ..."): the request
  is well formed, the job's state refuses it. DELETE on a deleted job is 204 again
  and changes nothing (a retried DELETE must not fail or move `deleted_at`).
- Any other ValueError a service raises is a 400 `{"detail": "<its words>"}`.
- A job's runs are newest scheduled time first; `/api/runs/` is newest first by
  id (the order its index serves, so the dead list stays cheap).
- An `at` without an offset is resolved in the job's zone when it is given
  (on PATCH, the zone in the same body, else the stored one); changing only the
  zone later leaves that instant where it is.
"""
from __future__ import annotations

import json
from typing import Any

from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
)
from rest_framework import status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import (
    APIException,
    NotFound,
    ParseError,
    ValidationError,
)
from rest_framework.parsers import JSONParser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.serializers import BaseSerializer

from jobs import selectors, services
from jobs.models import Job
from jobs.public_ids import parse_id
from jobs.serializers import (
    JobSerializer,
    RunDetailSerializer,
    RunSerializer,
    json_type_name,
)
from runs.models import Run


class StrictJSONParser(JSONParser):
    """DRF's JSON parser, also refusing with a 400 what would otherwise fail later
    as a 500: nesting deep enough to exhaust the stack, numbers like 1e400 (parsed
    as infinity, which jsonb refuses) and lone surrogates (which UTF-8 cannot encode)."""

    def parse(self, stream: Any, media_type: str | None = None, parser_context: Any = None) -> Any:
        try:
            data = super().parse(stream, media_type, parser_context)
            json.dumps(data, allow_nan=False, ensure_ascii=False).encode("utf-8")
        except RecursionError as exc:
            raise ParseError("JSON parse error - the body is nested too deeply") from exc
        except UnicodeEncodeError as exc:
            raise ParseError("JSON parse error - the body holds invalid Unicode (a lone surrogate)") from exc
        except ValueError as exc:
            raise ParseError("JSON parse error - the body holds a number out of range (like 1e400)") from exc
        return data


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_code = "conflict"


class ServiceRefused(APIException):
    status_code = status.HTTP_400_BAD_REQUEST
    default_code = "invalid"


STATUS_PARAMETER = OpenApiParameter(
    "status", OpenApiTypes.STR, OpenApiParameter.QUERY, enum=list(selectors.RUN_STATUSES),
    description="Only runs with this status; `dead` is the dead list.",
)
JOB_ID = OpenApiParameter("id", OpenApiTypes.STR, OpenApiParameter.PATH, description="A job id, like job_12.")
RUN_ID = OpenApiParameter("id", OpenApiTypes.STR, OpenApiParameter.PATH, description="A run id, like run_5.")
NOT_FOUND = OpenApiResponse(description="No such job or run, or not the caller's.")


def status_filter(request: Request) -> str | None:
    """`?status=`: empty means no filter; an unknown value is a 400 naming `status`."""
    value = request.query_params.get("status", "")
    if not value:
        return None
    if value not in selectors.RUN_STATUSES:
        known = ", ".join(selectors.RUN_STATUSES)
        raise ValidationError({"status": [f"unknown status {value!r}: use one of {known}"]})
    return value


def require_object_body(request: Request) -> dict[str, Any]:
    """The body must be a JSON object; a list or null gets words, not a 500."""
    data = request.data
    if not isinstance(data, dict):
        message = f"the request body must be a JSON object, not {json_type_name(data)}"
        raise ValidationError({"non_field_errors": [message]})
    return data


def paginated(view: viewsets.GenericViewSet, runs: QuerySet[Run]) -> Response:
    page = view.paginate_queryset(runs)
    return view.get_paginated_response(RunSerializer(page, many=True).data)


@extend_schema_view(
    list=extend_schema(summary="The caller's jobs, newest first"),
    create=extend_schema(summary="Create a job and its first run", responses={201: JobSerializer}),
    retrieve=extend_schema(summary="One job", parameters=[JOB_ID], responses={200: JobSerializer, 404: NOT_FOUND}),
    partial_update=extend_schema(
        summary="Change a job; {\"paused\": true/false} pauses or resumes it",
        parameters=[JOB_ID],
        responses={200: JobSerializer, 404: NOT_FOUND, 409: OpenApiResponse(description="The job is deleted.")},
    ),
    destroy=extend_schema(
        summary="End a job: its waiting run is cancelled, its history stays readable",
        parameters=[JOB_ID],
        responses={204: None, 404: NOT_FOUND},
    ),
)
class JobViewSet(viewsets.GenericViewSet):
    serializer_class = JobSerializer
    parser_classes = (StrictJSONParser,)
    lookup_url_kwarg = "id"
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[Job]:
        if getattr(self, "swagger_fake_view", False):  # schema generation has no caller
            return Job.objects.none()
        return selectors.jobs_for(self.request.user)

    def get_object(self) -> Job:
        raw = self.kwargs[self.lookup_url_kwarg]
        job_id = parse_id("job", raw)
        job = selectors.job_get(self.request.user, job_id) if job_id is not None else None
        if job is None:
            raise NotFound(f"No job {raw}.")
        return job

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)

    def create(self, request: Request) -> Response:
        serializer = self.get_serializer(data=require_object_body(request))
        serializer.is_valid(raise_exception=True)
        job = call_service(services.job_create, owner=request.user, fields=serializer.service_fields())
        return Response(self.get_serializer(job).data, status=status.HTTP_201_CREATED)

    def retrieve(self, request: Request, id: str) -> Response:
        return Response(self.get_serializer(self.get_object()).data)

    def partial_update(self, request: Request, id: str) -> Response:
        job = self.get_object()
        if job.state == Job.State.DELETED:
            raise Conflict(f"{job.public_id} is deleted; a deleted job cannot be changed")
        serializer = self.get_serializer(job, data=require_object_body(request), partial=True)
        serializer.is_valid(raise_exception=True)
        job = call_service(services.job_update, job=job, fields=serializer.service_fields())
        return Response(self.get_serializer(job).data)

    def destroy(self, request: Request, id: str) -> Response:
        job = self.get_object()
        if job.state != Job.State.DELETED:
            call_service(services.job_delete, job=job)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(
        summary="The job's runs, newest first",
        parameters=[JOB_ID, STATUS_PARAMETER],
        responses={200: RunSerializer(many=True), 404: NOT_FOUND},
    )
    @action(detail=True, methods=["get"], url_path="runs")
    def runs(self, request: Request, id: str) -> Response:
        wanted = status_filter(request)
        return paginated(self, selectors.runs_with_status(selectors.job_runs(self.get_object()), wanted))


def call_service(function: Any, **kwargs: Any) -> Any:
    """A ValueError from a service is the caller's mistake in words: a 400."""
    try:
        return function(**kwargs)
    except ValueError as exc:
        raise ServiceRefused(str(exc)) from exc


@extend_schema_view(
    list=extend_schema(summary="The caller's runs, newest first; ?status=dead is the dead list",
                       parameters=[STATUS_PARAMETER]),
    retrieve=extend_schema(summary="One run with its timeline", parameters=[RUN_ID],
                           responses={200: RunDetailSerializer, 404: NOT_FOUND}),
)
class RunViewSet(viewsets.GenericViewSet):
    serializer_class = RunSerializer
    lookup_url_kwarg = "id"
    lookup_value_regex = "[^/]+"

    def get_queryset(self) -> QuerySet[Run]:
        if getattr(self, "swagger_fake_view", False):  # schema generation has no caller
            return Run.objects.none()
        return selectors.runs_for(self.request.user)

    def get_serializer_class(self) -> type[BaseSerializer]:
        return RunDetailSerializer if self.action == "retrieve" else RunSerializer

    def list(self, request: Request) -> Response:
        return paginated(self, selectors.runs_with_status(self.get_queryset(), status_filter(request)))

    def retrieve(self, request: Request, id: str) -> Response:
        run_id = parse_id("run", id)
        run = selectors.run_get(request.user, run_id) if run_id is not None else None
        if run is None:
            raise NotFound(f"No run {id}.")
        return Response(RunDetailSerializer(run).data)

