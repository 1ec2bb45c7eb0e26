"""The audit log in the admin: read-only. Imported from JobsConfig.ready().

Also bridges the admin's own change history: every add, change or delete of a
job, run or other jobs/runs row through the admin's forms writes a LogEntry;
each one of those becomes an audit entry (via "admin"), so edits made in the
admin are audited whatever the job admin's code does. Admin *actions* (pause,
run now, requeue...) call `jobs.audit.audit_record` themselves.
"""
from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
from django.db.models.signals import post_save
from django.http import HttpRequest

from jobs.audit import audit_record
from jobs.models import AuditEntry
from jobs.public_ids import format_id

AUDITED_APPS = ("jobs", "runs")
ACTIONS = {ADDITION: "created", CHANGE: "changed", DELETION: "deleted"}


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ("at", "actor", "via", "action", "object_type", "object_id", "owner", "remote_addr")
    list_filter = ("via", "action", "object_type")
    search_fields = ("actor", "object_id", "=remote_addr")
    list_select_related = ("owner",)
    date_hierarchy = "at"
    show_full_result_count = False
    readonly_fields = ("at", "actor", "via", "action", "object_type", "object_id", "owner", "remote_addr", "detail")

    # A log that can be edited proves nothing: no add, change or delete, even for superusers.
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _object_of(entry: LogEntry) -> Any:
    """What the LogEntry is about, as audit_record takes it: the job or run itself
    while it exists (so the entry is scoped to its owner), else (type, id)."""
    # A deletion is logged before the row goes, so the row is found then too.
    name = entry.content_type.model
    if name in ("job", "run"):
        model = entry.content_type.model_class()
        row = model._default_manager.filter(pk=entry.object_id).first() if model and entry.object_id else None
        if row is not None:
            return row
    shown = entry.object_id or entry.object_repr
    if name in ("job", "run") and shown.isascii() and shown.isdigit():
        shown = format_id(name, int(shown))
    return (name, shown)


def audit_admin_log_entry(sender: type, instance: LogEntry, created: bool, **kwargs: Any) -> None:
    content_type = instance.content_type
    if not created or content_type is None or content_type.app_label not in AUDITED_APPS:
        return
    if content_type.model == "auditentry":
        return
    detail = {"message": instance.get_change_message()} if instance.change_message else {}
    action = ACTIONS.get(instance.action_flag, "changed")
    audit_record(actor=instance.user, via="admin", action=action, obj=_object_of(instance), detail=detail)


post_save.connect(audit_admin_log_entry, sender=LogEntry, dispatch_uid="jobs.audit_admin_log_entry")
