from __future__ import annotations

from django.contrib import admin

from runs.models import PausedTarget, Run, RunEvent


class RunEventInline(admin.TabularInline):
    model = RunEvent
    extra = 0
    can_delete = False
    fields = ("at", "type", "detail")
    readonly_fields = fields
    ordering = ("at", "id")

    def has_add_permission(self, request: object, obj: object = None) -> bool:
        return False


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("public_id", "job", "scheduled_for", "due_at", "status", "attempt", "fence", "finished_at")
    list_filter = ("status", "is_backfill", "held")
    search_fields = ("=id", "job__name", "job__target")
    list_select_related = ("job",)
    raw_id_fields = ("job",)
    readonly_fields = (
        "job", "scheduled_for", "due_at", "partition", "status", "held", "attempt", "fence", "lease_owner",
        "lease_expires_at", "queued_at", "started_at", "finished_at", "last_error", "is_backfill", "created_at",
    )
    inlines = [RunEventInline]
    date_hierarchy = "scheduled_for"
    show_full_result_count = False

    def has_add_permission(self, request: object) -> bool:
        return False


@admin.register(PausedTarget)
class PausedTargetAdmin(admin.ModelAdmin):
    list_display = ("host", "paused_at", "paused_by")
