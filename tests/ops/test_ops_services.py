"""The operator services under the admin and the commands: requeue, holds, prune, run now."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from jobs.models import AuditEntry, Job
from jobs.ops import TriggerRefused, job_trigger
from jobs.services import job_pause
from runs import ops
from runs.models import PausedTarget, Run, RunEvent
from runs.services import run_execute
from tests.factories import make_run, timeline_types, entry
from tests.ops.conftest import ago, dead_run, new_job

pytestmark = pytest.mark.django_db
S = Run.Status


def types(run: Run) -> list[str]:
    return timeline_types(run)


def test_a_requeued_dead_run_keeps_its_key_and_fence_beside_the_jobs_open_run(owner: Any) -> None:
    job = new_job(owner)
    dead = dead_run(job, ago(days=1))
    key, fence = dead.idempotency_key, dead.fence
    assert ops.run_requeue_dead(run=dead, actor="olga")
    dead.refresh_from_db()
    assert dead.status == S.SCHEDULED and dead.is_backfill and not dead.held
    assert dead.idempotency_key == key and dead.fence == fence
    # X-Attempt goes on rising; the retry policy counts from attempt_base.
    assert dead.attempt == 4 and dead.attempt_base == 4
    assert dead.due_at <= timezone.now()
    # The job's own waiting run is untouched: two open runs, one of them extra.
    assert Run.objects.filter(job=job, status=S.SCHEDULED).count() == 2
    requeued = entry(dead, "requeued")
    assert requeued.detail["by"] == "olga" and requeued.detail["previous_attempts"] == 4
    assert AuditEntry.objects.filter(action="requeued", object_id=dead.public_id).exists()


def test_requeueing_twice_changes_nothing_the_second_time(owner: Any) -> None:
    dead = dead_run(new_job(owner), ago(days=1))
    assert ops.run_requeue_dead(run=dead)
    before = RunEvent.objects.count()
    assert not ops.run_requeue_dead(run=dead)
    assert RunEvent.objects.count() == before


def test_a_dead_run_of_a_paused_job_is_not_requeued(owner: Any) -> None:
    job = new_job(owner)
    dead = dead_run(job, ago(days=1))
    job_pause(job=job)
    result = ops.requeue_dead(runs=ops.dead_runs())
    assert result.refused[0][1] == f"{job.public_id} is paused; resume it first"
    dead.refresh_from_db()
    assert dead.status == S.DEAD


@pytest.mark.django_db(transaction=True)
def test_a_requeued_run_gets_a_higher_fence_and_the_same_key_on_its_next_call(owner: Any, target: Any) -> None:
    target.script("/flaky", [200])
    job = new_job(owner, target=target.url("/flaky"))
    dead = dead_run(job, ago(days=1), attempt=4, fence=4)
    ops.run_requeue_dead(run=dead)
    Run.objects.filter(pk=dead.pk).update(status=S.QUEUED, queued_at=timezone.now())  # the scanner's step
    assert run_execute(run_id=dead.pk, worker="w1") == "succeeded"
    [call] = target.calls("/flaky")
    assert call.headers["Idempotency-Key"] == dead.idempotency_key
    # The fence and X-Attempt go on from the dead run's (4 calls): the fifth call.
    assert call.headers["X-Fence-Token"] == "5" and call.headers["X-Attempt"] == "5"
    assert types(dead)[-4:] == ["requeued", "claimed", "target_answered", "succeeded"]
    # An extra run creates no next run: the job still has exactly one waiting run of its own.
    assert Run.objects.filter(job=job, status=S.SCHEDULED, is_backfill=False).count() == 1


def test_marking_handled_keeps_the_first_mark(owner: Any) -> None:
    dead = dead_run(new_job(owner), ago(days=1))
    assert ops.runs_mark_handled(runs=Run.objects.filter(pk=dead.pk), actor="olga") == 1
    assert ops.runs_mark_handled(runs=Run.objects.filter(pk=dead.pk), actor="rita") == 0
    dead.refresh_from_db()
    assert dead.handled_by == "olga" and dead.handled_at is not None


def test_pausing_a_target_holds_waiting_runs_of_that_host_only(owner: Any) -> None:
    on_host = new_job(owner, target="https://reports.internal/a")
    other_port = new_job(owner, target="https://reports.internal:8443/a")
    waiting = Run.objects.get(job=on_host)
    Run.objects.filter(pk=waiting.pk).update(status=S.QUEUED, queued_at=timezone.now())
    result = ops.target_pause(host="Reports.Internal", actor="olga")
    assert (result.host, result.changed_target, result.runs, result.jobs) == ("reports.internal", True, 1, 1)
    waiting.refresh_from_db()
    assert waiting.held and waiting.status == S.SCHEDULED  # a queued message now finds nothing to claim
    assert not Run.objects.get(job=other_port).held
    # New runs of the host's jobs are created held, and a second pause changes nothing.
    assert ops.target_pause(host="reports.internal").runs == 0
    assert PausedTarget.objects.count() == 1


def test_resuming_a_target_releases_runs_except_those_of_paused_jobs(owner: Any) -> None:
    running_free = new_job(owner, target="http://10.1.2.3:8080/x")
    paused = new_job(owner, target="http://10.1.2.3:8080/y")
    ops.target_pause(host="10.1.2.3:8080")
    job_pause(job=paused)
    result = ops.target_resume(host="10.1.2.3:8080")
    assert result.changed_target and result.runs == 1
    assert not Run.objects.get(job=running_free).held and Run.objects.get(job=paused).held
    again = ops.target_resume(host="10.1.2.3:8080")
    assert (again.changed_target, again.runs) == (False, 0)


@pytest.mark.parametrize("host", ["", "https://reports.internal/", "reports.internal/x", "a b", "user@host"])
def test_a_host_that_is_not_a_host_is_refused_in_words(host: str) -> None:
    with pytest.raises(ops.OpsError, match="host"):
        ops.check_host(host)


def test_pruning_deletes_old_finished_runs_and_events_never_open_ones(owner: Any) -> None:
    job = new_job(owner)
    old_dead = dead_run(job, ago(days=100), finished=ago(days=100))
    recent = dead_run(job, ago(days=10), finished=ago(days=10))
    old_open = make_run(job, ago(days=120), status=S.SCHEDULED, is_backfill=True)
    result = ops.prune_runs(older_than=timedelta(days=90), dry_run=True)
    assert (result.runs, result.events) == (1, 1)
    assert Run.objects.filter(pk=old_dead.pk).exists()
    result = ops.prune_runs(older_than=timedelta(days=90), batch=1)
    assert (result.runs, result.events) == (1, 1)
    assert not Run.objects.filter(pk=old_dead.pk).exists() and not RunEvent.objects.filter(run_id=old_dead.pk).exists()
    assert Run.objects.filter(pk__in=[recent.pk, old_open.pk]).count() == 2
    assert ops.prune_runs(older_than=timedelta(days=90)).runs == 0


def test_run_now_makes_an_extra_run_due_now_with_a_triggered_event(owner: Any) -> None:
    job = new_job(owner)
    now = timezone.now().replace(microsecond=250000)
    run = job_trigger(job=job, now=now, actor="olga")
    assert run.is_backfill and run.scheduled_for == run.due_at == now.replace(microsecond=0) + timedelta(seconds=1)
    assert types(run) == ["scheduled", "triggered"]
    # Twice in the same second: the second extra run moves on a second (one run per job and time).
    assert job_trigger(job=job, now=now).scheduled_for == run.scheduled_for + timedelta(seconds=1)


def test_run_now_refuses_a_paused_or_deleted_job(owner: Any) -> None:
    job = new_job(owner)
    job_pause(job=job)
    with pytest.raises(TriggerRefused, match="paused"):
        job_trigger(job=job)
    Job.objects.filter(pk=job.pk).update(state=Job.State.DELETED)
    with pytest.raises(TriggerRefused, match="deleted"):
        job_trigger(job=job)


def test_the_timeline_says_the_time_spent_in_each_state(owner: Any) -> None:
    job = new_job(owner)
    run = make_run(job, ago(hours=1), status=S.SUCCEEDED)
    t0 = ago(hours=1)
    for offset, kind, detail in [
        (0, "scheduled", {}),
        (2, "queued", {}),
        (3, "claimed", {"fence": 1, "worker": "w1"}),
        (5, "target_answered", {"status": 200, "duration_ms": 1500, "fence": 1}),
        (5, "succeeded", {}),
    ]:
        RunEvent.objects.create(run=run, at=t0 + timedelta(seconds=offset), type=kind, detail=detail)
    timeline = ops.run_timeline(run, list(run.events.order_by("at", "id")))
    claimed, answered = timeline.rows[2], timeline.rows[3]
    assert (claimed.fence, claimed.worker, claimed.state) == (1, "w1", S.RUNNING)
    assert answered.answer == "HTTP 200 in 1500 ms" and answered.detail == {}
    assert timeline.seconds_by_state == {S.SCHEDULED: 2.0, S.QUEUED: 1.0, S.RUNNING: 2.0}
    assert timeline.rows[-1].seconds_in_state is None


def test_the_ops_groups_exist_after_migrate_with_their_permissions() -> None:
    from django.contrib.auth.models import Group

    readonly = set(Group.objects.get(name=ops.READONLY_GROUP).permissions.values_list("codename", flat=True))
    operator = set(Group.objects.get(name=ops.OPERATOR_GROUP).permissions.values_list("codename", flat=True))
    assert readonly == {"view_job", "view_run", "view_runevent", "view_pausedtarget"}
    assert {"change_job", "change_run", "delete_job"} <= operator and readonly <= operator
    ops.ensure_ops_groups()  # again: nothing new
    assert Group.objects.filter(name__startswith="ops-").count() == 2
