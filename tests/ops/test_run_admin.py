"""The run admin: filters, the dead list and its actions, and the run page's timeline."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from runs.models import Run, RunEvent
from tests.factories import make_run
from tests.ops.conftest import ago, dead_run, new_job

pytestmark = pytest.mark.django_db
S = Run.Status
LIST = "/admin/runs/run/"


def shown(client: Client, **params: Any) -> list[Run]:
    response = client.get(LIST, params)
    assert response.status_code == 200
    return list(response.context["cl"].result_list)


def test_the_dead_list_says_who_was_told_and_what_is_handled(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    told = dead_run(job, ago(days=1))
    nobody = dead_run(job, ago(days=2), notified="")
    Run.objects.filter(pk=nobody.pk).update(handled_at=timezone.now(), handled_by="olga")
    assert shown(operator_client, dead="unhandled") == [told]
    assert shown(operator_client, dead="handled") == [nobody]
    page = operator_client.get(LIST, {"dead": "all"}).content.decode()
    assert "reports-team@example.test" in page and "nobody (no address)" in page


@pytest.mark.embedded
def test_late_means_started_past_the_deadline_or_waiting_past_it_now(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)  # window 0s, grace 60s
    on_time = make_run(job, ago(hours=3), status=S.SUCCEEDED, started_at=ago(hours=3) + timedelta(seconds=5))
    started_late = make_run(job, ago(hours=2), status=S.SUCCEEDED, started_at=ago(hours=2) + timedelta(seconds=90))
    waiting_late = make_run(job, ago(minutes=5), status=S.QUEUED, is_backfill=True)
    held = make_run(job, ago(minutes=6), status=S.SCHEDULED, is_backfill=True, held=True)
    late = shown(operator_client, late="yes")
    assert set(late) == {started_late, waiting_late}
    assert on_time in shown(operator_client, late="no") and held not in late


def test_runs_filter_by_job_host_and_attempts(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    other = new_job(owner, target="http://127.0.0.1:9000/x")
    retried = make_run(job, ago(hours=1), status=S.SUCCEEDED, attempt=3)
    assert retried in shown(operator_client, job=job.public_id)
    assert all(r.job_id == other.pk for r in shown(operator_client, host="127.0.0.1:9000"))
    assert shown(operator_client, retried="yes") == [retried]
    assert shown(operator_client, job="nonsense") == []


def test_requeue_and_mark_handled_act_on_the_dead_list(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    first, second = dead_run(job, ago(days=1)), dead_run(job, ago(days=2))
    response = operator_client.post(LIST, {"action": "requeue_dead_runs", "_selected_action": [first.pk]}, follow=True)
    assert [str(m) for m in response.context["messages"]] == [f"Requeued 1 dead run(s): {first.public_id}."]
    response = operator_client.post(LIST, {"action": "mark_handled", "_selected_action": [second.pk]}, follow=True)
    assert "Marked 1 dead run(s) handled." in [str(m) for m in response.context["messages"]]
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.status == S.SCHEDULED and second.handled_by == "olga-operator"


@pytest.mark.embedded
def test_the_run_page_draws_the_timeline_and_requeues_a_dead_run(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    run = dead_run(job, ago(hours=1))
    t0 = ago(hours=1)
    RunEvent.objects.create(run=run, at=t0, type="claimed", detail={"fence": 4, "worker": "w1@host/12/3"})
    RunEvent.objects.create(
        run=run,
        at=t0 + timedelta(seconds=2),
        type="target_answered",
        detail={"status": 500, "duration_ms": 2000, "fence": 4},
    )
    page = operator_client.get(f"{LIST}{run.pk}/change/").content.decode()
    for text in (
        "Timeline",
        "w1@host/12/3",
        "HTTP 500 in 2000 ms",
        "notified=reports-team@example.test",
        "Time in each state",
        "Requeue (same Idempotency-Key)",
        run.idempotency_key,
    ):
        assert text in page, text
    assert 'name="_save"' not in page  # nothing on a run is edited by hand
    response = operator_client.post(f"{LIST}{run.pk}/requeue/", follow=True)
    assert f"Requeued 1 dead run(s): {run.public_id}." in [str(m) for m in response.context["messages"]]
    run.refresh_from_db()
    assert run.status == S.SCHEDULED
    assert operator_client.get(f"{LIST}{run.pk}/requeue/").status_code == 405


def test_pausing_a_target_in_the_admin_holds_its_runs(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    response = operator_client.post("/admin/runs/pausedtarget/add/", {"host": "Reports.Internal"}, follow=True)
    assert "Paused reports.internal: held 1 waiting run(s)." in [str(m) for m in response.context["messages"]]
    assert Run.objects.get(job=job).held
    bad = operator_client.post("/admin/runs/pausedtarget/add/", {"host": "https://x.test/"})
    assert "is not a host" in str(bad.context["adminform"].form.errors)
