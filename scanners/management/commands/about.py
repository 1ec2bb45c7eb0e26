"""`python manage.py about`: the scheduler's version, and the coordinator, broker and
store this process's settings point at (passwords left out). Reads settings only:
it answers with the coordinator or broker down, which is when it is asked."""
from __future__ import annotations

from typing import Any

import django
from django.conf import settings
from django.core.management.base import BaseCommand
from django.db import connection
from kombu.utils.url import maybe_sanitize_url

from scheduler_project.version import VERSION


def store() -> str:
    db = settings.DATABASES["default"]
    if connection.vendor == "sqlite":
        return f"SQLite {db['NAME']}"
    where = f"{db.get('HOST') or 'localhost'}:{db.get('PORT') or 5432}"
    return f"{connection.vendor} {db.get('USER') or ''}@{where}/{db['NAME']}".replace(" @", " ")


def coordinator() -> str:
    if settings.ZOOKEEPER_HOSTS:
        return f"zookeeper {settings.ZOOKEEPER_HOSTS}"
    return "local (one machine: the embedded lock file)"


def about() -> dict[str, str]:
    return {
        "version": VERSION,
        "coordinator": coordinator(),
        "broker": maybe_sanitize_url(settings.CELERY_BROKER_URL),
        "run queue": settings.CELERY_TASK_DEFAULT_QUEUE,
        "task broker": maybe_sanitize_url(settings.SCHEDULER_TASK_BROKER_URL),
        "store": store(),
        "django": django.get_version(),
    }


class Command(BaseCommand):
    help = "The scheduler's version, and the coordinator, broker and store in use (without passwords)."

    def handle(self, *args: Any, **options: Any) -> None:
        facts = about()
        width = max(len(name) for name in facts)
        self.stdout.write(f"django-job-scheduler {VERSION}")
        for name, value in facts.items():
            if name != "version":
                self.stdout.write(f"  {name:<{width}}  {value}")
