"""`python manage.py rotate_signing_secret NAME`: prints only the new signing secret."""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from django.db import transaction

from jobs.audit import audit_record
from jobs.management.commands._services import get_service
from runs.signing import signing_secret_rotate


class Command(BaseCommand):
    help = (
        "Make a new X-Signature secret for service NAME and print only it. The old one keeps "
        "signing (as a second v1=) for SCHEDULER_SIGNING_OVERLAP."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the service account")

    def handle(self, *args: Any, name: str, **options: Any) -> None:
        service = get_service(name)
        with transaction.atomic():
            secret = signing_secret_rotate(service=service)
            overlap = settings.SCHEDULER_SIGNING_OVERLAP
            audit_record(actor=None, via="command", action="signing_secret_rotated", obj=service,
                         detail={"overlap": overlap})
        self.stdout.write(secret)
