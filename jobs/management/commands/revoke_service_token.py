"""`python manage.py revoke_service_token NAME`: the service's API token stops working."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction
from rest_framework.authtoken.models import Token

from jobs.audit import audit_record
from jobs.management.commands._services import get_service


class Command(BaseCommand):
    help = (
        "Revoke service NAME's API token: its next call is a 401. Its jobs keep running; "
        "rotate_service_token NAME gives it a new token."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        service = get_service(name)
        with transaction.atomic():
            deleted, _ = Token.objects.filter(user=service.user).delete()
            if deleted:
                audit_record(actor=None, via="command", action="token_revoked", obj=service)
        said = "revoked its API token" if deleted else "had no API token; nothing to revoke"
        self.stdout.write(f"{name}: {said}")
