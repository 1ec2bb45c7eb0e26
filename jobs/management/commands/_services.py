"""Finding a service account by NAME for the token and signing-secret commands."""
from __future__ import annotations

from django.core.management.base import CommandError

from jobs.models import ServiceAccount


def get_service(name: str) -> ServiceAccount:
    """The service account NAME, or a one-line CommandError."""
    service = ServiceAccount.objects.select_related("user").filter(user__username=name).first()
    if service is None:
        raise CommandError(f"no service account {name!r} (create it with create_service_token {name})")
    return service
