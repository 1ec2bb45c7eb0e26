"""`python manage.py rotate_service_token NAME`: prints only the new API token."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction
from rest_framework.authtoken.models import Token

from jobs.audit import audit_record
from jobs.management.commands._services import get_service


class Command(BaseCommand):
    help = "Give service NAME a new API token and print only it; the old token stops working at once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        service = get_service(name)
        with transaction.atomic():
            Token.objects.filter(user=service.user).delete()
            token = Token.objects.create(user=service.user)
            audit_record(actor=None, via="command", action="token_rotated", obj=service)
        self.stdout.write(token.key)
