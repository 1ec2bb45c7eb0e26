"""`python manage.py create_service_token NAME`: prints only a new API token."""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from jobs.audit import audit_record
from jobs.models import ServiceAccount
from jobs.services import service_account_ensure
from jobs.tokens import PREFIX_LENGTH
from jobs.validators import validate_notify


class Command(BaseCommand):
    help = (
        "Create the service account NAME if needed and print only a new API token for it. "
        "Tokens are stored hashed: this is the only time the token is shown. The service's "
        "other tokens keep working (rotate_service_token revokes them)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name", metavar="NAME", help="the service account (made if it does not exist)")
        parser.add_argument("--email", default="", help="the account's e-mail: where notices go if nothing else is set")
        parser.add_argument(
            "--notify", default=None,
            help="the service's default notify for its jobs: an e-mail address or an https URL (a signed webhook)",
        )

    def handle(self, *args: Any, name: str, email: str, notify: str | None, **options: Any) -> None:
        name = name.strip()
        if not name or len(name) > 150 or any(c.isspace() for c in name):
            raise CommandError("NAME must be 1 to 150 characters with no spaces")
        if notify:
            try:
                notify = validate_notify(notify)
            except ValueError as exc:
                raise CommandError(f"--notify {exc}") from exc
        existed = ServiceAccount.objects.filter(user__username=name).exists()
        try:
            with transaction.atomic():
                user, token = service_account_ensure(name=name, email=email)
                if notify is not None:
                    ServiceAccount.objects.filter(user=user).update(notify=notify)
                if not existed:
                    audit_record(actor=None, via="command", action="created", obj=user)
                audit_record(
                    actor=None, via="command", action="token_created", obj=user,
                    detail={"prefix": token[:PREFIX_LENGTH]},
                )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(token)
