from __future__ import annotations

from django.contrib import admin

from jobs.models import Job, ServiceAccount


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ("public_id", "name", "owner", "schedule", "timezone", "state", "target")
    list_filter = ("state", "paused", "misfire", "owner")
    search_fields = ("=id", "name", "target")
    list_select_related = ("owner",)
    readonly_fields = ("created_at", "updated_at", "deleted_at", "secret_headers")
    fieldsets = (
        (None, {"fields": ("owner", "name", "state", "paused")}),
        ("Schedule", {"fields": ("schedule", "run_at", "timezone", "window_seconds", "misfire")}),
        ("Target", {"fields": ("target", "method", "headers", "secret_header_names", "secret_headers", "payload")}),
        ("Execution", {"fields": ("retry_max", "retry_backoff", "retry_base_seconds", "retry_cap_seconds", "timeout_seconds", "notify")}),
        ("History", {"fields": ("created_at", "updated_at", "deleted_at")}),
    )


@admin.register(ServiceAccount)
class ServiceAccountAdmin(admin.ModelAdmin):
    list_display = ("user", "created_at")
