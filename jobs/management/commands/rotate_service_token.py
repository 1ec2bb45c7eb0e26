"""`python manage.py rotate_service_token NAME`: prints only the new API token."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from jobs.audit import audit_record
from jobs.management.commands._services import get_service
from jobs.tokens import PREFIX_LENGTH, token_issue, tokens_revoke


class Command(BaseCommand):
    help = "Give service NAME a new API token and print only it; every other token of NAME stops working at once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the service account")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        service = get_service(name)
        with transaction.atomic():
            token = token_issue(user=service.user)
            revoked = tokens_revoke(user=service.user, keep=token)
            audit_record(
                actor=None, via="command", action="token_rotated", obj=service,
                detail={"prefix": token[:PREFIX_LENGTH], "revoked": revoked},
            )
        self.stdout.write(token)
