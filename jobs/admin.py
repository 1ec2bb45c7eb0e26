"""Jobs in the admin: an ops console over `jobs.services`, checked like the API.

The edit form speaks the API's words (schedule, at, window "5m", retry base...)
and validates through `jobs.serializers.JobSerializer`, so a bad cron expression
or zone is a form error saying what the API would say, never a 500; writes go
through job_create / job_update. Actions call one service each and report with
message_user. Deleting is the service's soft delete (history stays), never a
row delete.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

from django.contrib import admin, messages
from django.db import transaction
from django.db.models import OuterRef, QuerySet, Subquery
from django.contrib.admin.utils import unquote
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from jobs import schedule, selectors, services
from jobs.audit import audit_record
from jobs.code import code_owned_refusal
from jobs.models import Job, ServiceAccount, ServiceToken
from jobs.ops import TriggerRefused, job_trigger
from jobs.public_ids import format_id, parse_id
from jobs.admin_forms import JobAdminForm, ServiceAccountForm
from jobs.validators import target_host, target_key
from runs.delivery import iso_z
from runs.models import OPEN_KEPT_FOR, Run, ended_newest_first

PREVIEW_COUNT = 5
def local_time(when: datetime, zone: str) -> str:
    try:
        tz = ZoneInfo(zone)
    except Exception:  # a stored zone the system no longer knows: show UTC only
        return iso_z(when)
    return when.astimezone(tz).strftime("%Y-%m-%d %H:%M %Z")


def schedule_words(job: Job) -> str:
    if job.is_recurring:
        try:
            return schedule.describe_timetable(job.timetable())
        except ValueError:
            return job.schedule or ", ".join(job.schedule_list) or "-"
    if job.run_at is not None:
        zone = "" if job.timezone == "UTC" else f" ({job.timezone})"
        return f"once at {local_time(job.run_at, job.timezone)}{zone}"
    return "-"


def next_times(job: Job, now: datetime, count: int = PREVIEW_COUNT) -> list[datetime]:
    if not job.is_recurring:
        return [job.run_at] if job.run_at is not None else []
    times: list[datetime] = []
    after: datetime | None = now
    try:
        timetable = job.timetable()
        for _ in range(count):
            after = schedule.next_time(timetable, after, keep=0).time
            if after is None:
                break  # past ends_at
            times.append(after)
    except ValueError:
        pass  # a stored expression that no longer parses: show what we have
    return times


# --------------------------------------------------------------------------- filters


class TargetHostFilter(admin.SimpleListFilter):
    title = "target host"
    parameter_name = "host"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        hosts = {target_key(job) for job in Job.objects.only("target", "task", "queue")}
        return [(h, h) for h in sorted(hosts)]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        from runs.ops import target_host_q

        return queryset.filter(target_host_q(self.value())) if self.value() else queryset


class CodeOwnedFilter(admin.SimpleListFilter):
    title = "defined in code"
    parameter_name = "code"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes (sync_jobs)"), ("no", "No (API or admin)")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        if self.value() == "yes":
            return queryset.exclude(code_source="")
        if self.value() == "no":
            return queryset.filter(code_source="")
        return queryset


# --------------------------------------------------------------------------- the admin


def _last_outcome() -> Subquery:
    return Subquery(ended_newest_first(Run.TERMINAL, job=OuterRef("pk")).values("status")[:1])


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    form = JobAdminForm
    # Columns chosen to fit a 1366 px window: the next run in UTC with the job's zone under it.
    list_display = (
        "public_id",
        "name_and_source",
        "state_badge",
        "owner",
        "schedule_in_words",
        "next_run",
        "last_outcome",
        "target_host",
        "runs_link",
    )
    list_filter = ("state", "owner", TargetHostFilter, "paused", "misfire", "overlap", CodeOwnedFilter)
    search_fields = ("name", "target", "task")
    search_help_text = "Name, target, or id (job_12 or 12)."
    list_select_related = ("owner",)
    list_per_page = 50
    actions = ("pause_jobs", "resume_jobs", "run_jobs_now", "delete_jobs")
    readonly_fields = (
        "state", "defined_in", "schedule_in_words", "next_times_preview", "created_at", "updated_at", "deleted_at"
    )

    def get_fieldsets(self, request: HttpRequest, obj: Job | None = None) -> Any:
        who = ("owner", "name", "state", "paused", "paused_until", "defined_in") if obj else ("owner", "name", "paused", "paused_until")
        history = (("History", {"fields": ("created_at", "updated_at", "deleted_at")}),) if obj else ()
        secret = "secret_headers"
        if obj and not self.has_change_permission(request, obj):
            secret = "secret_header_names"  # read-only: the names, never the stored (encrypted) values
        return (
            (None, {"fields": who}),
            (
                "Schedule",
                {
                    "fields": (
                        "schedule",
                        "every",
                        "at",
                        "starts_at",
                        "ends_at",
                        "exclude",
                        "timezone",
                        "schedule_in_words",
                        "next_times_preview",
                        "window",
                        "misfire",
                        "overlap",
                    )
                },
            ),
            ("Target", {"fields": ("target", "method", "headers", secret, "payload", "task", "args", "kwargs",
                                   "queue")}),
            ("Execution", {"fields": ("retry_max", "retry_backoff", "retry_base", "retry_cap", "timeout", "notify",
                                      "notify_on", "pause_after_failures")}),
            *history,
        )

    def get_readonly_fields(self, request: HttpRequest, obj: Job | None = None) -> Any:
        return (*self.readonly_fields, "owner") if obj else self.readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Job]:
        return (
            super()
            .get_queryset(request)
            .annotate(last_outcome_status=_last_outcome())
            .prefetch_related(selectors._open_runs())  # one query per page for "next run"
        )

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Job], search_term: str) -> Any:
        found, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        pk = parse_id("job", search_term.strip())
        if pk is not None:
            found |= queryset.filter(pk=pk)
        return found, may_have_duplicates

    # ---- permissions: no row deletes; acting needs change (or delete) on jobs

    def has_delete_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        return False  # "delete" ends the job through job_delete; history stays

    def has_change_permission(self, request: HttpRequest, obj: Job | None = None) -> bool:
        # A job defined in code is read-only here (its page shows every field disabled);
        # the list's pause, resume and run-now actions still work on it.
        if obj is not None and code_owned_refusal(obj, ("change",)) is not None:
            return False
        return super().has_change_permission(request, obj)

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        job = self.get_object(request, unquote(object_id))
        refusal = code_owned_refusal(job, ("change",)) if job is not None else None
        if refusal is not None:
            if request.method == "POST":  # said in words, not a bare 403; nothing written
                self.message_user(request, f"Not saved: {refusal}.", messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
            self.message_user(request, f"{refusal}.", messages.WARNING)
        return super().change_view(request, object_id, form_url, self._runs_context(object_id, extra_context))

    def _runs_context(self, object_id: str, extra_context: dict[str, Any] | None) -> dict[str, Any]:
        """The job page's link to its runs and its latest run, kept up to date (scheduler/live.js)."""
        context = dict(extra_context or {})
        pk = parse_id("job", object_id)
        if pk is not None:
            last_ended = ended_newest_first(Run.TERMINAL, job_id=pk).first()
            # The newest of the job's open runs (a few: its next one, backfills, a
            # manual run) and its newest ended one.
            newest_open = Run.objects.filter(job_id=pk, kept_for=OPEN_KEPT_FOR).order_by("-scheduled_for", "-id").first()
            candidates = [r for r in (newest_open, last_ended) if r is not None]
            latest = max(candidates, key=lambda r: (r.scheduled_for, r.pk)) if candidates else None
            context.update(
                runs_url=f"{reverse('admin:runs_run_changelist')}?job={format_id('job', pk)}",
                latest_run=latest,
                latest_outcome=last_ended,
                latest_live_url=reverse("admin:runs_run_live", args=[latest.pk]) if latest else "",
            )
        return context

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return self.has_change_permission(request)

    def has_end_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("jobs.delete_job")

    # ---- columns

    @admin.display(description="id", ordering="id")
    def public_id(self, job: Job) -> str:
        return job.public_id

    @admin.display(description="schedule")
    def schedule_in_words(self, job: Job) -> str:
        return schedule_words(job)

    @staticmethod
    def _next(job: Job) -> Run | None:
        return selectors.open_run_of(job)

    @admin.display(description="next run (UTC)")
    def next_run_utc(self, job: Job) -> str:
        run = self._next(job)
        return iso_z(run.scheduled_for) if run else "-"

    @admin.display(description="next run (job's zone)")
    def next_run_local(self, job: Job) -> str:
        run = self._next(job)
        return local_time(run.scheduled_for, job.timezone) if run else "-"

    @admin.display(description="last outcome", ordering="last_outcome_status")
    def last_outcome(self, job: Job) -> str:
        status = getattr(job, "last_outcome_status", None)
        return format_html('<span class="badge badge-{}">{}</span>', status, status) if status else "-"

    @admin.display(description="state", ordering="state")
    def state_badge(self, job: Job) -> str:
        return format_html('<span class="badge badge-{}">{}</span>', job.state, job.get_state_display())

    @admin.display(description="next run (UTC / job's zone)")
    def next_run(self, job: Job) -> str:
        run = self._next(job)
        if run is None:
            return "-"
        text = iso_z(run.scheduled_for)
        return format_html(
            "{}<wbr>{}<br><small>{}</small>", text[:10], text[10:], local_time(run.scheduled_for, job.timezone)
        )

    @admin.display(description="runs")
    def runs_link(self, job: Job) -> str:
        return format_html('<a href="{}?job={}">runs</a>', reverse("admin:runs_run_changelist"), job.public_id)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        return super().changelist_view(request, dict(extra_context or {}, title="Jobs"))

    @admin.display(description="target host")
    def target_host(self, job: Job) -> str:
        return target_key(job)

    @admin.display(description="defined in code", ordering="code_source")
    def defined_in(self, job: Job) -> str:
        return job.code_source or "-"

    @admin.display(description="name", ordering="name")
    def name_and_source(self, job: Job) -> str:
        # A code-owned job says so under its name (one column fewer: the list fits 1366 px).
        if not job.code_source:
            return job.name
        return format_html('{}<br><small class="code-source">defined in code: {}</small>', job.name, job.code_source)

    @admin.display(description="next five times")
    def next_times_preview(self, job: Job) -> str:
        if not job.pk:
            return "-"
        times = next_times(job, timezone.now())
        if not times:
            return "-"
        rows = ((local_time(t, job.timezone), iso_z(t)) for t in times)
        return format_html("<ol>{}</ol>", format_html_join("", "<li>{} &nbsp; <code>{}</code></li>", rows))

    # ---- view-only display of the form's non-model fields (a read-only user sees the API's words)

    @admin.display(description="at (one-off)")
    def at(self, job: Job) -> Any:
        return iso_z(job.run_at) if job.run_at else "-"

    @admin.display(description="every")
    def every(self, job: Job) -> str:
        return schedule.format_duration(timedelta(seconds=job.every_seconds)) if job.every_seconds else "-"

    @admin.display(description="window")
    def window(self, job: Job) -> str:
        return schedule.format_duration(timedelta(seconds=job.window_seconds))

    @admin.display(description="backoff")
    def retry_backoff(self, job: Job) -> str:
        return job.retry_backoff

    @admin.display(description="first delay")
    def retry_base(self, job: Job) -> str:
        return schedule.format_duration(timedelta(seconds=job.retry_base_seconds))

    @admin.display(description="longest delay")
    def retry_cap(self, job: Job) -> str:
        return schedule.format_duration(timedelta(seconds=job.retry_cap_seconds))

    @admin.display(description="timeout")
    def timeout(self, job: Job) -> str:
        return schedule.format_duration(timedelta(seconds=job.timeout_seconds))

    # ---- writes go through the services

    def save_model(self, request: HttpRequest, obj: Job, form: JobAdminForm, change: bool) -> None:
        try:
            if change:
                before = Job.objects.only("target", "secret_headers").get(pk=obj.pk)
                job = services.job_update(job=obj, fields=form.service_fields, by_owner=False)
                moved = target_host(before.target) != target_host(job.target)
                if moved and before.secret_headers and not job.secret_headers:
                    messages.warning(request, "The target moved to another host: the job's secret headers were "
                                              "dropped. Enter them again if they belong there.")
            else:
                job = services.job_create(owner=form.cleaned_data["owner"], fields=form.service_fields)
        except ValueError as exc:
            # Refused by the service after the checks passed (a time that already has a run,
            # a job deleted meanwhile): said on the page, nothing written.
            request._job_admin_refusal = str(exc)  # type: ignore[attr-defined]
            return
        obj.pk = job.pk
        obj.refresh_from_db()

    def log_addition(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None if getattr(request, "_job_admin_refusal", None) else super().log_addition(request, obj, message)

    def log_change(self, request: HttpRequest, obj: Any, message: Any) -> Any:
        return None if getattr(request, "_job_admin_refusal", None) else super().log_change(request, obj, message)

    def _refused(self, request: HttpRequest) -> HttpResponse | None:
        reason = getattr(request, "_job_admin_refusal", None)
        if reason is None:
            return None
        self.message_user(request, f"Not saved: {reason}", messages.ERROR)
        return HttpResponseRedirect(request.get_full_path())

    def response_add(self, request: HttpRequest, obj: Job, post_url_continue: str | None = None) -> HttpResponse:
        return self._refused(request) or super().response_add(request, obj, post_url_continue)

    def response_change(self, request: HttpRequest, obj: Job) -> HttpResponse:
        return self._refused(request) or super().response_change(request, obj)

    # ---- actions: one service each

    def _report(self, request: HttpRequest, verb: str, done: list[Job], skipped: list[str]) -> None:
        if done:
            ids = ", ".join(j.public_id for j in done)
            self.message_user(
                request, f"{verb} {len(done)} job{'s' if len(done) != 1 else ''}: {ids}.", messages.SUCCESS
            )
        for reason in skipped:
            self.message_user(request, f"Skipped {reason}.", messages.WARNING)

    @admin.action(description="Pause selected jobs", permissions=["operate"])
    def pause_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        done, skipped = [], []
        for job in queryset:
            if job.state == Job.State.DELETED or job.paused:
                skipped.append(f"{job.public_id}: already {'deleted' if job.state == Job.State.DELETED else 'paused'}")
                continue
            with transaction.atomic():
                done.append(services.job_pause(job=job))
                audit_record(actor=request.user, via="admin", action="paused", obj=job)
        self._report(request, "Paused", done, skipped)

    @admin.action(description="Resume selected jobs", permissions=["operate"])
    def resume_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        done, skipped = [], []
        for job in queryset:
            if job.state == Job.State.DELETED or not job.paused:
                skipped.append(f"{job.public_id}: {'deleted' if job.state == Job.State.DELETED else 'not paused'}")
                continue
            with transaction.atomic():
                done.append(services.job_resume(job=job))
                audit_record(actor=request.user, via="admin", action="resumed", obj=job)
        self._report(request, "Resumed", done, skipped)

    @admin.action(description="Run selected jobs now (an extra run)", permissions=["operate"])
    def run_jobs_now(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        done, skipped = [], []
        for job in queryset:
            try:
                run = job_trigger(job=job, actor=request.user, via="admin")
            except TriggerRefused as exc:
                self.message_user(request, f"Not run now: {exc}.", messages.WARNING)
                continue
            done.append(job)
            self.message_user(request, f"Made run {run.public_id} of {job.public_id}, due at {iso_z(run.scheduled_for)}.")
        self._report(request, "Triggered", done, skipped)

    @admin.action(description="Delete selected jobs (cancel waiting runs, keep history)", permissions=["end"])
    def delete_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        done, skipped = [], []
        for job in queryset:
            if job.state == Job.State.DELETED:
                skipped.append(f"{job.public_id}: already deleted")
                continue
            refusal = code_owned_refusal(job)
            if refusal is not None:
                skipped.append(refusal)
                continue
            with transaction.atomic():
                services.job_delete(job=job)
                audit_record(actor=request.user, via="admin", action="deleted", obj=job)
            done.append(job)
        self._report(request, "Deleted", done, skipped)


@admin.register(ServiceAccount)
class ServiceAccountAdmin(admin.ModelAdmin):
    form = ServiceAccountForm
    list_display = ("user", "granted_tasks", "notify", "created_at")
    fields = ("user", "task_prefixes", "notify", "created_at")
    readonly_fields = ("user", "created_at")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a service account is made by create_service_token

    @admin.display(description="task prefixes")
    def granted_tasks(self, account: ServiceAccount) -> str:
        return ", ".join(account.task_prefixes or []) or "-"


@admin.register(ServiceToken)
class ServiceTokenAdmin(admin.ModelAdmin):
    """Tokens by prefix and dates only: the token itself is stored as a hash and was
    shown once, when it was made (create_service_token). Revoking is the one change."""

    list_display = ("prefix", "user", "created_at", "last_used_at", "revoked_at")
    list_filter = (("revoked_at", admin.EmptyFieldListFilter),)
    search_fields = ("=prefix", "user__username")
    list_select_related = ("user",)
    fields = readonly_fields = ("prefix", "user", "created_at", "last_used_at", "revoked_at")
    actions = ["revoke_tokens"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a token is made by create_service_token, which shows it once

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # revoked, not deleted: the row says when it stopped working

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # The change permission is off (nothing is edited), so the action asks for its own.
        actions = super().get_actions(request)
        if not request.user.has_perm("jobs.change_servicetoken"):
            actions.pop("revoke_tokens", None)
        return actions

    @admin.action(description="Revoke selected tokens")
    def revoke_tokens(self, request: HttpRequest, queryset: QuerySet[ServiceToken]) -> None:
        with transaction.atomic():
            live = list(queryset.filter(revoked_at__isnull=True).select_related("user"))
            ServiceToken.objects.filter(pk__in=[t.pk for t in live]).update(revoked_at=timezone.now())
            for token in live:
                audit_record(actor=request.user, via="admin", action="token_revoked", obj=token.user,
                             detail={"revoked": [token.prefix]})
        self.message_user(request, f"Revoked {len(live)} token(s).", messages.SUCCESS)
