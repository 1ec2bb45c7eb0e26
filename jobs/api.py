"""The REST API under /api/: thin DRF views over jobs.services (writes) and
jobs.selectors (reads, scoped to the caller).

Choices made here, beyond the API fields in docs/reference.md:
- `{id}` is `job_12` / `run_5` or a bare `12`; anything else, and another
  service's object, is 404 with the same words, so an id's existence never leaks.
- PATCH on a deleted job is 409 Conflict ("job_12 is deleted ..."): the request
  is well formed, the job's state refuses it. DELETE on a deleted job is 204 again
  and changes nothing (a retried DELETE must not fail or move `deleted_at`).
- Any other ValueError a service raises is a 400 `{"detail": "<its words>"}`.
- A job defined in code (`defined_in`, jobs.code) is changed there: PATCH of
  anything but `paused` and DELETE are 409 ("job_12 is defined in code by
  billing.schedules; change it there and run sync_jobs"). Pausing and resuming
  stay open (an operator's switch in an incident), and so does run-now.
- `POST /api/jobs/{id}/run/` and `POST /api/runs/{id}/retry/` call the same
  services as the admin (jobs.ops.job_trigger, runs.ops.run_retry); what they
  refuse (a deleted or paused job, a paused target host, a run that is not dead)
  is a 409 `{"detail": "<the reason>"}`, like PATCH on a deleted job. Run-now is
  once per second: a second call in the same second is a 409 naming the run that
  has that second (its Idempotency-Key is `<job id>@<that second>`), not a second
  run under a shifted key.
- Every write is audited (jobs.audit): created, changed (with the names of the
  fields given, never their values), paused, resumed, deleted.
- Every operation's schema lists its error answers (ApiSchema): 401 with
  `WWW-Authenticate`, 429 and 503 with `Retry-After`, 400/413/415 where a body is read,
  404 where an id or a page is read; each is `{"detail": "..."}` but the 400 of
  a bad field, which names the field(s).
- A job's runs are newest scheduled time first; `/api/runs/` is newest first by
  id (the order its index serves, so the dead list stays cheap).
- An `at` without an offset is resolved in the job's zone when it is given
  (on PATCH, the zone in the same body, else the stored one); changing only the
  zone later leaves that instant where it is.
"""
from __future__ import annotations

import json
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone
from drf_spectacular.openapi import AutoSchema
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import serializers, status, viewsets
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

from jobs import create_keys, selectors, services
from jobs.code import code_owned_refusal
from jobs.audit import audit_record, client_address
from jobs.ops import TriggerRefused, job_trigger
from jobs.models import AuditEntry, Job
from jobs.pagination import query_value
from jobs.public_ids import parse_id
from jobs.fields import json_type_name
from jobs.serializers import (
    AuditEntrySerializer,
    JobSerializer,
    RunDetailSerializer,
    RunSerializer,
)
from runs.models import Run
from runs.ops import RetryRefused, run_retry


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


ERROR = inline_serializer("Error", fields={"detail": serializers.CharField(help_text="What was wrong, in words.")})
FIELD_ERRORS = OpenApiResponse(
    response={
        "type": "object",
        "additionalProperties": {},
        "example": {"schedule": ["'0 25 * * *': the hour 25 is out of range (0-23)"]},
    },
    description="A bad field or body: each key names a field (or `detail`, `non_field_errors`), with words.",
)


class ApiSchema(AutoSchema):
    """Adds the error answers every operation can give to each one's responses, so
    the schema documents what a client (or schemathesis) will actually see. The
    project's DEFAULT_SCHEMA_CLASS: every API view gets it, a new one included.
    (`_get_response_bodies` is drf-spectacular's, pinned: it sees the responses
    after any @extend_schema override, which get_response_serializers does not.)"""

    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses = super()._get_response_bodies(direction)
        for code, response in self._error_responses().items():
            if str(code) not in responses:
                responses[str(code)] = self._get_response_for_code(response, str(code), direction=direction)
        return responses

    def _error_responses(self) -> dict[int, Any]:
        errors: dict[int, Any] = {
            401: OpenApiResponse(ERROR, description="No token, or a bad or revoked one."),
            429: OpenApiResponse(ERROR, description="Over the throttle; Retry-After says how many seconds to wait."),
            503: OpenApiResponse(ERROR, description="The job store cannot be reached (a restart, a failover); "
                                                    "nothing was done. Retry-After says when to try again."),
        }
        listing = self.method == "GET" and self._is_list_view()
        if self.method in ("POST", "PUT", "PATCH") or listing:
            errors[400] = FIELD_ERRORS  # a bad field, or a bad filter like ?status=
        if self.method in ("POST", "PUT", "PATCH"):
            errors[413] = OpenApiResponse(ERROR, description="The request body is over 1 MiB.")
            errors[415] = OpenApiResponse(ERROR, description="The body is not application/json.")
        if "{" in self.path or listing:
            errors[404] = OpenApiResponse(ERROR, description="No such object (or not the caller's), or no such page.")
        return errors

    def get_override_parameters(self) -> list[Any]:
        return [
            *super().get_override_parameters(),
            OpenApiParameter(
                "Retry-After", OpenApiTypes.INT, OpenApiParameter.HEADER, response=[429, 503],
                description="Seconds to wait before the next request.",
            ),
            OpenApiParameter(
                "WWW-Authenticate", OpenApiTypes.STR, OpenApiParameter.HEADER, response=[401],
                description="`Token`: send `Authorization: Token <token>`.",
            ),
        ]


STATUS_PARAMETER = OpenApiParameter(
    "status", OpenApiTypes.STR, OpenApiParameter.QUERY, enum=["", *selectors.RUN_STATUSES],
    description="Only runs with this status; `dead` is the dead list; empty means all.",
)
JOB_ID = OpenApiParameter("id", OpenApiTypes.STR, OpenApiParameter.PATH, description="A job id, like job_12.")
RUN_ID = OpenApiParameter("id", OpenApiTypes.STR, OpenApiParameter.PATH, description="A run id, like run_5.")
NOT_FOUND = OpenApiResponse(ERROR, description="No such job or run, or not the caller's.")
RUN_NOW_REFUSED = OpenApiResponse(
    ERROR,
    description="Refused, with the reason: the job is deleted or paused, its target host is paused, "
    "or it already has a manual run for this second.",
)
RETRY_REFUSED = OpenApiResponse(
    ERROR,
    description="Refused, with the reason: the run is not dead, or its job is deleted or paused, "
    "or its target host is paused.",
)


def status_filter(request: Request) -> str | None:
    """`?status=`: empty means no filter; an unknown value is a 400 naming `status`."""
    value = query_value(request, "status")
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


def audit(request: Request, action: str, obj: Any, detail: dict[str, Any] | None = None) -> None:
    audit_record(
        actor=request.user, via="api", action=action, obj=obj, detail=detail, remote_addr=client_address(request)
    )


def paginated(view: viewsets.GenericViewSet, runs: QuerySet[Run]) -> Response:
    page = view.paginate_queryset(runs)
    return view.get_paginated_response(RunSerializer(page, many=True).data)


@extend_schema_view(
    list=extend_schema(summary="The caller's jobs, newest first"),
    create=extend_schema(
        summary="Create a job and its first run",
        # The Idempotency-Key header is described here, not declared as a parameter: a
        # schema fuzzer sending one key with two auths took the replayed 201 for an
        # answer to the second (schemathesis's ignored_auth check).
        description="With an Idempotency-Key header (1 to 255 visible ASCII characters, e.g. a UUID), the same "
        "key from the same service within 24 h replays the first answer (header Idempotent-Replayed: true) and "
        "creates nothing; the key with another body is a 422; a malformed key is a 400 naming the header.",
        responses={201: JobSerializer, 422: OpenApiResponse(ERROR, description="The key was used for another body.")},
    ),
    retrieve=extend_schema(summary="One job", parameters=[JOB_ID], responses={200: JobSerializer, 404: NOT_FOUND}),
    partial_update=extend_schema(
        summary="Change a job; {\"paused\": true/false} pauses or resumes it",
        description='{"paused": true, "paused_until": T} pauses it until T, when it resumes by itself (within '
        "one scan); a paused_until on a job that is not paused, or not in the future, is a 400 naming it; "
        "resuming clears it.",
        parameters=[JOB_ID],
        responses={
            200: JobSerializer,
            404: NOT_FOUND,
            409: OpenApiResponse(
                ERROR, description="The job is deleted, or defined in code (only `paused` may change)."
            ),
        },
    ),
    destroy=extend_schema(
        summary="End a job: its waiting run is cancelled, its history stays readable",
        parameters=[JOB_ID],
        responses={
            204: None,
            404: NOT_FOUND,
            409: OpenApiResponse(ERROR, description="The job is defined in code: remove it there and sync_jobs --prune."),
        },
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
        body = require_object_body(request)
        key = create_keys.key_of(request)
        now = timezone.now()
        digest = create_keys.body_digest(body) if key is not None else ""
        if key is not None:
            replayed = create_keys.replay(request.user, key, digest, now)
            if replayed is not None:
                return replayed
        serializer = self.get_serializer(data=body)
        serializer.is_valid(raise_exception=True)
        try:
            with transaction.atomic():  # the job, its audit entry and its key, or none of them
                job = call_service(services.job_create, owner=request.user, fields=serializer.service_fields())
                audit(request, "created", job, {"fields": sorted(body)})
                answer = self.get_serializer(job).data
                if key is not None:
                    create_keys.keep(request.user, key, digest, job, answer, now)
        except IntegrityError:
            # The same key's create committed first, while this one ran: its answer.
            replayed = create_keys.replay(request.user, key, digest, now) if key is not None else None
            if replayed is None:
                raise
            return replayed
        return Response(answer, status=status.HTTP_201_CREATED)

    def retrieve(self, request: Request, id: str) -> Response:
        return Response(self.get_serializer(self.get_object()).data)

    def partial_update(self, request: Request, id: str) -> Response:
        job = self.get_object()
        if job.state == Job.State.DELETED:
            raise Conflict(f"{job.public_id} is deleted; a deleted job cannot be changed")
        body = require_object_body(request)
        refusal = code_owned_refusal(job, body)
        if refusal is not None:
            raise Conflict(refusal)
        serializer = self.get_serializer(job, data=body, partial=True)
        serializer.is_valid(raise_exception=True)
        was_paused = job.paused
        with transaction.atomic():
            job = call_service(services.job_update, job=job, fields=serializer.service_fields(),
                               by_owner=request.user.pk == job.owner_id)
            changed = sorted(key for key in body if key != "paused")
            if changed:
                audit(request, "changed", job, {"fields": changed})
            if job.paused != was_paused:
                audit(request, "paused" if job.paused else "resumed", job)
        return Response(self.get_serializer(job).data)

    def destroy(self, request: Request, id: str) -> Response:
        job = self.get_object()
        refusal = code_owned_refusal(job)
        if refusal is not None and job.state != Job.State.DELETED:
            raise Conflict(refusal)
        if job.state != Job.State.DELETED:
            with transaction.atomic():
                call_service(services.job_delete, job=job)
                audit(request, "deleted", job)
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

    @extend_schema(
        summary="Run the job now, once, besides its schedule (its next run stays as it is)",
        description="A manual run due now, with its own Idempotency-Key `<job id>@<now, whole seconds>`. "
        "At most one per second: a second call in the same second is a 409 naming the run that has it.",
        parameters=[JOB_ID],
        request=None,
        responses={201: RunSerializer, 404: NOT_FOUND, 409: RUN_NOW_REFUSED},
    )
    @action(detail=True, methods=["post"], url_path="run")
    def run_now(self, request: Request, id: str) -> Response:
        job = self.get_object()
        try:
            # job_trigger writes the audit entry (action "triggered") in its own transaction.
            run = job_trigger(job=job, actor=request.user, via="api", once_per_second=True)
        except TriggerRefused as exc:
            raise Conflict(str(exc)) from exc
        return Response(RunSerializer(run).data, status=status.HTTP_201_CREATED)


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

    @extend_schema(
        summary="Put a dead run back on the queue: same Idempotency-Key, X-Attempt going on",
        description="The run keeps its id, scheduled time and Idempotency-Key, and is due now; the job's retry "
        "policy applies afresh while X-Attempt goes on counting from the calls made so far.",
        parameters=[RUN_ID],
        request=None,
        responses={200: RunSerializer, 404: NOT_FOUND, 409: RETRY_REFUSED},
    )
    @action(detail=True, methods=["post"], url_path="retry")
    def retry(self, request: Request, id: str) -> Response:
        run_id = parse_id("run", id)
        run = self.get_queryset().filter(pk=run_id).first() if run_id is not None else None
        if run is None:
            raise NotFound(f"No run {id}.")
        try:
            run = run_retry(run=run, actor=request.user, via="api")  # audits "requeued"
        except RetryRefused as exc:
            raise Conflict(str(exc)) from exc
        return Response(RunSerializer(run).data)


OBJECT_PARAMETER = OpenApiParameter(
    "object", OpenApiTypes.STR, OpenApiParameter.QUERY,
    description="Only entries about this object: a job id (job_12), a run id (run_5), a service name or a host.",
)


@extend_schema_view(
    list=extend_schema(summary="The audit log: who changed what, when and from where, newest first",
                       parameters=[OBJECT_PARAMETER]),
)
class AuditViewSet(viewsets.GenericViewSet):
    """Read-only. A service sees entries about its own jobs, runs and account; staff see all."""

    serializer_class = AuditEntrySerializer

    def get_queryset(self) -> QuerySet[Any]:
        if getattr(self, "swagger_fake_view", False):  # schema generation has no caller
            return AuditEntry.objects.none()
        wanted = query_value(self.request, "object")
        if len(wanted) > 64 or "\x00" in wanted:
            raise ValidationError({"object": ["must be an object id like job_12, at most 64 characters"]})
        return selectors.audit_for(self.request.user, wanted or None)

    def list(self, request: Request) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        return self.get_paginated_response(self.get_serializer(page, many=True).data)
