"""GET /metrics: Prometheus text, read after a few real runs."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client, override_settings
from django.utils import timezone

from jobs.services import job_create
from runs.models import Run
from runs.services import run_execute
from tests.factories import scrape_metrics
from tests.target import LoopbackTarget

S = Run.Status


def samples(text: str) -> dict[str, float]:
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def execute(owner: Any, url: str, **fields: Any) -> str:
    job = job_create(owner=owner, fields={"schedule": "*/5 * * * *", "target": url, "retry_base_seconds": 1, **fields})
    run = Run.objects.get(job=job, status=S.SCHEDULED)
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=timezone.now(), due_at=timezone.now())
    return run_execute(run_id=run.pk, worker="w1")


@pytest.mark.django_db(transaction=True)
def test_metrics_count_runs_started_succeeded_failed_and_dead_after_a_few_runs(
    owner: Any, target: LoopbackTarget
) -> None:
    target.script("/bad", [400])
    target.script("/flaky", [503])
    assert execute(owner, target.url("/ok")) == "succeeded"
    assert execute(owner, target.url("/ok2")) == "succeeded"
    assert execute(owner, target.url("/flaky")) == "retry_scheduled"
    assert execute(owner, target.url("/bad")) == "dead"
    response = scrape_metrics()
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain; version=0.0.4")
    text = response.content.decode()
    assert "# TYPE scheduler_runs_started_total counter" in text
    found = samples(text)
    assert found["scheduler_runs_started_total"] == 4
    assert found["scheduler_runs_succeeded_total"] == 2
    assert found["scheduler_runs_failed_total"] == 1
    assert found["scheduler_runs_dead_total"] == 1
    # Lateness: each run's first start, measured when it happened (so the retried run counts, against the
    # due time it had then), all within seconds of the due time.
    assert found["scheduler_run_lateness_seconds_count"] == 4
    assert found['scheduler_run_lateness_seconds_bucket{le="+Inf"}'] == 4
    assert found['scheduler_run_lateness_seconds_bucket{le="5.0"}'] == 4
    assert found["scheduler_queue_depth"] == 0 and "scheduler_runs_late" in found
    assert "scheduler_coordinator_up" in found


@pytest.mark.embedded
@pytest.mark.django_db
def test_metrics_show_queue_depth_and_late_runs(owner: Any) -> None:
    from tests.factories import make_run
    from tests.ops.conftest import ago, new_job

    job = new_job(owner)
    make_run(job, ago(minutes=10), status=S.QUEUED, is_backfill=True)
    make_run(job, ago(seconds=5), status=S.QUEUED, is_backfill=True)
    found = samples(scrape_metrics().content.decode())
    assert found["scheduler_queue_depth"] == 2 and found["scheduler_runs_late"] == 1


@pytest.mark.django_db
@override_settings(SCHEDULER_METRICS_TOKEN="s3cret")
def test_metrics_need_the_bearer_token_when_one_is_set() -> None:
    refused = Client().get("/metrics")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer wrong").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 200
    assert Client().post("/metrics", HTTP_AUTHORIZATION="Bearer s3cret").status_code == 405


def bulkhead_models() -> tuple[Any, Any]:
    from django.apps import apps

    try:
        return apps.get_model("runs", "TargetSlot"), apps.get_model("runs", "TargetBreaker")
    except LookupError:
        pytest.skip("the bulkhead and breaker models are not in this tree yet")


@pytest.mark.django_db
def test_breaker_state_and_bulkhead_use_show_per_host_on_metrics_and_the_system_page(operator_client: Any) -> None:
    _, breakers = bulkhead_models()
    now = timezone.now()
    breakers.objects.create(
        host="down.test:8080", state="open", failures=5, opened_at=now, next_probe_at=now + timedelta(seconds=30)
    )
    from runs import bulkhead

    lease = timedelta(seconds=60)
    # One holder took a slot five minutes ago and died: its lease ran out, not in flight.
    assert bulkhead.take(host="busy.test", holder="run_9/dead-worker", now=now - timedelta(minutes=5), lease=lease)
    taken = bulkhead.take_many(host="busy.test", holders=[f"run_{n}/w1" for n in range(3)], now=now, lease=lease)
    assert len(taken) == 3
    found = samples(scrape_metrics().content.decode())
    assert found['scheduler_target_in_flight{host="busy.test"}'] == 3
    assert found['scheduler_target_breaker_state{host="down.test:8080",state="open"}'] == 1
    assert found['scheduler_target_breaker_state{host="down.test:8080",state="closed"}'] == 0
    assert found['scheduler_target_breaker_state{host="busy.test",state="closed"}'] == 1
    page = operator_client.get("/admin/system/").content.decode()
    assert "down.test:8080" in page and "<strong>open</strong>" in page and "3 of 10" in page


@pytest.mark.django_db
@override_settings(SCHEDULER_METRICS_TOKEN="", EMBEDDED=False)
def test_without_a_token_the_production_layout_answers_staff_sessions_only(operator_client: Client) -> None:
    """The figures name every tenant's target hosts and the scanners: without
    SCHEDULER_METRICS_TOKEN nobody but staff reads them (open only on the embedded defaults)."""
    refused = Client().get("/metrics")
    assert refused.status_code == 401 and refused["WWW-Authenticate"].startswith("Bearer")
    assert "scheduler_" not in refused.content.decode()
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 401
    assert operator_client.get("/metrics").status_code == 200


@pytest.mark.django_db
@override_settings(SCHEDULER_METRICS_TOKEN="s3cret")
def test_with_a_token_a_staff_session_reads_them_too(operator_client: Client) -> None:
    assert operator_client.get("/metrics").status_code == 200


@pytest.mark.django_db
@override_settings(SCHEDULER_METRICS_TOKEN="", EMBEDDED=True)
def test_on_the_embedded_defaults_without_a_token_they_are_open() -> None:
    assert Client().get("/metrics").status_code == 200
