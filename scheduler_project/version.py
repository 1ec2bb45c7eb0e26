"""The scheduler's version: `python manage.py about` prints it, `GET /api/` and the
admin's footer show it. One place; a release changes it here (and in CHANGELOG.md)."""
from __future__ import annotations

from typing import Any

VERSION = "0.9.0"


def version_context(request: Any) -> dict[str, str]:
    """A template context processor: `scheduler_version` on every admin page."""
    return {"scheduler_version": VERSION}
