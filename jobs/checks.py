"""What an upgrade finds in the stored jobs and grants that today's rules refuse.

A database check (`python manage.py check --database default`, and `migrate`,
which runs the database checks before it migrates): rows written before a rule
existed are not changed behind their owners' backs, they are reported, with what
to do. The worker refuses them at call time in any case (runs.publishing: a task
no longer granted or a refused queue ends its run dead, publishing nothing).

- jobs.W001: task jobs whose `queue` names the scheduler's run queue, `celery`
  explicitly or a broker transport's own key (jobs.validators.queue_refusal).
- jobs.W002: grants covering Celery's own tasks or the scheduler's
  (jobs.validators.validate_task_prefix).
- jobs.W003: job names holding control characters (a terminal's escape
  sequences among them), which the API refuses now.

Read-only and bounded: one read of the distinct queues, one of the grants, one
scan of the names (an index-less scan: about a second at 10^6 jobs).
"""
from __future__ import annotations

from typing import Any

from django.core.checks import Tags, Warning, register
from django.db import DatabaseError

SHOWN = 5  # job ids listed per warning; the count says how many in all


@register(Tags.database)
def stored_rows_todays_rules_refuse(app_configs: Any = None, databases: Any = None, **kwargs: Any) -> list[Warning]:
    if not databases or "default" not in databases:
        return []
    try:
        return [*_queues(), *_grants(), *_names()]
    except DatabaseError:  # not migrated yet (a new store): nothing stored to check
        return []


def _shown(ids: list[int], total: int) -> str:
    listed = ", ".join(f"job_{pk}" for pk in ids[:SHOWN])
    return listed + (f" and {total - SHOWN} more" if total > SHOWN else "")


def _queues() -> list[Warning]:
    from jobs.models import Job
    from jobs.validators import stored_queue_refusal

    live = Job.objects.exclude(task="").exclude(state=Job.State.DELETED)
    found = []
    for queue in live.values_list("queue", flat=True).distinct().order_by("queue"):
        refusal = stored_queue_refusal(queue)
        if refusal is None:
            continue
        rows = live.filter(queue=queue)
        total = rows.count()
        ids = list(rows.order_by("pk").values_list("pk", flat=True)[:SHOWN])
        found.append(Warning(
            f"{total} task job(s) publish to the queue {queue!r}: {refusal} ({_shown(ids, total)})",
            hint="Their runs end dead, publishing nothing, until the owner PATCHes `queue` "
                 "(or leaves it out for Celery's default).",
            id="jobs.W001",
        ))
    return found


def _grants() -> list[Warning]:
    from jobs.models import ServiceAccount
    from jobs.validators import validate_task_prefix

    found = []
    for account in ServiceAccount.objects.select_related("user").order_by("pk"):
        for prefix in account.task_prefixes or []:
            try:
                validate_task_prefix(prefix)
            except (ValueError, TypeError) as exc:
                name = account.user.username
                found.append(Warning(
                    f"service {name!r} holds the grant {prefix!r}: {exc}",
                    hint=f"python manage.py grant_tasks {name} --revoke {prefix} (its jobs naming such "
                         "tasks end their runs dead, publishing nothing, meanwhile)",
                    id="jobs.W002",
                ))
    return found


def _names() -> list[Warning]:
    from jobs.models import Job
    from jobs.validators import CONTROL_CHARACTERS_REGEX

    rows = Job.objects.exclude(state=Job.State.DELETED).filter(name__regex=CONTROL_CHARACTERS_REGEX)
    total = rows.count()
    if not total:
        return []
    ids = list(rows.order_by("pk").values_list("pk", flat=True)[:SHOWN])
    return [Warning(
        f"{total} job name(s) hold control characters, which the API refuses now ({_shown(ids, total)})",
        hint="The admin and the commands print them escaped; rename them (PATCH `name`).",
        id="jobs.W003",
    )]
