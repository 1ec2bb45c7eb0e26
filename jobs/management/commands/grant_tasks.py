"""`python manage.py grant_tasks NAME PREFIX... [--revoke]`: which Celery tasks a service may name."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from jobs.audit import audit_record
from jobs.models import ServiceAccount
from jobs.services import service_tasks_grant


class Command(BaseCommand):
    help = (
        "Let service NAME name Celery tasks under PREFIX... as a job's `task` (adds to its grants; "
        "--revoke removes them instead). `billing.` grants billing.tasks.sync but not billingx.run; "
        "`billing` grants billing itself and billing.*. Prints the service's grants afterwards."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("prefixes", nargs="+", metavar="PREFIX")
        parser.add_argument("--revoke", action="store_true", help="remove these prefixes instead of adding them")

    def handle(self, *args: Any, name: str, prefixes: list[str], revoke: bool, **options: Any) -> None:
        try:
            with transaction.atomic():
                changed, now = service_tasks_grant(name=name, prefixes=prefixes, revoke=revoke)
                if changed:
                    user = ServiceAccount.objects.get(user__username=name).user
                    audit_record(
                        actor=None, via="command", action="tasks_revoked" if revoke else "tasks_granted",
                        obj=user, detail={"prefixes": changed},
                    )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        verb = "revoked" if revoke else "granted"
        unchanged = [p for p in dict.fromkeys(prefixes) if p not in changed]
        if changed:
            self.stdout.write(f"{name}: {verb} {', '.join(changed)}")
        if unchanged:
            state = "not granted" if revoke else "already granted"
            self.stdout.write(f"{name}: {', '.join(unchanged)} {state}, left as is")
        self.stdout.write(f"{name} may name tasks under: {', '.join(now) if now else '(none)'}")
