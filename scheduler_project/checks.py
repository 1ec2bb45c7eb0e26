"""The project's system checks (`manage.py check`; run before every command).

Registered from JobsConfig.ready().
"""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import Error, Tags, register


@register(Tags.compatibility)
def time_zone_is_utc(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    # Stored times, the run queue and every comparison with "now" assume UTC; a job's
    # own zone lives on the job. Another TIME_ZONE would shift what admin forms mean.
    if settings.TIME_ZONE == "UTC" and settings.USE_TZ:
        return []
    return [
        Error(
            f'TIME_ZONE must be "UTC" with USE_TZ = True, not {settings.TIME_ZONE!r} (USE_TZ = {settings.USE_TZ})',
            hint="Give each job its own `timezone`; the project itself keeps time in UTC.",
            id="scheduler.E001",
        )
    ]


@register()
def durations_parse(app_configs: Any = None, **kwargs: Any) -> list[Error]:
    # Read at call time by the API and the worker: a typo must stop the start, not a call.
    from jobs.schedule import parse_duration

    errors = []
    for name in ("SCHEDULER_SIGNING_OVERLAP", "SCHEDULER_MIN_INTERVAL"):
        try:
            parse_duration(getattr(settings, name))
        except ValueError as exc:
            errors.append(Error(f"{name}: {exc}", id="scheduler.E002"))
    from runs import partitions, retention

    for name, check in (("SCHEDULER_RUN_PARTITION_WIDTH", partitions.width),
                        ("SCHEDULER_RUN_RETENTION", retention.retention)):
        try:
            check()
        except ValueError as exc:
            errors.append(Error(f"{name}: {exc}", id="scheduler.E002"))
    if settings.SCHEDULER_RUN_PARTITIONS_AHEAD < 1:
        errors.append(Error(f"SCHEDULER_RUN_PARTITIONS_AHEAD must be 1 or more, not "
                            f"{settings.SCHEDULER_RUN_PARTITIONS_AHEAD}", id="scheduler.E002"))
    return errors
