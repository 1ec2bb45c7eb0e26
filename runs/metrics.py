"""Figures for operators: selectors shared by the admin's system page and `GET /metrics`.

Each selector is one or two queries whatever the number of rows.

`/metrics` choices (docs/admin.md has them for operators):
- Counters are read from the database, not kept in a process: any web process
  answers the same, and a restart loses nothing. They are the all-time rows of
  the rollups (runs.rollups: counted where the events are written, in the same
  transaction), so a scrape reads a few dozen rows whatever the size of `runs`
  and `run_events`, and pruning old runs no longer resets them.
- The lateness histogram is each run's first start minus its due time, measured
  at the claim (so a run that is later retried counts once, against the due time
  it had when it first started). Runs that started before the rollups existed
  were carried over once by the migration, as the old query counted them.
- Who may read it: `Authorization: Bearer <SCHEDULER_METRICS_TOKEN>`, or a staff
  session (the admin's). Without a token set, staff sessions only, except on the
  embedded defaults (one machine, trying it out), where it is open: the figures name
  every tenant's target hosts and the scanners.
"""

from __future__ import annotations

import hmac
import statistics
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.models import (
    Aggregate,
    Case,
    Count,
    DateTimeField,
    F,
    FloatField,
    Func,
    Max,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.lookups import GreaterThan
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET

from jobs.public_ids import format_id
from runs import rollups
from runs.models import ROLLUP_LAG_EDGES, Run, RunRollup, with_status

S = Run.Status
LAG_WINDOW = timedelta(minutes=5)
LATENESS_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)
# The events counted as the run counters, and their metric names.
EVENT_COUNTERS = {
    "claimed": (
        "scheduler_runs_started_total",
        "Runs claimed by a worker to call their target (each claim, retries included).",
    ),
    "succeeded": ("scheduler_runs_succeeded_total", "Runs that succeeded."),
    "retry_scheduled": ("scheduler_runs_failed_total", "Calls that failed and got a retry scheduled."),
    "dead": ("scheduler_runs_dead_total", "Runs that went to the dead list."),
}


# --------------------------------------------------------------------------- SQL helpers


class SecondsBetween(Func):
    """later - earlier, in seconds, on PostgreSQL and SQLite (the embedded mode)."""

    arity = 2
    arg_joiner = " - "
    template = "EXTRACT(EPOCH FROM (%(expressions)s))::double precision"
    output_field = FloatField()

    def as_sqlite(self, compiler: Any, connection: Any, **extra: Any) -> Any:
        return super().as_sql(
            compiler,
            connection,
            template="((julianday(%(expressions)s)) * 86400.0)",
            arg_joiner=") - julianday(",
            **extra,
        )


class PercentileCont(Aggregate):
    """PostgreSQL's percentile_cont(f) WITHIN GROUP (ORDER BY x)."""

    function = "percentile_cont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression: Any, fraction: float, **extra: Any) -> None:
        super().__init__(expression, fraction=float(fraction), **extra)


def grace_seconds() -> int:
    return int(settings.SCHEDULER_MISFIRE_GRACE)


def with_lateness(runs: QuerySet[Run], now: datetime) -> QuerySet[Run]:
    """Annotations behind `late_q`: a waiting run is measured at now, any other at its first start."""
    waiting = Q(status__in=(S.SCHEDULED, S.QUEUED))
    reference = Case(
        When(waiting & Q(held=False), then=Value(now, output_field=DateTimeField())),
        When(waiting, then=Value(None, output_field=DateTimeField())),  # held: paused, not late
        default=F("started_at"),
        output_field=DateTimeField(),
    )
    return runs.annotate(_late_ref=reference).annotate(
        _late_sched=SecondsBetween(F("_late_ref"), F("scheduled_for")),
        _late_due=SecondsBetween(F("_late_ref"), F("due_at")),
    )


def late_q() -> Q:
    """Late: started after max(scheduled_for + window, due_at) +
    SCHEDULER_MISFIRE_GRACE, or waiting (not held) and past that now. Needs with_lateness."""
    grace = grace_seconds()
    return Q(_late_ref__isnull=False, _late_sched__gt=F("job__window_seconds") + grace, _late_due__gt=grace)


def late_now_q(now: datetime) -> Q:
    """Waiting, not held, and past the deadline now (no annotation needed)."""
    grace = grace_seconds()
    since_sched = SecondsBetween(Value(now, output_field=DateTimeField()), F("scheduled_for"))
    return Q(
        GreaterThan(since_sched, F("job__window_seconds") + grace),
        with_status(S.SCHEDULED, S.QUEUED),
        held=False,
        due_at__lt=now - timedelta(seconds=grace),
    )


# --------------------------------------------------------------------------- selectors


DUE_SOON = timedelta(minutes=1)


@dataclass(frozen=True)
class QueueFigures:
    queued: int  # in the database: the run queue as the store sees it
    due: int  # scheduled, not held, due now: the next scan queues them
    held: int
    late: int
    running: int = 0
    due_soon: int = 0  # scheduled, not held, due within the next minute (not yet due)


def queue_figures(now: datetime | None = None) -> QueueFigures:
    """One query over the open runs (runs_status_idx: never the finished ones)."""
    now = now or timezone.now()
    found = Run.objects.filter(with_status(S.SCHEDULED, S.QUEUED, S.RUNNING)).aggregate(
        n_queued=Count("id", filter=Q(status=S.QUEUED)),
        n_due=Count("id", filter=Q(status=S.SCHEDULED, held=False, due_at__lte=now)),
        n_held=Count("id", filter=Q(held=True, status__in=(S.SCHEDULED, S.QUEUED))),
        n_late=Count("id", filter=late_now_q(now)),
        n_running=Count("id", filter=Q(status=S.RUNNING)),
        n_due_soon=Count("id", filter=due_soon_q(now)),
    )
    return QueueFigures(**{k.removeprefix("n_"): int(v or 0) for k, v in found.items()})


def due_soon_q(now: datetime) -> Q:
    return Q(with_status(S.SCHEDULED), held=False, due_at__gt=now, due_at__lte=now + DUE_SOON)


def dead_unhandled_count() -> int:
    """Dead and not handled: a count of runs_dead_unhandled_idx, never of the table."""
    return Run.objects.filter(with_status(S.DEAD), handled_at__isnull=True).count()


def breaker_holds(now: datetime | None = None, limit: int = 50) -> list[tuple[str, datetime]]:
    """(host, until) for each host whose breaker is open or half-open: its waiting runs
    due before `until` (the next probe, or the probe's end) wait for the breaker."""
    from runs.models import TargetBreaker

    now = now or timezone.now()
    rows = TargetBreaker.objects.exclude(state=TargetBreaker.State.CLOSED).order_by("host")[:limit]
    return [(b.host, max([t for t in (b.next_probe_at, b.probe_until) if t is not None] + [now])) for b in rows]


def held_by_breaker_q(holds: list[tuple[str, datetime]]) -> Q:
    """Waiting runs on a host whose breaker is not closed, sent back to wait for it: due
    after now and before it lets them through (the next probe)."""
    from runs.ops import target_host_q

    now = timezone.now()
    on_hosts = Q()
    for host, until in holds:
        on_hosts |= Q(target_host_q(host, prefix="job__"), due_at__lte=until)
    # Sent back to wait (due_at moved to the probe time), so due after now: a short range
    # of runs_due_idx per partition, and the pattern is matched on those runs' jobs only.
    # A run already due again is counted as due: the next worker sends it back or lets it through.
    latest = max(until for _, until in holds) if holds else now
    return Q(
        on_hosts,
        with_status(S.SCHEDULED),
        held=False,
        partition__in=list(range(settings.SCHEDULER_PARTITIONS)),
        due_at__gt=now,
        due_at__lte=latest,
    )


def held_by_breaker_count(holds: list[tuple[str, datetime]]) -> int:
    return Run.objects.filter(held_by_breaker_q(holds)).count() if holds else 0


@dataclass(frozen=True)
class LagFigures:
    count: int
    p50: float | None
    p95: float | None
    max: float | None


def lag_figures(now: datetime | None = None, window: timedelta = LAG_WINDOW) -> LagFigures:
    """Due to first start, in seconds, for runs that started in the last `window`."""
    now = now or timezone.now()
    since = now - window
    runs = _recent_starts(since)
    lag = SecondsBetween(F("started_at"), F("due_at"))
    if connection.vendor == "postgresql":
        found = runs.aggregate(n=Count("id"), p50=PercentileCont(lag, 0.5), p95=PercentileCont(lag, 0.95), top=Max(lag))
        return LagFigures(int(found["n"]), found["p50"], found["p95"], found["top"])
    values = sorted(float(v) for v in runs.annotate(lag=lag).values_list("lag", flat=True))
    if not values:
        return LagFigures(0, None, None, None)
    # SQLite (the embedded mode) has no percentile_cont; its tables are small.
    return LagFigures(len(values), statistics.median(values), _quantile(values, 0.95), values[-1])


def _recent_starts(since: datetime) -> QuerySet[Run]:
    # Found through runs_finished_idx and the running runs (runs_status_idx's `flight`): started_at
    # has no index. A run whose due time moved past its first start (retry, requeue) is left out,
    # as in the histogram.
    return Run.objects.filter(Q(finished_at__gte=since) | with_status(S.RUNNING)).filter(
        started_at__gte=since, due_at__lte=F("started_at")
    )


def _quantile(values: list[float], q: float) -> float:
    # The same linear interpolation as percentile_cont.
    pos = (len(values) - 1) * q
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def _totals() -> list[dict[str, Any]]:
    """The all-time rollup rows by kind and reason: one GROUP BY over a few dozen rows."""
    sums = {c: Sum(c) for c in rollups.COUNTERS}
    return list(
        RunRollup.objects.filter(minute=rollups.TOTAL_MINUTE).values("kind", "reason").annotate(**sums).order_by()
    )


EVENT_KIND = {"claimed": "started", "succeeded": "succeeded", "retry_scheduled": "retry_scheduled", "dead": "dead"}


def event_counts(totals: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """The run counters, by the event type they count (from the rollups' totals)."""
    totals = _totals() if totals is None else totals
    by_kind: dict[str, int] = {}
    for row in totals:
        by_kind[row["kind"]] = by_kind.get(row["kind"], 0) + int(row["n"] or 0)
    return {t: by_kind.get(EVENT_KIND[t], 0) for t in EVENT_COUNTERS}


def skipped_counts(totals: list[dict[str, Any]] | None = None) -> dict[str, int]:
    """Skipped runs by reason (misfire, overlap, excluded, paused, and any other)."""
    totals = _totals() if totals is None else totals
    found = dict.fromkeys(rollups.SKIP_REASONS, 0)
    for row in totals:
        if row["kind"] == "skipped":
            found[row["reason"]] = found.get(row["reason"], 0) + int(row["n"] or 0)
    return found


def noisiest_skippers(limit: int = 10) -> list[tuple[int, int]]:
    """(job id, skipped runs) of the jobs with the most skipped runs: one query."""
    rows = (
        RunRollup.objects.filter(minute=rollups.TOTAL_MINUTE, kind="skipped", job_id__gt=0)
        .values("job_id")
        .annotate(total=Sum("n"))
        .order_by("-total", "job_id")[:limit]
    )
    return [(int(r["job_id"]), int(r["total"])) for r in rows]


@dataclass(frozen=True)
class Histogram:
    buckets: list[tuple[float, int]]  # (upper bound, cumulative count)
    count: int
    sum: float


def lateness_histogram(totals: list[dict[str, Any]] | None = None) -> Histogram:
    """First start minus due time over every run that has started on or after its due time."""
    totals = _totals() if totals is None else totals
    started = [row for row in totals if row["kind"] == "started"]
    per_bucket = [sum(int(row[f"b{i}"] or 0) for row in started) for i in range(rollups.BUCKETS)]
    buckets = []
    for bound in LATENESS_BUCKETS:
        buckets.append((bound, sum(n for edge, n in zip(ROLLUP_LAG_EDGES, per_bucket) if edge <= bound)))
    count = sum(int(row["lag_n"] or 0) for row in started)
    return Histogram(buckets=buckets, count=count, sum=float(sum(float(row["lag_sum"] or 0) for row in started)))


@dataclass(frozen=True)
class TargetFigures:
    host: str
    in_flight: int | None  # bulkhead slots held now (of SCHEDULER_TARGET_CONCURRENCY); None: unknown
    breaker: str  # closed, open or half_open
    failures: int  # in a row, as the breaker counts them
    next_probe_at: datetime | None


def target_states(now: datetime | None = None, limit: int = 500) -> list[TargetFigures]:
    """Per-target bulkhead use and breaker state: the slot store, and one query (breakers).
    Looked up by name, so this page works before the bulkhead's models (runs.bulkhead,
    runs.breakers) are migrated: [] then."""
    from runs import bulkhead

    try:
        breakers = apps.get_model("runs", "TargetBreaker")
    except LookupError:
        return []
    from runs.claims import store_now

    now = now or store_now()  # slot leases are in the store's clock
    # A slot past its lease belongs to a worker that died: not in flight.
    slots = bulkhead.in_flight(None, now=now)  # None: the slot store (Redis) did not answer
    in_flight = dict(sorted((slots or {}).items())[:limit])
    states = {b.host: b for b in breakers.objects.order_by("host")[:limit]}
    rows = []
    for host in sorted(set(in_flight) | set(states))[:limit]:
        breaker = states.get(host)
        rows.append(
            TargetFigures(
                host=host,
                in_flight=None if slots is None else in_flight.get(host, 0),
                breaker=breaker.state if breaker else "closed",
                failures=breaker.failures if breaker else 0,
                next_probe_at=breaker.next_probe_at if breaker else None,
            )
        )
    return rows


@dataclass(frozen=True)
class ScannerFigures:
    reachable: bool
    owners: dict[str, list[int]]
    unowned: list[int]
    error: str = ""


def scanner_figures() -> ScannerFigures:
    """Which scanner holds which partitions, from the coordinator."""
    from scanners.coordination import CoordinatorUnavailable, partition_owners

    try:
        owners = partition_owners()
    except CoordinatorUnavailable as exc:
        return ScannerFigures(False, {}, [], str(exc))
    held = {p for parts in owners.values() for p in parts}
    return ScannerFigures(True, owners, [p for p in range(settings.SCHEDULER_PARTITIONS) if p not in held])


def broker_queue_length() -> int | None:
    """Messages waiting on the run queue in the broker; None when it cannot be asked."""
    from kombu.exceptions import ChannelError

    from scheduler_project.celery import app

    try:
        with app.connection_for_read() as conn:
            conn.ensure_connection(max_retries=1, timeout=2)
            try:
                declared = conn.default_channel.queue_declare(queue=settings.CELERY_TASK_DEFAULT_QUEUE, passive=True)
            except ChannelError:
                return 0  # not declared yet: no worker or publish has used it, so nothing waits
            return int(declared.message_count)
    except Exception:  # any other broker trouble only means "unknown" on an ops page
        return None


# --------------------------------------------------------------------------- /metrics


def _line(name: str, value: float | int | None, labels: dict[str, str] | None = None) -> str:
    text = "NaN" if value is None else (repr(float(value)) if isinstance(value, float) else str(value))
    if labels:
        inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {text}"
    return f"{name} {text}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _header(name: str, kind: str, text: str) -> list[str]:
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]


BREAKER_STATES = ("closed", "half_open", "open")


def render_metrics(now: datetime | None = None) -> str:
    """The Prometheus text exposition format (version 0.0.4)."""
    now = now or timezone.now()
    out: list[str] = []
    totals = _totals()
    counts = event_counts(totals)
    for event_type, (name, text) in EVENT_COUNTERS.items():
        out += _header(name, "counter", text) + [_line(name, counts[event_type])]
    out += _skipped_lines(totals)
    hist = lateness_histogram(totals)
    name = "scheduler_run_lateness_seconds"
    out += _header(name, "histogram", "A run's first start minus its due time.")
    for bound, count in hist.buckets:
        out.append(_line(f"{name}_bucket", count, {"le": repr(bound)}))
    out += [
        _line(f"{name}_bucket", hist.count, {"le": "+Inf"}),
        _line(f"{name}_sum", hist.sum),
        _line(f"{name}_count", hist.count),
    ]
    queue = queue_figures(now)
    for key, text in (
        ("queued", "Runs queued in the store, not yet claimed."),
        ("due", "Runs due now that the next scan will queue."),
        ("held", "Waiting runs held by a paused job or target."),
        ("late", "Waiting runs past their misfire deadline now."),
    ):
        metric = f"scheduler_runs_{key}" if key != "queued" else "scheduler_queue_depth"
        out += _header(metric, "gauge", text) + [_line(metric, getattr(queue, key))]
    name = "scheduler_notices_held_total"
    held = sum(int(row["n"] or 0) for row in totals if row["kind"] == "notices_held")
    out += _header(name, "counter", "Notices held because their service had SCHEDULER_NOTIFY_PER_HOUR "
                                    "in the last hour.") + [_line(name, held)]
    name = "scheduler_runs_found_by_floor_drop_total"
    found = sum(int(row["n"] or 0) for row in totals if row["kind"] == rollups.FLOOR_DROP_FOUND)
    out += _header(name, "counter", "Waiting runs a scanner found only at its periodic floor drop: "
                                    "above 0, a wake-up is missing.") + [_line(name, found)]
    out += _target_lines(now)
    out += _notice_lines()
    out += _scanner_lines()
    return "\n".join(out) + "\n"


def _notice_lines() -> list[str]:
    """The notices outbox (runs.notices): waiting to go out, and given up on."""
    from runs.models import Notice

    counts = dict(Notice.objects.filter(status__in=["pending", "failed"]).order_by().values_list("status")
                  .annotate(n=Count("id")).values_list("status", "n"))
    out: list[str] = []
    for status, text in (("pending", "Notices waiting to be sent (digest window, backoff)."),
                         ("failed", "Notices given up on: out of tries, refused, or nowhere to send.")):
        name = f"scheduler_notices_{status}"
        out += _header(name, "gauge", text) + [_line(name, counts.get(status, 0))]
    return out


def _skipped_lines(totals: list[dict[str, Any]]) -> list[str]:
    name = "scheduler_runs_skipped_total"
    out = _header(name, "counter", "Runs skipped, by reason (misfire, overlap, excluded, paused).")
    out += [_line(name, n, {"reason": reason}) for reason, n in skipped_counts(totals).items()]
    name = "scheduler_job_runs_skipped_total"
    out += _header(name, "counter", "Runs skipped, for the ten jobs with the most.")
    out += [_line(name, n, {"job": format_id("job", job_id)}) for job_id, n in noisiest_skippers()]
    return out


def _target_lines(now: datetime) -> list[str]:
    rows = target_states(now)
    if not rows:
        return []
    out = _header("scheduler_target_in_flight", "gauge", "Calls in flight to a target host.")
    # Unknown (the slot store did not answer) is no sample, not a 0.
    out += [_line("scheduler_target_in_flight", r.in_flight, {"host": r.host}) for r in rows if r.in_flight is not None]
    out += _header("scheduler_target_breaker_state", "gauge", "1 for the breaker's current state per target host.")
    for row in rows:
        for state in BREAKER_STATES:
            out.append(
                _line("scheduler_target_breaker_state", int(row.breaker == state), {"host": row.host, "state": state})
            )
    return out


def _scanner_lines() -> list[str]:
    scanners = scanner_figures()
    out = _header("scheduler_coordinator_up", "gauge", "1 when the partition coordinator answered.")
    out.append(_line("scheduler_coordinator_up", int(scanners.reachable)))
    if not scanners.reachable:
        return out
    out += _header("scheduler_scanner_partitions", "gauge", "Partitions each scanner holds.")
    out += [
        _line("scheduler_scanner_partitions", len(parts), {"scanner": who}) for who, parts in scanners.owners.items()
    ]
    out += _header("scheduler_partitions_unowned", "gauge", "Partitions no scanner holds.")
    out.append(_line("scheduler_partitions_unowned", len(scanners.unowned)))
    return out


def _authorized(request: HttpRequest) -> bool:
    token = getattr(settings, "SCHEDULER_METRICS_TOKEN", "")
    given = request.headers.get("Authorization", "")
    if token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        return True
    user = getattr(request, "user", None)
    if user is not None and user.is_active and user.is_staff:
        return True
    return not token and bool(getattr(settings, "EMBEDDED", False))


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _authorized(request):
        response = HttpResponse(
            "a bearer token (SCHEDULER_METRICS_TOKEN) or a staff session is needed\n", status=401,
            content_type="text/plain; charset=utf-8"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    return HttpResponse(render_metrics(), content_type="text/plain; version=0.0.4; charset=utf-8")
