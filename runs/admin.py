"""Runs in the admin: the run list with ops filters, the dead list and its actions,
and a run page that draws the run's timeline. Every write is a `runs.ops` service.

The list stays a bounded number of queries whatever its length: the job comes in
the same query (select_related), "who was told" is a subquery on the `dead`
event, and no filter lists rows of another table.
"""

from __future__ import annotations

from datetime import timezone as dt_timezone
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connection
from django.db.models import OuterRef, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_GET, require_POST

from jobs.public_ids import parse_id
from jobs.validators import target_key
from runs import metrics, ops
from runs.delivery import iso_z
from runs.models import Notice, PausedTarget, Run, RunEvent, with_status
from runs.timeline import timeline as run_timeline_entries

S = Run.Status


# --------------------------------------------------------------------------- filters


class InputFilter(admin.SimpleListFilter):
    """A filter with a text box instead of a list of links (lists of jobs or hosts
    would be one row per job: unbounded)."""

    template = "admin/runs/input_filter.html"
    placeholder = ""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return []

    def has_output(self) -> bool:
        return True

    def choices(self, changelist: Any) -> Any:
        others = {k: v for k, v in changelist.params.items() if k != self.parameter_name}
        yield {"others": sorted(others.items()), "value": self.value() or "", "placeholder": self.placeholder}


class JobFilter(InputFilter):
    title = "job"
    parameter_name = "job"
    placeholder = "job_12"

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if not self.value():
            return queryset
        pk = parse_id("job", self.value().strip())
        return queryset.filter(job_id=pk) if pk is not None else queryset.none()


class TargetHostFilter(InputFilter):
    title = "target host"
    parameter_name = "host"
    placeholder = "reports.internal:8443"

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if not self.value():
            return queryset
        return queryset.filter(ops.target_host_q(self.value().strip().lower(), prefix="job__"))


class LateFilter(admin.SimpleListFilter):
    title = "late"
    parameter_name = "late"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [
            ("now", "late now (waiting past its deadline)"),
            ("yes", "late (started past its deadline, or waiting past it now)"),
            ("no", "on time"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() == "now":
            return queryset.filter(metrics.late_now_q(timezone.now()))
        if self.value() not in ("yes", "no"):
            return queryset
        annotated = metrics.with_lateness(queryset, timezone.now())
        late = metrics.late_q()
        return annotated.filter(late) if self.value() == "yes" else annotated.exclude(late)


# The table's rows as autovacuum and ANALYZE last counted them: on the partitioned
# store (migration runs 0015) the sum over its partitions, which autovacuum keeps (it
# never analyzes the partitioned table itself, whose own figure would stay as the
# migration left it); on one table, the table's own.
ESTIMATED_RUNS_SQL = """
SELECT COALESCE(sum(GREATEST(c.reltuples, 0)), 0)::bigint FROM pg_class c
 WHERE c.relkind <> 'p'
   AND (c.oid = 'runs'::regclass OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'runs'::regclass))
"""


class RunPaginator(Paginator):
    """The run list's pages. Unfiltered, its count is PostgreSQL's estimate of the
    table's rows (`pg_class.reltuples`, which autovacuum and ANALYZE keep) once that is
    past ESTIMATE_FROM, not a COUNT(*) that reads every run kept: at the seed's scale,
    90 days of history, that is billions of rows for a number on a page.
    tests/ops/test_run_reads_use_indexes.py found it, the one read of the whole table."""

    ESTIMATE_FROM = 100_000

    @cached_property
    def count(self) -> int:
        if connection.vendor == "postgresql" and not self.object_list.query.where:
            with connection.cursor() as cursor:
                cursor.execute(ESTIMATED_RUNS_SQL)
                estimate = cursor.fetchone()[0]
            if estimate >= self.ESTIMATE_FROM:
                return int(estimate)
        return super().count


class StatusFilter(admin.SimpleListFilter):
    """The status, as the field's own filter had it (`?status__exact=`, which the dashboard
    links to), said through Run.stage so that an index serves it (runs.models.with_status)."""

    title = "status"
    parameter_name = "status__exact"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return list(S.choices)

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        value = self.value()
        return queryset.filter(with_status(value)) if value in S.values else queryset


class DeadFilter(admin.SimpleListFilter):
    title = "dead list"
    parameter_name = "dead"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("unhandled", "dead, not handled"), ("handled", "dead, handled"), ("all", "all dead")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        value = self.value()
        if value == "unhandled":
            return queryset.filter(with_status(S.DEAD), handled_at__isnull=True)
        if value == "handled":
            return queryset.filter(with_status(S.DEAD), handled_at__isnull=False)
        return queryset.filter(with_status(S.DEAD)) if value == "all" else queryset


class DueFilter(admin.SimpleListFilter):
    title = "due"
    parameter_name = "due"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("now", "due now (the next scan queues it)"), ("soon", "due in the next minute")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        now = timezone.now()
        if self.value() == "soon":
            return queryset.filter(metrics.due_soon_q(now))
        if self.value() == "now":
            return queryset.filter(with_status(S.SCHEDULED), held=False, due_at__lte=now)
        return queryset


class HoldFilter(admin.SimpleListFilter):
    title = "held by"
    parameter_name = "hold"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("pause", "a pause (job or target)"), ("breaker", "a breaker not closed")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() == "pause":
            return queryset.filter(with_status(S.SCHEDULED, S.QUEUED), held=True)
        if self.value() == "breaker":
            holds = metrics.breaker_holds()
            return queryset.filter(metrics.held_by_breaker_q(holds)) if holds else queryset.none()
        return queryset


class RetriedFilter(admin.SimpleListFilter):
    title = "attempts"
    parameter_name = "retried"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "more than one"), ("no", "one or none")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Run]) -> QuerySet[Run]:
        if self.value() == "yes":
            return queryset.filter(attempt__gt=1)
        return queryset.filter(attempt__lte=1) if self.value() == "no" else queryset


def _notified() -> Subquery:
    # The run's time too: one events partition probed a row, not each (PostgreSQL).
    dead = RunEvent.objects.filter(run=OuterRef("pk"), scheduled_for=OuterRef("scheduled_for"),
                                   type="dead").order_by("-at", "-id")
    return Subquery(dead.values("detail__notified")[:1])


# --------------------------------------------------------------------------- watching a run live

LIVE_EVENTS = 500


def _iso_ms(value: Any) -> str | None:
    if value is None:
        return None
    return value.astimezone(dt_timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:23] + "Z"


def next_run_of(run: Run) -> Run | None:
    """The job's run after this one (its own schedule's, not an extra run)."""
    later = Run.objects.filter(job_id=run.job_id, scheduled_for__gt=run.scheduled_for, is_backfill=False)
    return later.order_by("scheduled_for").first()


def run_live(run: Run) -> dict[str, Any]:
    """What the run page shows, as JSON: the run's fields, its timeline (as the page
    draws it) and the job's next run. Three queries."""
    found = run_timeline_entries(run, limit=LIVE_EVENTS)
    timeline = ops.run_timeline(run, found)
    nxt = next_run_of(run) if run.status in Run.TERMINAL else None
    return {
        "id": run.public_id,
        "status": run.status,
        "held": run.held,
        "open": run.is_open,
        "attempt": run.attempt,
        "fence": run.fence,
        "lease_owner": run.lease_owner,
        "lease_expires_at": _iso_ms(run.lease_expires_at),
        "scheduled_for": _iso_ms(run.scheduled_for),
        "due_at": _iso_ms(run.due_at),
        "queued_at": _iso_ms(run.queued_at),
        "started_at": _iso_ms(run.started_at),
        "finished_at": _iso_ms(run.finished_at),
        "last_error": run.last_error,
        "events": [
            {
                "at": _iso_ms(row.at),
                "type": row.type,
                "fence": row.fence,
                "worker": row.worker,
                "answer": row.answer,
                "detail": ", ".join(f"{k}={v}" for k, v in row.detail.items()),
                "state": row.state,
                "seconds_in_state": row.seconds_in_state,
            }
            for row in timeline.rows
        ],
        "seconds_by_state": timeline.seconds_by_state,
        "next_run": None
        if nxt is None
        else {
            "id": nxt.public_id,
            "url": reverse("admin:runs_run_change", args=[nxt.pk]),
            "scheduled_for": _iso_ms(nxt.scheduled_for),
            "status": nxt.status,
        },
    }


# --------------------------------------------------------------------------- runs


def iso_wrap(value: Any) -> str:
    """ISO 8601 UTC, allowed to wrap between the date and the time (narrow list columns)."""
    text = iso_z(value)
    return format_html("{}<wbr>{}", text[:10], text[10:])


def badge(status: str, label: str | None = None) -> str:
    """A coloured status (admin.css): dead red, running blue, succeeded green, skipped and
    cancelled grey, held amber."""
    return format_html('<span class="badge badge-{}">{}</span>', status, label or status)


def run_badge(run: Run) -> str:
    if run.held and run.status in (S.SCHEDULED, S.QUEUED):
        return format_html("{} {}", badge(run.status), badge("held"))
    return badge(run.status)


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    # Columns chosen to fit a 1366 px window: times two to a cell, attempt and fence together.
    list_display = (
        "public_id",
        "job_and_host",
        "status_badge",
        "times",
        "attempt_fence",
        "ran",
        "dead_list",
    )
    list_filter = (
        StatusFilter,
        DeadFilter,
        LateFilter,
        DueFilter,
        HoldFilter,
        RetriedFilter,
        JobFilter,
        TargetHostFilter,
        "is_backfill",
        "held",
    )
    search_fields = ("job__name",)
    search_help_text = "Job name, or a run id (run_5521 or 5521)."
    list_select_related = ("job",)
    list_per_page = 100
    show_full_result_count = False  # no second COUNT(*) over the whole table
    paginator = RunPaginator
    actions = ("requeue_dead_runs", "mark_handled")
    fieldsets = (
        (None, {"fields": ("job", "status_badge", "idempotency_key", "is_backfill", "held", "detached", "next_run")}),
        ("Times", {"fields": ("scheduled_for", "due_at", "queued_at", "started_at", "finished_at")}),
        ("Lease", {"fields": ("attempt", "fence", "lease_owner", "lease_expires_at", "partition")}),
        ("Dead list", {"fields": ("last_error", "told", "handled_at", "handled_by")}),
    )
    readonly_fields = tuple(f for _, group in fieldsets for f in group["fields"])

    def get_queryset(self, request: HttpRequest) -> QuerySet[Run]:
        return super().get_queryset(request).annotate(notified=_notified())

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Run], search_term: str) -> Any:
        found, may_have_duplicates = super().get_search_results(request, queryset, search_term)
        pk = parse_id("run", search_term.strip())
        if pk is not None:
            found |= queryset.filter(pk=pk)
        return found, may_have_duplicates

    # ---- permissions: runs are never added or deleted here (prune_runs deletes)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Run | None = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        return self.has_change_permission(request)

    # ---- columns

    @admin.display(description="id", ordering="id")
    def public_id(self, run: Run) -> str:
        return run.public_id

    @admin.display(description="job", ordering="job_id")
    def job_link(self, run: Run) -> str:
        url = reverse("admin:jobs_job_change", args=[run.job_id])
        return format_html('<a href="{}">{}</a> {}', url, run.job.public_id, run.job.name)

    @admin.display(description="target host")
    def target_host(self, run: Run) -> str:
        return target_key(run.job)

    @admin.display(description="job / target host", ordering="job_id")
    def job_and_host(self, run: Run) -> str:
        url = reverse("admin:jobs_job_change", args=[run.job_id])
        return format_html('<a href="{}">{}</a> {}<br><small>{}</small>', url, run.job.public_id, run.job.name,
                           target_key(run.job))

    @admin.display(description="told / handled")
    def dead_list(self, run: Run) -> str:
        if run.status != S.DEAD:
            return "-"
        handled = "handled" if run.handled_at is not None else "not handled"
        return format_html("{}<br><small>{}</small>", self.told(run), handled)

    @admin.display(description="status", ordering="status")
    def status_badge(self, run: Run) -> str:
        return format_html('<span id="run-status">{}</span>', run_badge(run))

    @admin.display(description="scheduled for / due (UTC)", ordering="scheduled_for")
    def times(self, run: Run) -> str:
        if run.due_at == run.scheduled_for:
            return iso_wrap(run.scheduled_for)
        return format_html("{}<br>due {}", iso_wrap(run.scheduled_for), iso_wrap(run.due_at))

    @admin.display(description="attempt / fence")
    def attempt_fence(self, run: Run) -> str:
        return f"{run.attempt} / {run.fence}"

    @admin.display(description="started / finished (UTC)", ordering="started_at")
    def ran(self, run: Run) -> str:
        if run.started_at is None and run.finished_at is None:
            return "-"
        started = iso_wrap(run.started_at) if run.started_at else "-"
        return format_html("{}<br>{}", started, iso_wrap(run.finished_at) if run.finished_at else "-")

    @admin.display(description="next run of the job")
    def next_run(self, run: Run) -> str:
        found = next_run_of(run) if run.status in Run.TERMINAL else None
        if found is None:
            return mark_safe('<span id="next-run">-</span>')
        url = reverse("admin:runs_run_change", args=[found.pk])
        return format_html('<span id="next-run"><a href="{}">{}</a> at {} {}</span>', url, found.public_id,
                           iso_z(found.scheduled_for), run_badge(found))

    @admin.display(description="Idempotency-Key")
    def idempotency_key(self, run: Run) -> str:
        return run.idempotency_key

    @admin.display(description="told")
    def told(self, run: Run) -> str:
        if run.status != S.DEAD:
            return "-"
        notified = getattr(run, "notified", None)
        return notified or "nobody (no address)"

    @admin.display(description="handled", boolean=True)
    def handled(self, run: Run) -> bool | None:
        return run.handled_at is not None if run.status == S.DEAD else None

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        title = "Dead list" if request.GET.get("dead") else "Runs"
        return super().changelist_view(request, dict(extra_context or {}, title=title))

    # ---- the run page: its timeline, and the dead-list buttons

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        run = self.get_object(request, object_id)
        context = dict(
            extra_context or {}, show_save=False, show_save_and_continue=False, show_save_and_add_another=False
        )
        if run is not None:
            context["timeline"] = ops.run_timeline(run, run_timeline_entries(run))
            context["can_operate"] = self.has_change_permission(request, run)
            context["run"] = run
            # Read-only: titled for what it is, not "Change run".
            context["title"] = f"Run {run.public_id} of {run.job.public_id} {run.job.name}"
            context["live_url"] = reverse("admin:runs_run_live", args=[run.pk])
        return super().change_view(request, object_id, form_url, context)

    def get_urls(self) -> list[Any]:
        wrap = self.admin_site.admin_view
        return [
            path("<path:object_id>/requeue/", wrap(require_POST(self.requeue_view)), name="runs_run_requeue"),
            path("<path:object_id>/handled/", wrap(require_POST(self.handled_view)), name="runs_run_handled"),
            path("<path:object_id>/live/", wrap(require_GET(self.live_view)), name="runs_run_live"),
            *super().get_urls(),
        ]

    def _operable(self, request: HttpRequest, object_id: str) -> Run:
        run = get_object_or_404(Run.objects.select_related("job"), pk=parse_id("run", object_id) or 0)
        if not self.has_change_permission(request, run):
            raise PermissionDenied
        return run

    def _back(self, run: Run) -> HttpResponseRedirect:
        return HttpResponseRedirect(reverse("admin:runs_run_change", args=[run.pk]))

    def live_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The run as it is now, for the run page's poller (scheduler/live.js): staff
        session only (admin_view), the same permission as the page."""
        run = get_object_or_404(Run.objects.select_related("job"), pk=parse_id("run", object_id) or 0)
        if not self.has_view_permission(request, run):
            raise PermissionDenied
        return JsonResponse(run_live(run), json_dumps_params={"separators": (",", ":")})

    def requeue_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        run = self._operable(request, object_id)
        self._requeue(request, [run])
        return self._back(run)

    def handled_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        run = self._operable(request, object_id)
        self._handled(request, Run.objects.filter(pk=run.pk))
        return self._back(run)

    # ---- actions: one service each

    def _requeue(self, request: HttpRequest, runs: Any) -> None:
        result = ops.requeue_dead(runs=runs, actor=request.user, via="admin")
        if result.requeued:
            ids = ", ".join(r.public_id for r in result.requeued)
            self.message_user(request, f"Requeued {len(result.requeued)} dead run(s): {ids}.", messages.SUCCESS)
        for _, reason in result.refused:
            self.message_user(request, f"Not requeued: {reason}.", messages.WARNING)

    def _handled(self, request: HttpRequest, runs: QuerySet[Run]) -> None:
        marked = ops.runs_mark_handled(runs=runs, actor=request.user, via="admin")
        level = messages.SUCCESS if marked else messages.WARNING
        self.message_user(request, f"Marked {marked} dead run(s) handled.", level)

    @admin.action(description="Requeue selected dead runs (same Idempotency-Key)", permissions=["operate"])
    def requeue_dead_runs(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        self._requeue(request, queryset.select_related("job"))

    @admin.action(description="Mark selected dead runs handled", permissions=["operate"])
    def mark_handled(self, request: HttpRequest, queryset: QuerySet[Run]) -> None:
        self._handled(request, queryset)


# --------------------------------------------------------------------------- paused targets


class PausedTargetForm(forms.ModelForm):
    class Meta:
        model = PausedTarget
        fields = ("host",)

    def clean_host(self) -> str:
        try:
            return ops.check_host(self.cleaned_data["host"])
        except ops.OpsError as exc:
            raise forms.ValidationError(str(exc)) from exc


@admin.register(PausedTarget)
class PausedTargetAdmin(admin.ModelAdmin):
    """Adding a row pauses the host (pause_target); deleting it resumes the host."""

    form = PausedTargetForm
    list_display = ("host", "paused_at", "paused_by")
    search_fields = ("host",)

    def get_readonly_fields(self, request: HttpRequest, obj: PausedTarget | None = None) -> Any:
        return ("host", "paused_at", "paused_by") if obj else ("paused_at", "paused_by")

    def save_model(self, request: HttpRequest, obj: PausedTarget, form: Any, change: bool) -> None:
        if change:
            return
        result = ops.target_pause(host=obj.host, actor=request.user, via="admin")
        obj.pk = PausedTarget.objects.get(host=result.host).pk
        self.message_user(request, f"Paused {result.host}: held {result.runs} waiting run(s).")

    def delete_model(self, request: HttpRequest, obj: PausedTarget) -> None:
        result = ops.target_resume(host=obj.host, actor=request.user, via="admin")
        self.message_user(request, f"Resumed {result.host}: released {result.runs} run(s).")

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[PausedTarget]) -> None:
        for target in queryset:
            self.delete_model(request, target)


@admin.register(Notice)
class NoticeAdmin(admin.ModelAdmin):
    """The notices outbox, read-only: what owners were told, what waits, what failed and why."""

    list_display = ("id", "job", "kind", "run", "status", "tries", "due_at", "sent_at", "sent_to", "last_error")
    list_filter = ("status", "kind")
    search_fields = ("=job__id", "sent_to")
    list_select_related = ("job", "run")
    ordering = ("-id",)
    fields = readonly_fields = ("job", "run", "kind", "reason", "created_at", "status", "due_at", "tries",
                                "sent_at", "sent_to", "last_error")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
