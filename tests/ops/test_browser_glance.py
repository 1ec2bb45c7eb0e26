"""Ops at a glance, in headless Chromium (Debian's chromium, driven by Playwright as in
test_browser.py): the dashboard, the lists, the system page and a run page at 1366x768
and 1920x1080, no list wider than a 1366 px window, and a run watched live on its page
while the test scans it and a worker calls its (slow) target in this process.

Saves docs/img/glance-*.png and docs/img/live-*.png (overwritten each run), which
docs/admin.md shows."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import pytest
from django.conf import settings as django_settings
from django.db import connection
from django.utils import timezone

from jobs.services import job_create, service_account_ensure
from runs import events, workers
from runs.models import Run, TargetBreaker
from runs.services import run_execute
from scanners.scan import scan_once
from tests.factories import make_run
from tests.ops.conftest import PASSWORD, ago, dead_run, person
from tests.ops.test_browser import IMG, browser_page, jobs_for_the_list, loopback  # noqa: F401
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration]
S = Run.Status
SIZES = [(1366, 768), (1920, 1080)]


def log_in(page: Any, base: str) -> None:
    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "olga-operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#dashboard")


def a_busy_day(owner: Any, target: LoopbackTarget) -> Run:
    """Jobs, and runs in every state the pages show; returns a finished run with a full timeline."""
    nightly = jobs_for_the_list(owner, target)
    now = timezone.now()
    done = make_run(nightly, ago(hours=3), status=S.SUCCEEDED, attempt=2, fence=2, is_backfill=True,
                    started_at=ago(hours=3), finished_at=ago(hours=3) + timedelta(seconds=12))
    t0 = ago(hours=3)
    timeline = [
        ("scheduled", 0, {}), ("queued", 0.2, {}),
        ("claimed", 0.3, {"fence": 1, "worker": "worker-a@ops-1/4121/81231", "attempt": 1}),
        ("target_answered", 1.4, {"fence": 1, "status": 503, "duration_ms": 1090}),
        ("retry_scheduled", 1.4, {"fence": 1, "due_at": "later"}), ("queued", 11.5, {}),
        ("claimed", 11.6, {"fence": 2, "worker": "worker-b@ops-2/5120/11872", "attempt": 2}),
        ("target_answered", 11.9, {"fence": 2, "status": 200, "duration_ms": 301}),
        ("succeeded", 12.0, {"fence": 2, "next_run": "run_99"}),
    ]
    for kind, seconds, detail in timeline:
        events.record(done.pk, kind, t0 + timedelta(seconds=seconds), **detail)
    for m in range(1, 40):  # a run a minute, started within a second or so of its due time
        due = ago(minutes=m)
        started = due + timedelta(seconds=0.05 + (m % 5) * 0.3)
        run = make_run(nightly, due, status=S.QUEUED, is_backfill=True)
        events.record_many([events.event(run.pk, "claimed", started, fence=1)], runs={run.pk: run})
        Run.objects.filter(pk=run.pk).update(status=S.SUCCEEDED if m % 7 else S.DEAD, started_at=started,
                                             finished_at=started + timedelta(seconds=1))
        events.record(run.pk, "succeeded" if m % 7 else "dead", started + timedelta(seconds=1), reason="HTTP 500")
    for h in range(3):
        dead_run(nightly, ago(hours=5 + h))
    make_run(nightly, ago(minutes=30, seconds=7), status=S.QUEUED, is_backfill=True)  # late now
    make_run(nightly, ago(seconds=20), status=S.RUNNING, is_backfill=True, started_at=ago(seconds=19),
             lease_owner="worker-a@ops-1/4121/81231", lease_expires_at=now + timedelta(seconds=40), fence=1, attempt=1)
    TargetBreaker.objects.create(host="down.example:8443", state="open", failures=5, opened_at=now,
                                 next_probe_at=now + timedelta(seconds=25))
    workers.worker_beat(name="worker-a@ops-1", host="ops-1", started_at=ago(hours=2))
    workers.worker_beat(name="worker-b@ops-2", host="ops-2", started_at=ago(hours=2))
    return done


def no_horizontal_overflow(page: Any) -> bool:
    """Nothing wider than the window: the page, and the result table inside its own
    scrolling box (the admin lets `.results` scroll sideways, which would hide columns)."""
    return bool(
        page.evaluate(
            "document.documentElement.scrollWidth <= window.innerWidth && "
            "[...document.querySelectorAll('.results')].every(e => e.scrollWidth <= e.clientWidth)"
        )
    )


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_lists_system_page_and_run_page_fit_1366_px_and_are_kept_as_screenshots(
    live_server: Any, browser_page: Any, loopback: LoopbackTarget, settings: Any
) -> None:
    settings.SCHEDULER_WORKER_HEARTBEAT = 60  # the two heartbeats below stay fresh for the whole test
    page, base = browser_page, live_server.url
    person("olga-operator", "ops-operator")
    owner, _ = service_account_ensure(name="reports", email="reports-team@example.test")
    done = a_busy_day(owner, loopback)
    log_in(page, base)
    pages = [
        ("dashboard", "/admin/", "#dashboard", False),
        ("jobs", "/admin/jobs/job/", "#result_list", True),
        ("runs", "/admin/runs/run/", "#result_list", True),
        ("dead", "/admin/runs/run/?dead=unhandled", "#result_list", True),
        ("system", "/admin/system/", "#workers", False),
        ("run", f"/admin/runs/run/{done.pk}/change/", "#timeline", False),
    ]
    wide = []
    for width, height in SIZES:
        page.set_viewport_size({"width": width, "height": height})
        for name, path, selector, is_list in pages:
            page.goto(f"{base}{path}")
            page.wait_for_selector(selector)
            if name == "run":
                page.wait_for_selector("#live-note:has-text('ended')")  # the poller has drawn it once
            if width == 1366 and not no_horizontal_overflow(page):
                wide.append((name, page.evaluate(
                    "[document.documentElement.scrollWidth, ...[...document.querySelectorAll('.results')]"
                    ".map(e => [e.scrollWidth, e.clientWidth]), "
                    "...[...document.querySelectorAll('#result_list thead th')].map(e => e.offsetWidth), "
                    "document.getElementById('nav-sidebar') && document.getElementById('nav-sidebar').offsetWidth, "
                    "document.getElementById('changelist-filter') && document.getElementById('changelist-filter').offsetWidth]"
                )))
            page.screenshot(path=str(IMG / f"glance-{name}-{width}.png"), full_page=True)
    assert [w for w in wide if w[0] in ("jobs", "runs", "dead")] == [], wide
    # What the pages show, read as a person would.
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto(f"{base}/admin/")
    assert page.title().endswith("Scheduler admin") and "Scheduler" in page.inner_text("#site-name")
    dead = Run.objects.filter(status=S.DEAD, handled_at__isnull=True).count()
    assert dead == 8 and page.inner_text("#count-dead .n") == str(dead)
    assert page.inner_text("#count-running .n") == "1"
    assert page.locator("#chart-started svg rect").count() == 60
    page.goto(f"{base}/admin/runs/run/?dead=unhandled")
    badge = page.locator("#result_list .badge-dead").first
    assert badge.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(186, 33, 33)"  # red
    page.goto(f"{base}/admin/system/")
    assert page.locator("#workers tr.worker-alive").count() == 2


def page_types(page: Any) -> list[str]:
    return [t.strip() for t in page.locator("#timeline-rows .event-type").all_inner_texts()]


@pytest.mark.django_db(transaction=True)
def test_an_operator_watches_a_run_go_from_scheduled_to_succeeded_without_reloading(
    live_server: Any, browser_page: Any, loopback: LoopbackTarget
) -> None:
    page, base = browser_page, live_server.url
    person("olga-operator", "ops-operator")
    owner, _ = service_account_ensure(name="reports", email="reports-team@example.test")
    loopback.delay("/slow", 3.0)  # the call takes long enough to watch the run running
    job = job_create(
        owner=owner,
        fields={"name": "watched", "run_at": timezone.now() + timedelta(seconds=4), "target": loopback.url("/slow")},
    )
    run = Run.objects.get(job=job)
    log_in(page, base)
    page.set_viewport_size({"width": 1366, "height": 768})
    page.goto(f"{base}/admin/runs/run/{run.pk}/change/")
    page.wait_for_selector("#live-note:has-text('live')")
    assert page_types(page) == ["scheduled"] and page.inner_text("#run-status") == "scheduled"
    page.evaluate("window.__not_reloaded = true")  # gone if the page were reloaded
    page.screenshot(path=str(IMG / "live-1-scheduled.png"), full_page=True)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not scan_once(
        partitions=list(range(django_settings.SCHEDULER_PARTITIONS)), publish=False
    ).queued:
        time.sleep(0.2)  # until the run is due: the scanner's own cadence
    page.wait_for_selector("#timeline-rows .event-queued")
    assert page_types(page) == ["scheduled", "queued"] and page.inner_text("#run-status") == "queued"
    page.screenshot(path=str(IMG / "live-2-queued.png"), full_page=True)

    outcome: dict[str, str] = {}

    def worker() -> None:
        try:
            outcome["run"] = run_execute(run_id=run.pk, worker="worker-live@test")
        finally:
            connection.close()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        page.wait_for_selector("#timeline-rows .event-claimed")
        assert "succeeded" not in page_types(page)  # still calling the slow target
        assert page.inner_text("#run-status") == "running"
        assert "worker-live@test" in page.inner_text("#timeline-rows .event-claimed")
        page.screenshot(path=str(IMG / "live-3-claimed.png"), full_page=True)
        page.wait_for_selector("#timeline-rows .event-succeeded", timeout=30_000)
    finally:
        thread.join(60)
    assert outcome == {"run": "succeeded"}
    types = page_types(page)
    assert types[:5] == ["scheduled", "queued", "claimed", "target_answered", "succeeded"], types
    assert page.inner_text("#run-status") == "succeeded"
    assert "HTTP 200" in page.inner_text("#timeline-rows .event-target_answered")
    assert page.evaluate("window.__not_reloaded === true")
    page.wait_for_selector("#live-note:has-text('ended')")
    page.screenshot(path=str(IMG / "live-4-succeeded.png"), full_page=True)
