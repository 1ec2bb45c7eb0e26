"""`python manage.py revoke_service_token NAME`: every API token of the service stops working."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from jobs.audit import audit_record
from jobs.management.commands._services import get_service
from jobs.tokens import tokens_revoke


class Command(BaseCommand):
    help = (
        "Revoke every API token of service NAME: its next call is a 401. Its jobs keep running; "
        "rotate_service_token NAME (or create_service_token NAME) gives it a new token."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the service account")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        service = get_service(name)
        with transaction.atomic():
            revoked = tokens_revoke(user=service.user)
            if revoked:
                audit_record(actor=None, via="command", action="token_revoked", obj=service, detail={"revoked": revoked})
        if not revoked:
            said = "had no API token; nothing to revoke"
        elif len(revoked) == 1:
            said = "revoked its API token"
        else:
            said = f"revoked {len(revoked)} API tokens"
        self.stdout.write(f"{name}: {said}")
