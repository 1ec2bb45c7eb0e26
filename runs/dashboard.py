"""The admin's dashboard (the top of `/admin/`): what is failing, late and running now,
and what runs did over the last hour and day, drawn as inline SVG.

Every figure is a bounded number of queries whatever the size of `runs` and
`run_events`: the "now" counts read the open runs (runs_status_idx) and the small
partial index of dead runs not handled; the history reads the per-minute rollups
(runs.rollups), at most 1,440 minutes of a few kinds. Nothing here counts the
finished runs or the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone as dt_timezone
from urllib.parse import urlencode

from django.db.models import Q, Sum
from django.db.models.functions import Trunc
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

from runs import metrics, rollups
from runs.models import ROLLUP_LAG_EDGES, RunRollup

HOUR = timedelta(hours=1)
DAY = timedelta(days=1)


def runs_url(**params: str) -> str:
    return f"{reverse('admin:runs_run_changelist')}?{urlencode(params)}"


@dataclass(frozen=True)
class Count:
    key: str
    label: str
    value: int
    url: str
    tone: str  # the badge colour: dead, late, running, queued, held...


@dataclass(frozen=True)
class Rate:
    succeeded: int
    dead: int

    @property
    def percent(self) -> float | None:
        ended = self.succeeded + self.dead
        return None if not ended else 100.0 * self.succeeded / ended


@dataclass(frozen=True)
class HostRow:
    host: str
    calls: int
    failures: int
    breaker: str
    in_flight: int | None  # None: the slot store did not answer
    url: str


@dataclass
class Dashboard:
    now: datetime
    counts: list[Count]
    hour: Rate
    day: Rate
    started: list[tuple[datetime, int]] = field(default_factory=list)  # per minute, last hour
    lag: list[tuple[datetime, float | None, float | None]] = field(default_factory=list)  # p50, p99 per minute
    dead_per_hour: list[tuple[datetime, int]] = field(default_factory=list)
    hosts: list[HostRow] = field(default_factory=list)

    def charts(self) -> dict[str, SafeString]:
        return {
            "started": bar_chart([(t, n) for t, n in self.started], "runs started per minute", "#417690"),
            "lag": lag_chart(self.lag),
            "dead": bar_chart([(t, n) for t, n in self.dead_per_hour], "dead per hour", "#ba2121", hourly=True),
        }


# --------------------------------------------------------------------------- figures


def now_counts(now: datetime) -> list[Count]:
    """The six "now" figures, each linking to the run list filtered to exactly that set."""
    queue = metrics.queue_figures(now)
    dead = metrics.dead_unhandled_count()
    by_breaker = metrics.held_by_breaker_count(metrics.breaker_holds(now))
    return [
        Count("dead", "dead, not handled", dead, runs_url(dead="unhandled"), "dead"),
        Count("late", "late now", queue.late, runs_url(late="now"), "late"),
        Count("running", "running", queue.running, runs_url(status__exact="running"), "running"),
        Count("queued", "queued", queue.queued, runs_url(status__exact="queued"), "queued"),
        Count("due", "due in the next minute", queue.due_soon, runs_url(due="soon"), "scheduled"),
        Count("held", "held by a pause", queue.held, runs_url(hold="pause"), "held"),
        Count("breaker", "held by a breaker", by_breaker, runs_url(hold="breaker"), "held"),
    ]


def _outcomes(now: datetime) -> tuple[Rate, Rate, list[tuple[datetime, int]]]:
    """Success rate over the hour and the day, and dead per hour: one query over the
    day's `succeeded` and `dead` minutes, summed by hour in the database (48 rows)."""
    day_start = rollups.minute_of(now - DAY) + timedelta(minutes=1)
    hour_start = rollups.minute_of(now - HOUR) + timedelta(minutes=1)
    rows = (
        RunRollup.objects.filter(minute__gte=day_start, kind__in=("succeeded", "dead"))
        .annotate(hour=Trunc("minute", "hour", tzinfo=dt_timezone.utc))
        .values("hour", "kind")
        .annotate(total=Sum("n"), last_hour=Sum("n", filter=Q(minute__gte=hour_start)))
        .order_by()
    )
    tallies = {"hour": {"succeeded": 0, "dead": 0}, "day": {"succeeded": 0, "dead": 0}}
    first_hour = day_start.replace(minute=0)
    dead_hours = {first_hour + HOUR * i: 0 for i in range(25)}
    for row in rows:
        tallies["day"][row["kind"]] += int(row["total"] or 0)
        tallies["hour"][row["kind"]] += int(row["last_hour"] or 0)
        if row["kind"] == "dead":
            dead_hours[row["hour"]] = dead_hours.get(row["hour"], 0) + int(row["total"] or 0)
    hour, day = (Rate(t["succeeded"], t["dead"]) for t in (tallies["hour"], tallies["day"]))
    return hour, day, sorted(dead_hours.items())


def _starts(now: datetime) -> tuple[list[tuple[datetime, int]], list[tuple[datetime, float | None, float | None]]]:
    """Runs started and start lag p50/p99 per minute over the last hour: one query."""
    last = rollups.minute_of(now)
    minutes = [last - timedelta(minutes=59 - i) for i in range(60)]
    sums = {c: Sum(c) for c in rollups.COUNTERS}
    rows = RunRollup.objects.filter(minute__gte=minutes[0], kind="started").values("minute").annotate(**sums)
    by_minute = {row["minute"]: row for row in rows.order_by()}
    started, lag = [], []
    for minute in minutes:
        row = by_minute.get(minute)
        started.append((minute, int(row["n"] or 0) if row else 0))
        buckets = [int(row[f"b{i}"] or 0) for i in range(rollups.BUCKETS)] if row else []
        lag.append((minute, quantile(buckets, 0.5), quantile(buckets, 0.99)))
    return started, lag


def quantile(buckets: list[int], q: float) -> float | None:
    """The q-quantile of a rollup's lag buckets, interpolated inside its bucket."""
    total = sum(buckets)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(buckets):
        if n and seen + n >= rank:
            low = ROLLUP_LAG_EDGES[i - 1] if i else 0.0
            high = ROLLUP_LAG_EDGES[i] if i < len(ROLLUP_LAG_EDGES) else ROLLUP_LAG_EDGES[-1]
            return low + (high - low) * (rank - seen) / n
        seen += n
    return ROLLUP_LAG_EDGES[-1]


def _hosts(now: datetime) -> list[HostRow]:
    """Per target host: calls and failed calls in the last hour (rollups), breaker state
    and calls in flight (metrics.target_states)."""
    rows = (
        RunRollup.objects.filter(minute__gte=rollups.minute_of(now - HOUR), kind__in=("call", "call_failed"))
        .exclude(host="")
        .values("host", "kind")
        .annotate(total=Sum("n"))
        .order_by()
    )
    calls: dict[str, dict[str, int]] = {}
    for row in rows:
        calls.setdefault(row["host"], {"call": 0, "call_failed": 0})[row["kind"]] = int(row["total"] or 0)
    states = {t.host: t for t in metrics.target_states()}
    found = []
    for host in sorted(set(calls) | set(states))[:200]:
        state = states.get(host)
        found.append(
            HostRow(
                host=host,
                calls=calls.get(host, {}).get("call", 0),
                failures=calls.get(host, {}).get("call_failed", 0),
                breaker=state.breaker if state else "closed",
                in_flight=state.in_flight if state else 0,
                url=runs_url(host=host, hold="breaker") if state and state.breaker != "closed" else runs_url(host=host),
            )
        )
    # The broken ones first: an open breaker, then the most failures.
    return sorted(found, key=lambda h: (h.breaker == "closed", -h.failures, h.host))


def dashboard(now: datetime | None = None) -> Dashboard:
    now = now or timezone.now()
    hour, day, dead_per_hour = _outcomes(now)
    started, lag = _starts(now)
    return Dashboard(
        now=now,
        counts=now_counts(now),
        hour=hour,
        day=day,
        started=started,
        lag=lag,
        dead_per_hour=dead_per_hour,
        hosts=_hosts(now),
    )


# --------------------------------------------------------------------------- inline SVG

W, H, PAD_L, PAD_B, PAD_T = 480, 150, 44, 22, 10


def _frame(title: str, top: float, unit: str, body: str, labels: list[tuple[float, str]]) -> SafeString:
    plot_h = H - PAD_B - PAD_T
    ticks = format_html_join(
        "",
        '<text x="{}" y="{}" class="tick" text-anchor="middle">{}</text>',
        ((f"{x:.1f}", H - 6, text) for x, text in labels),
    )
    return format_html(
        '<svg class="chart" viewBox="0 0 {w} {h}" width="{w}" height="{h}" role="img" aria-label="{title}">'
        "<title>{title}</title>"
        '<line x1="{l}" y1="{t}" x2="{l}" y2="{b}" stroke="#999"/>'
        '<line x1="{l}" y1="{b}" x2="{w}" y2="{b}" stroke="#999"/>'
        '<text x="{lx}" y="{ty}" class="tick" text-anchor="end">{top}{unit}</text>'
        '<text x="{lx}" y="{b}" class="tick" text-anchor="end">0</text>'
        "{body}{ticks}</svg>",
        w=W,
        h=H,
        title=title,
        l=PAD_L,
        t=PAD_T,
        b=PAD_T + plot_h,
        lx=PAD_L - 4,
        ty=PAD_T + 8,
        top=_short(top),
        unit=unit,
        body=mark_safe(body),
        ticks=ticks,
    )


def _short(value: float) -> str:
    if value >= 100 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.2g}" if value < 1 else f"{value:.1f}"


def bar_chart(points: list[tuple[datetime, int]], title: str, colour: str, hourly: bool = False) -> SafeString:
    top = max([n for _, n in points] + [1])
    plot_w, plot_h = W - PAD_L - 4, H - PAD_B - PAD_T
    step = plot_w / max(len(points), 1)
    bars = []
    labels = []
    for i, (when, n) in enumerate(points):
        h = plot_h * n / top
        x = PAD_L + i * step
        bars.append(
            format_html(
                '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{} {}</title></rect>',
                f"{x + 1:.1f}",
                f"{PAD_T + plot_h - h:.1f}",
                f"{max(step - 2, 1):.1f}",
                f"{h:.1f}",
                colour,
                when.strftime("%Y-%m-%dT%H:%MZ"),
                n,
            )
        )
        if i % (6 if hourly else 10) == 0:
            labels.append((x + step / 2, when.strftime("%H:%M")))
    return _frame(title, top, "", "".join(bars), labels)


def lag_chart(points: list[tuple[datetime, float | None, float | None]]) -> SafeString:
    values = [v for _, p50, p99 in points for v in (p50, p99) if v is not None]
    top = max(values + [0.1])
    plot_w, plot_h = W - PAD_L - 4, H - PAD_B - PAD_T
    step = plot_w / max(len(points), 1)
    body = []
    labels = []
    for index, colour in ((2, "#ba2121"), (1, "#417690")):
        line = [
            f"{PAD_L + i * step + step / 2:.1f},{PAD_T + plot_h - plot_h * p[index] / top:.1f}"
            for i, p in enumerate(points)
            if p[index] is not None
        ]
        if line:
            body.append(format_html('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>', colour,
                                    " ".join(line)))
            body.extend(
                format_html('<circle cx="{}" cy="{}" r="2" fill="{}"/>', *pt.split(","), colour) for pt in line
            )
    for i, (when, _, _) in enumerate(points):
        if i % 10 == 0:
            labels.append((PAD_L + i * step + step / 2, when.strftime("%H:%M")))
    return _frame("start lag p50 (blue) and p99 (red) per minute, seconds", top, " s", "".join(body), labels)
