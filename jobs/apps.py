from __future__ import annotations

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # The project's own system checks (UTC, ...) and the read-only audit log admin;
        # jobs/admin.py is the job admin's, so the audit admin lives in its own module.
        from jobs import admin_audit, checks as stored_checks  # noqa: F401
        from scheduler_project import checks, loaders  # noqa: F401

        loaders.connect()  # psycopg's C loaders for times and JSON on every new store connection
