"""Target holds: `pause_target HOST` holds every run whose target is on HOST (or, for
a Celery task target, whose key is `celery:<queue>`: jobs.validators.target_key)."""
from __future__ import annotations

from typing import Any


def target_is_paused(job: Any) -> bool:
    from jobs.validators import target_key
    from runs.models import PausedTarget

    return PausedTarget.objects.filter(host=target_key(job)).exists()
