"""Settings of the soak's target: this project's own settings, pointed (by DATABASE_URL)
at the target's own database, serving only bench/soak_target.py's URLs."""
from __future__ import annotations

from scheduler_project.settings import *  # noqa: F401,F403

ROOT_URLCONF = "bench.soak_target"
