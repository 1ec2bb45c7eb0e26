"""A target team's own Celery app, for tests/integration/test_task_targets.py.

Not the scheduler's: its own Django settings (the `receiver` app and an SQLite
database of its own, for the idempotency rows and the task's effect), consuming the
tasks broker (its CELERY_BROKER_URL) on a queue of the test's own. Started as
`celery -A tests.celery_target_app worker -P solo -Q <queue>`.

Environment: CELERY_BROKER_URL (the tasks broker), TARGET_APP_DB (the SQLite file),
TARGET_APP_LOG (a file: one JSON line per delivery, with what `self.request` showed).
"""
from __future__ import annotations

import json
import os
from typing import Any

import django
from django.conf import settings

if not settings.configured:
    settings.configure(
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "receiver"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["TARGET_APP_DB"]}},
        USE_TZ=True,
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)

from celery import Celery  # noqa: E402
from celery.signals import task_prerun  # noqa: E402
from django.contrib.auth.models import Group  # noqa: E402

from receiver.tasks import idempotent_task  # noqa: E402

app = Celery("target-team")
app.conf.update(task_serializer="json", accept_content=["json"], worker_hijack_root_logger=False)
RUN_HEADERS = ("idempotency_key", "fence_token", "run_id", "attempt", "scheduled_for")


def _log(**entry: Any) -> None:
    with open(os.environ["TARGET_APP_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\n")


@task_prerun.connect
def _delivered(task: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    # Every delivery, applied or not: what the task's request shows, both ways of asking.
    request = task.request
    _log(
        kind="delivered",
        task=task.name,
        args=list(args or []),
        kwargs=dict(kwargs or {}),
        attributes={name: getattr(request, name, None) for name in RUN_HEADERS},
        got={name: request.get(name) for name in RUN_HEADERS},
    )


@app.task(bind=True, name="integration.tasks.record")
@idempotent_task
def record(self: Any, label: str, n: int = 0) -> str:
    """The effect: one row in the target's own database per applied run."""
    Group.objects.create(name=f"{label}|{self.request.idempotency_key}|{self.request.fence_token}")
    _log(kind="applied", label=label, n=n, key=self.request.idempotency_key, fence=self.request.fence_token)
    return label
