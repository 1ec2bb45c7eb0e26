from __future__ import annotations

from django.apps import AppConfig
from django.db.models.signals import post_migrate


class RunsConfig(AppConfig):
    name = "runs"
    verbose_name = "Runs"

    def ready(self) -> None:
        from runs.ops import ensure_ops_groups

        # After this app's migrations (and so after jobs', which come first): every
        # permission the ops groups name exists by then. No data migration: the
        # groups follow the permission list in runs.ops, however it changes.
        post_migrate.connect(ensure_ops_groups, sender=self, dispatch_uid="runs.ensure_ops_groups")
