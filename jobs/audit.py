"""The audit log: who created, changed, paused, resumed, triggered, requeued or
deleted which job or run, when, and from where; from the API, the admin or a command.

One function writes it, `audit_record`; call it in the same transaction as the
change it describes, so a rolled-back change leaves no entry and a committed one
always has its entry.

    from jobs.audit import audit_record

    audit_record(actor=request.user, via="admin", action="paused", obj=job)
    audit_record(actor=None, via="command", action="requeued", obj=run, detail={"fence": 3})
    audit_record(actor=None, via="command", action="paused", obj="reports.internal:443")

`detail` is shown to the owning service (GET /api/audit/): names of fields and
small facts only, never a header value, a payload, a token or a secret.
"""
from __future__ import annotations

import contextvars
import getpass
import socket
from datetime import datetime
from typing import Any, Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from jobs.models import AuditEntry, Job, ServiceAccount

VIA = frozenset(AuditEntry.Via.values)
# The address of the request being served, for writes that have no request at hand
# (admin actions, model admin saves): set by AuditContextMiddleware.
_request_addr: contextvars.ContextVar[str] = contextvars.ContextVar("audit_request_addr", default="")


def audit_record(
    *,
    actor: Any,
    via: str,
    action: str,
    obj: Any,
    detail: dict[str, Any] | None = None,
    remote_addr: str = "",
    at: datetime | None = None,
) -> AuditEntry:
    """Write one audit entry and return it.

    - actor: the User who acted (its username is kept), a plain name, or None for
      "whoever runs this process" (a management command: the OS user).
    - via: "api", "admin" or "command".
    - action: a past-tense verb: created, changed, paused, resumed, triggered,
      requeued, deleted, backfilled, token_rotated, token_revoked, ...
    - obj: a Job, a Run, a ServiceAccount or a service's User, a str naming a
      target host (for pause_target / resume_target), or an (object_type,
      object_id) pair for anything else (seen by staff only). Job and run entries are
      scoped to the job's owner, so that service sees them in GET /api/audit/.
    - remote_addr: where from. Empty means: the request being served (the
      middleware knows it), else for a command this machine's host name.
    """
    entry = audit_entry(
        actor=actor, via=via, action=action, obj=obj, detail=detail, remote_addr=remote_addr, at=at
    )
    entry.save()
    return entry


def audit_entry(
    *,
    actor: Any,
    via: str,
    action: str,
    obj: Any,
    detail: dict[str, Any] | None = None,
    remote_addr: str = "",
    at: datetime | None = None,
) -> AuditEntry:
    """audit_record's entry, unsaved: for a batch written with one bulk_create
    (sync_jobs' thousand jobs), in the same transaction as the change."""
    if via not in VIA:
        raise ValueError(f"via must be one of {', '.join(sorted(VIA))}, not {via!r}")
    object_type, object_id, owner_id = describe_object(obj)
    return AuditEntry(
        at=at or timezone.now(),
        actor=actor_name(actor)[:150],
        via=via,
        action=action[:40],
        object_type=object_type,
        object_id=object_id[:64],
        owner_id=owner_id,
        remote_addr=(remote_addr or _request_addr.get() or _command_origin(via))[:64],
        detail=detail or {},
    )


def actor_name(actor: Any) -> str:
    if actor is None:
        return command_actor()
    if isinstance(actor, str):
        return actor
    return str(getattr(actor, "get_username", lambda: actor)())


def command_actor() -> str:
    """The OS user running this process: who ran a management command."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers) and no USER variable
        return "unknown"


def _command_origin(via: str) -> str:
    return socket.gethostname() if via == AuditEntry.Via.COMMAND else ""


def describe_object(obj: Any) -> tuple[str, str, int | None]:
    """(object_type, object_id, owner user id) for an entry about `obj`."""
    from runs.models import Run  # runs imports jobs: import here, not at module level

    if isinstance(obj, Job):
        return "job", obj.public_id, obj.owner_id
    if isinstance(obj, Run):
        owner_id = Job.objects.filter(pk=obj.job_id).values_list("owner_id", flat=True).first()
        return "run", obj.public_id, owner_id
    if isinstance(obj, ServiceAccount):
        return "service", obj.user.get_username(), obj.user_id
    if isinstance(obj, str):
        return "target", obj, None
    if isinstance(obj, tuple):  # (object_type, object_id): something gone, or with no owner
        return str(obj[0])[:16], str(obj[1]), None
    if hasattr(obj, "get_username"):  # a service's user
        return "service", obj.get_username(), obj.pk
    raise TypeError(f"cannot audit a {type(obj).__name__}: pass a Job, Run, ServiceAccount, User or host")


def client_address(request: HttpRequest) -> str:
    """The caller's address. Behind a TLS proxy REMOTE_ADDR is the proxy's, so the
    last X-Forwarded-For entry (the one the proxy itself appended) is taken; the
    earlier ones are whatever the client claimed."""
    if getattr(settings, "SCHEDULER_BEHIND_TLS_PROXY", False):
        forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
        last = forwarded.split(",")[-1].strip()
        if last:
            return last
    return str(request.META.get("REMOTE_ADDR", ""))


class AuditContextMiddleware:
    """Remembers the request's address for audit entries written while serving it."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        token = _request_addr.set(client_address(request))
        try:
            return self.get_response(request)
        finally:
            _request_addr.reset(token)
