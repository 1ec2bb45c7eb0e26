"""The admin in headless Chromium, with a real scanner, a real Celery worker and a
loopback target: an operator finds a job, pauses and resumes it, opens a dead run,
requeues it and watches it succeed on its timeline. Saves the screenshots that
docs/admin.md shows (docs/img/admin-*.png, overwritten each run).

Needs Debian's chromium (/usr/bin/chromium) and the playwright package; Playwright
only drives that browser (no `playwright install`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from jobs.models import Job
from jobs.services import job_create, service_account_ensure
from runs.models import Run
from tests.integration.conftest import Stack, wait_for
from tests.ops.conftest import PASSWORD, person
from tests.target import LoopbackTarget

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status
CHROMIUM = "/usr/bin/chromium"
IMG = Path(__file__).resolve().parents[2] / "docs" / "img"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture
def browser_page(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (requirements-dev.txt)")
    if not shutil.which(CHROMIUM):
        pytest.skip("needs Debian's chromium: apt-get install -y chromium")
    # Playwright's sync API keeps an event loop in this thread; the test's own ORM calls
    # are still plain synchronous code.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 900})
        page.set_default_timeout(20_000)
        yield page
        browser.close()


@pytest.fixture
def loopback() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def jobs_for_the_list(owner: Any, target: LoopbackTarget) -> Job:
    now = timezone.now()
    job_create(
        owner=owner,
        fields={
            "name": "billing-sync",
            "schedule": "*/15 * * * *",
            "target": target.url("/billing"),
            "misfire": "skip",
        },
    )
    job_create(
        owner=owner,
        fields={
            "name": "weekly-digest",
            "schedule": "0 9 * * 1",
            "timezone": "Europe/London",
            "target": target.url("/digest"),
            "window_seconds": 300,
        },
    )
    job_create(
        owner=owner,
        fields={
            "name": "reminder-42",
            "run_at": (now + timedelta(days=2)).replace(microsecond=0),
            "timezone": "America/New_York",
            "target": target.url("/remind"),
        },
    )
    return job_create(
        owner=owner,
        fields={
            "name": "nightly-report",
            "schedule": "0 2 * * *",
            "timezone": "Asia/Kolkata",
            "target": target.url("/nightly"),
        },
    )


def status_on_page(page: Any) -> str:
    return page.locator("#run-status").inner_text().strip()


def test_an_operator_finds_pauses_and_resumes_a_job_and_requeues_a_dead_run_that_then_succeeds(
    stack: Stack,
    integration_env: dict[str, str],
    live_server: Any,
    loopback: LoopbackTarget,
    browser_page: Any,
    settings: Any,
) -> None:
    # The system page (served by live_server in this process) reads the stack's coordinator and queue.
    settings.SCHEDULER_ZK_ROOT = integration_env["SCHEDULER_ZK_ROOT"]
    settings.CELERY_TASK_DEFAULT_QUEUE = integration_env["SCHEDULER_RUN_QUEUE"]
    page, base = browser_page, live_server.url
    person("olga-operator", "ops-operator")
    owner, _ = service_account_ensure(name="reports", email="reports-team@example.test")
    nightly = jobs_for_the_list(owner, loopback)
    loopback.script("/export", [400, 200])  # refused at once (dead), then fine
    export = job_create(
        owner=owner,
        fields={
            "name": "export-retry",
            "run_at": timezone.now() + timedelta(seconds=2),
            "target": loopback.url("/export"),
            "retry_max": 0,
        },
    )
    ping = job_create(
        owner=owner,
        fields={"name": "ping", "run_at": timezone.now() + timedelta(seconds=1), "target": loopback.url("/ping")},
    )
    stack.scanner("scanner-a")
    stack.worker("worker-a")
    wait_for(lambda: Run.objects.filter(job=ping, status=S.SUCCEEDED).exists(), 60, what="the ping run to succeed")
    dead = wait_for(lambda: Run.objects.filter(job=export, status=S.DEAD).first(), 60, what="the export run to die")

    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "olga-operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#system-link")

    # The job list, then find the job by search.
    page.goto(f"{base}/admin/jobs/job/")
    page.wait_for_selector("#result_list")
    assert "ping" in page.inner_text("#result_list")
    page.screenshot(path=str(IMG / "admin-jobs.png"), full_page=True)
    page.fill("#searchbar", "nightly")
    page.press("#searchbar", "Enter")
    page.wait_for_selector(f"#result_list a:text('{nightly.public_id}')")
    assert page.locator("#result_list tbody tr").count() == 1
    assert "every day at 02:00 Asia/Kolkata" in page.inner_text("#result_list")

    for action, message, paused in [("pause_jobs", "Paused 1 job", True), ("resume_jobs", "Resumed 1 job", False)]:
        page.check(f"input[name=_selected_action][value='{nightly.pk}']")
        page.select_option("select[name=action]", action)
        page.click("button[name=index]")
        page.wait_for_selector(f".messagelist li:has-text('{message}')")
        nightly.refresh_from_db()
        assert nightly.paused is paused
        assert ("Paused" if paused else "Active") in page.inner_text("#result_list")

    # The dead list, the dead run's page, requeue; the worker runs it again.
    page.goto(f"{base}/admin/runs/run/?dead=unhandled")
    page.click(f"#result_list a:text('{dead.public_id}')")
    page.wait_for_selector("#timeline")
    assert "reports-team@example.test" in page.inner_text("#content")
    page.click("#requeue-run")
    page.wait_for_selector(f".messagelist li:has-text('Requeued 1 dead run(s): {dead.public_id}')")

    def succeeded_on_page() -> bool:
        page.reload()
        return status_on_page(page) == "succeeded"

    wait_for(succeeded_on_page, 60, interval=1, what="the requeued run to succeed on its page")
    page.wait_for_selector("#timeline-rows .event-succeeded")  # the page's own poller brings the last events
    timeline = page.inner_text("#timeline")
    for text in ("requeued", "HTTP 400", "HTTP 200", "succeeded", "Time in each state"):
        assert text in timeline, text
    page.screenshot(path=str(IMG / "admin-run-timeline.png"), full_page=True)
    calls = loopback.calls("/export")
    assert [c.headers["X-Fence-Token"] for c in calls] == ["1", "2"]
    assert calls[0].headers["Idempotency-Key"] == calls[1].headers["Idempotency-Key"] == dead.idempotency_key

    # The system page: the stack's scanner holds every partition.
    def scanner_on_page() -> bool:
        page.goto(f"{base}/admin/system/")
        return "scanner-a" in page.inner_text("#scanners")

    wait_for(scanner_on_page, 30, interval=1, what="the scanner on the system page")
    # The worker process writes its own heartbeat (runs.workers, from Celery's worker_ready): alive, on the page.
    from runs.models import WorkerHeartbeat

    beat = wait_for(lambda: WorkerHeartbeat.objects.filter(name__startswith="worker-a@").first(), 30,
                    what="the worker's heartbeat")
    page.goto(f"{base}/admin/system/")
    assert beat.name in page.inner_text("#workers") and page.locator("#workers tr.worker-alive").count() == 1
    assert "coordinator unreachable" not in page.inner_text("#content")
    assert "p95" in page.inner_text("#lag")  # the ping run started within the last five minutes
    page.screenshot(path=str(IMG / "admin-system.png"), full_page=True)


def test_the_admin_and_the_api_docs_render_under_the_content_security_policy(
    live_server: Any, browser_page: Any, loopback: LoopbackTarget
) -> None:
    page, base = browser_page, live_server.url
    refused: list[str] = []
    page.on("console", lambda msg: refused.append(msg.text) if "Content Security Policy" in msg.text else None)
    page.on("pageerror", lambda error: refused.append(str(error)))
    person("olga-operator", "ops-operator")
    owner, _ = service_account_ensure(name="reports", email="reports-team@example.test")
    nightly = jobs_for_the_list(owner, loopback)

    page.goto(f"{base}/admin/login/?next=/admin/")
    page.fill("#id_username", "olga-operator")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_selector("#system-link")
    for path, selector in [
        ("/admin/jobs/job/", "#result_list"),
        (f"/admin/jobs/job/{nightly.pk}/change/", "#job_form"),
        ("/admin/runs/run/", "#result_list"),
        ("/admin/system/", "#content"),
    ]:
        response = page.goto(f"{base}{path}")
        assert "default-src 'self'" in response.headers["content-security-policy"], path
        page.wait_for_selector(selector)
    # The admin's own scripts ran (files, not inline): the actions bar counts the rows ("0 of 4 selected").
    page.goto(f"{base}/admin/jobs/job/")
    page.wait_for_selector(".action-counter:has-text('0 of')")

    response = page.goto(f"{base}/api/docs/")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    page.wait_for_selector(".swagger-ui .opblock-summary-path", timeout=20_000)  # Swagger UI rendered the schema
    assert "/api/jobs/" in page.inner_text(".swagger-ui")
    assert refused == [], refused
