"""The per-minute rollups (runs.rollups): written with the events of a batch, read by
/metrics and the dashboard; a rollup that cannot be written never fails the batch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from runs import events, rollups
from runs.models import Run, RunRollup
from tests.factories import scrape_metrics, make_run, entries
from tests.ops.conftest import ago, new_job
from tests.ops.test_metrics import samples

pytestmark = pytest.mark.django_db
S = Run.Status


def total(kind: str, **key: Any) -> int:
    rows = RunRollup.objects.filter(minute=rollups.TOTAL_MINUTE, kind=kind, **key)
    return int(rows.aggregate(n=Sum("n"))["n"] or 0)


@pytest.mark.embedded
def test_a_batch_of_events_adds_its_counts_to_the_minute_and_to_the_total(owner: Any) -> None:
    job = new_job(owner)
    runs = [make_run(job, ago(minutes=m), status=S.SUCCEEDED, is_backfill=True) for m in (1, 2, 3)]
    now = timezone.now()
    events.record_many([events.event(r.pk, "succeeded", now) for r in runs])
    events.record_many([events.event(runs[0].pk, "dead", now, reason="x")])
    assert total("succeeded") == 3 and total("dead") == 1
    minute = rollups.minute_of(now)
    assert RunRollup.objects.filter(minute=minute, kind="succeeded").aggregate(n=Sum("n"))["n"] == 3


@pytest.mark.embedded
def test_skipped_runs_are_counted_by_reason_and_by_job(owner: Any) -> None:
    noisy, quiet = new_job(owner, name="noisy"), new_job(owner, name="quiet")
    now = timezone.now()
    found = []
    for i, reason in enumerate(["misfire policy skip", "overlap", "excluded", "overlap", "job paused"]):
        run = make_run(noisy, ago(minutes=10 + i), status=S.SKIPPED, is_backfill=True)
        found.append(events.event(run.pk, "skipped", now, reason=reason))
    run = make_run(quiet, ago(minutes=30), status=S.SKIPPED, is_backfill=True)
    found.append(events.event(run.pk, "skipped", now, reason="excluded"))
    events.record_many(found)  # no runs given: the skips' jobs are looked up
    text = scrape_metrics().content.decode()
    got = samples(text)
    assert got['scheduler_runs_skipped_total{reason="overlap"}'] == 2
    assert got['scheduler_runs_skipped_total{reason="excluded"}'] == 2
    assert got['scheduler_runs_skipped_total{reason="misfire"}'] == 1
    assert got['scheduler_runs_skipped_total{reason="paused"}'] == 1
    assert got[f'scheduler_job_runs_skipped_total{{job="{noisy.public_id}"}}'] == 5
    assert got[f'scheduler_job_runs_skipped_total{{job="{quiet.public_id}"}}'] == 1
    assert "# TYPE scheduler_runs_skipped_total counter" in text


def test_a_first_start_adds_its_lag_and_a_later_claim_does_not(owner: Any) -> None:
    job = new_job(owner)
    due = timezone.now() - timedelta(seconds=3)
    run = make_run(job, due, status=S.QUEUED, is_backfill=True)
    events.record_many([events.event(run.pk, "claimed", due + timedelta(seconds=3), fence=1)], runs={run.pk: run})
    run.started_at = due + timedelta(seconds=3)  # as the claim left it
    events.record_many([events.event(run.pk, "claimed", due + timedelta(seconds=9), fence=2)], runs={run.pk: run})
    got = samples(scrape_metrics().content.decode())
    assert got["scheduler_runs_started_total"] == 2
    assert got["scheduler_run_lateness_seconds_count"] == 1
    assert got['scheduler_run_lateness_seconds_bucket{le="2.0"}'] == 0
    assert got['scheduler_run_lateness_seconds_bucket{le="5.0"}'] == 1
    assert got["scheduler_run_lateness_seconds_sum"] == pytest.approx(3.0)


def test_a_rollup_that_cannot_be_written_does_not_fail_the_batch(owner: Any, monkeypatch: Any) -> None:
    job = new_job(owner)
    run = make_run(job, ago(minutes=5), status=S.SUCCEEDED, is_backfill=True)

    def broken(found: Any) -> None:
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO run_rollups (no_such_column) VALUES (1)")

    monkeypatch.setattr(rollups, "_upsert", broken)
    events.record_many([events.event(run.pk, "succeeded", timezone.now())])
    # The events went in, the transaction is still usable, and nothing was counted.
    assert len(entries(run, "succeeded")) == 1
    assert total("succeeded") == 0


def test_prune_runs_drops_old_minutes_and_keeps_the_all_time_counters(owner: Any) -> None:
    from runs.ops import prune_runs

    job = new_job(owner)
    old = make_run(job, ago(days=100), status=S.SUCCEEDED, is_backfill=True, finished_at=ago(days=100))
    events.record(old.pk, "succeeded", ago(days=100))
    recent = make_run(job, ago(minutes=5), status=S.SUCCEEDED, is_backfill=True, finished_at=ago(minutes=4))
    events.record(recent.pk, "succeeded", ago(minutes=4))
    prune_runs(older_than=timedelta(days=90))
    assert not RunRollup.objects.filter(minute__lt=ago(days=90), minute__gt=rollups.TOTAL_MINUTE).exists()
    assert RunRollup.objects.filter(minute__gte=ago(minutes=10), kind="succeeded").exists()
    assert total("succeeded") == 2  # /metrics does not go back when history is pruned


@pytest.mark.django_db(transaction=True)
def test_a_scan_that_skips_missed_times_counts_them_by_reason_and_job(owner: Any) -> None:
    from django.conf import settings

    from scanners.scan import scan_once

    job = new_job(owner, schedule="*/5 * * * *", timezone="UTC", misfire="skip")
    late = ago(minutes=32).replace(minute=(ago(minutes=32).minute // 5) * 5, second=0)
    Run.objects.filter(job=job, status=S.SCHEDULED).update(scheduled_for=late, due_at=late)
    result = scan_once(partitions=list(range(settings.SCHEDULER_PARTITIONS)), publish=False)
    assert result.skipped >= 2  # the late run and the times missed after it
    got = samples(scrape_metrics().content.decode())
    skipped = Run.objects.filter(job=job, status=S.SKIPPED).count()
    assert got['scheduler_runs_skipped_total{reason="misfire"}'] == skipped == result.skipped
    assert got[f'scheduler_job_runs_skipped_total{{job="{job.public_id}"}}'] == skipped
