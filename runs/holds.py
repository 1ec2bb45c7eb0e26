"""Target holds: `pause_target HOST` holds every run whose target is on HOST."""
from __future__ import annotations


def target_is_paused(target_url: str) -> bool:
    from jobs.validators import target_host
    from runs.models import PausedTarget

    return PausedTarget.objects.filter(host=target_host(target_url)).exists()
