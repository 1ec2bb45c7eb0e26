"""Reads. The one place that scopes querysets to the caller.

Every API read goes through `jobs_for` / `runs_for` / `audit_for`, so "a service sees only its
own" is decided here and nowhere else: another service's object is simply not in
the queryset, which the views turn into a 404 (never a 403, which would confirm
that the id exists).
"""
from __future__ import annotations

from typing import Any

from django.db.models import Prefetch, QuerySet

from jobs.models import AuditEntry, Job
from runs.models import JOBS_OPEN_RUN, Run, with_status

# The statuses `?status=` accepts, in the order the docs list them.
RUN_STATUSES: tuple[str, ...] = tuple(Run.Status.values)


def _sees_all(user: Any) -> bool:
    return bool(getattr(user, "is_staff", False))


def _open_runs() -> Prefetch:
    # One extra query for a whole page of jobs, instead of one per job for `next_run`.
    query = Run.objects.filter(JOBS_OPEN_RUN).order_by("scheduled_for")
    return Prefetch("runs", queryset=query, to_attr="open_runs")


def jobs_for(user: Any) -> QuerySet[Job]:
    """The jobs `user` may see, newest first, with their open run prefetched."""
    jobs = Job.objects.all() if _sees_all(user) else Job.objects.filter(owner=user)
    return jobs.prefetch_related(_open_runs()).order_by("-id")


def job_get(user: Any, job_id: int) -> Job | None:
    return jobs_for(user).filter(pk=job_id).first()


def runs_for(user: Any) -> QuerySet[Run]:
    """The runs `user` may see (those of its jobs), newest first (by id, which
    `runs_status_idx` serves for the dead list)."""
    runs = Run.objects.all() if _sees_all(user) else Run.objects.filter(job__owner=user)
    return runs.order_by("-id")


def job_runs(job: Job) -> QuerySet[Run]:
    """One job's runs, newest scheduled time first (a backfill sorts by its time,
    not by when it was made)."""
    return Run.objects.filter(job=job).order_by("-scheduled_for", "-id")


def run_get(user: Any, run_id: int) -> Run | None:
    """One run with its whole timeline, oldest first, as `run.timeline`: its event
    rows and the entries on its row (Run.timeline, read when serialized)."""
    return runs_for(user).filter(pk=run_id).first()


def runs_with_status(runs: QuerySet[Run], status: str | None) -> QuerySet[Run]:
    """`?status=` filter; the caller has already checked `status` is one of RUN_STATUSES."""
    return runs.filter(with_status(status)) if status else runs


def open_run_of(job: Job) -> Run | None:
    """The job's open non-backfill run, from the prefetch when there is one."""
    prefetched = getattr(job, "open_runs", None)
    if prefetched is not None:
        return prefetched[0] if prefetched else None
    return Run.objects.filter(JOBS_OPEN_RUN, job=job).first()


def audit_for(user: Any, object_id: str | None = None) -> QuerySet[AuditEntry]:
    """Audit entries `user` may see, newest first: a service, those about its own
    jobs, runs and account; staff, all. `object_id` (job_12, run_5...) narrows it."""
    entries = AuditEntry.objects.all() if _sees_all(user) else AuditEntry.objects.filter(owner=user)
    if object_id:
        entries = entries.filter(object_id=object_id)
    return entries.order_by("-at", "-id")


def task_prefixes_of(owner_id: int) -> list[str]:
    """The Celery task prefixes granted to the service that is user `owner_id` (grant_tasks)."""
    from jobs.models import ServiceAccount

    found = ServiceAccount.objects.filter(user_id=owner_id).values_list("task_prefixes", flat=True).first()
    return [p for p in (found or []) if isinstance(p, str)]


def task_refusal(owner: Any, task: str) -> str | None:
    """Why `owner` may not name the Celery task `task`, or None when it may.

    A service names only tasks under its granted prefixes (jobs.validators.
    task_name_granted). A job owned by a person (staff, through the API: the caller
    owns what it creates) may name any task: staff are the operators who grant."""
    from jobs.validators import RESERVED_TASK_ROOTS, task_name_granted

    if owner is None:
        return "the job has no owner to check the task against"
    if task_name_granted(task, list(RESERVED_TASK_ROOTS)) and is_service_account(owner):
        # Whatever a grant stored before such grants were refused says.
        return f"{task!r} is Celery's own task or the scheduler's: never granted to a service"
    if getattr(owner, "is_staff", False) and not is_service_account(owner):
        return None
    prefixes = task_prefixes_of(owner.pk)
    if task_name_granted(task, prefixes):
        return None
    name = owner.get_username()
    if not prefixes:
        return f"{task!r} is not granted to {name}, which may name no Celery task (see grant_tasks)"
    granted = ", ".join(prefixes)
    return f"{task!r} is not under a task prefix granted to {name} ({granted}; see grant_tasks)"


def is_service_account(user: Any) -> bool:
    from jobs.models import ServiceAccount

    return ServiceAccount.objects.filter(user_id=user.pk).exists()
