"""Small parsers shared by the management commands: they raise CommandError with one line."""
from __future__ import annotations

from datetime import datetime, timezone as dt_timezone

from django.core.management.base import CommandError

from jobs.models import Job
from jobs.public_ids import parse_id


def parse_utc(option: str, value: str) -> datetime:
    """ISO 8601 UTC, as the commands' docs say: `2026-10-01T00:00:00Z` (or `+00:00`, or no
    offset, which means UTC). Another offset is refused, naming the UTC time it stands for:
    an operator who typed local time should see it rather than get a range hours off."""
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as exc:
        raise CommandError(f"{option} {value!r} is not an ISO 8601 time like 2026-10-01T00:00:00Z") from exc
    if parsed.tzinfo is None:
        return parsed.replace(tzinfo=dt_timezone.utc)
    offset = parsed.utcoffset()
    if offset:
        utc = parsed.astimezone(dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        raise CommandError(f"{option} {value!r} is not in UTC; give it as {utc} (times here are UTC)")
    return parsed.astimezone(dt_timezone.utc)


def get_job(value: str) -> Job:
    pk = parse_id("job", value)
    job = Job.objects.filter(pk=pk).first() if pk is not None else None
    if job is None:
        raise CommandError(f"no job {value!r}")
    return job
