"""`python manage.py create_service_token NAME`: prints only the API token."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from jobs.audit import audit_record
from jobs.models import ServiceAccount
from jobs.services import service_account_ensure


class Command(BaseCommand):
    help = "Create (or find) the service account NAME and print only its API token."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--email", default="", help="where dead-run notices go by default")

    def handle(self, *args: Any, name: str, email: str, **options: Any) -> None:
        name = name.strip()
        if not name or len(name) > 150 or any(c.isspace() for c in name):
            raise CommandError("NAME must be 1 to 150 characters with no spaces")
        existed = ServiceAccount.objects.filter(user__username=name).exists()
        try:
            with transaction.atomic():
                user, token = service_account_ensure(name=name, email=email)
                # Showing an existing token is a read of a credential: audited too.
                audit_record(actor=None, via="command", action="token_shown" if existed else "created", obj=user)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(token)
