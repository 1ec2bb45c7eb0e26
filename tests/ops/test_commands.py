"""The ops commands: --dry-run changes nothing, a second run changes nothing, bad
input is one line and a non-zero exit with no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection

from jobs.models import Job
from runs.models import PausedTarget, Run, RunEvent
from tests.factories import created_long_ago, make_run
from tests.ops.conftest import ago, dead_run, new_job

pytestmark = pytest.mark.django_db
S = Run.Status
ROOT = Path(__file__).resolve().parents[2]


def run(*args: Any) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


def snapshot() -> tuple[Any, ...]:
    runs = tuple(Run.objects.order_by("pk").values_list("pk", "status", "held", "attempt", "is_backfill", "due_at"))
    return (
        runs,
        RunEvent.objects.count(),
        tuple(PausedTarget.objects.values_list("host", flat=True)),
        Job.objects.count(),
    )


# ---- requeue_dead


def test_requeue_dead_dry_run_lists_and_changes_nothing_and_a_second_run_requeues_nothing(owner: Any) -> None:
    job = new_job(owner)
    other = new_job(owner, target="https://billing.internal/x")
    dead = dead_run(job, ago(days=1), finished=ago(hours=2))
    dead_run(other, ago(days=1), finished=ago(hours=2))
    dead_run(job, ago(days=9), finished=ago(days=8))
    before = snapshot()
    out = run("requeue_dead", "--target", "reports.internal", "--since", ago(hours=3).isoformat(), "--dry-run")
    assert f"would requeue {dead.public_id}" in out and out.strip().endswith("would requeue 1 dead run(s); 0 left dead")
    assert snapshot() == before
    out = run("requeue_dead", "--job", job.public_id, "--since", ago(hours=3).isoformat())
    assert out.strip().endswith("requeued 1 dead run(s); 0 left dead")
    dead.refresh_from_db()
    assert dead.status == S.SCHEDULED
    after = snapshot()
    assert run("requeue_dead", "--job", job.public_id, "--since", ago(hours=3).isoformat()).strip() == (
        "requeued 0 dead run(s); 0 left dead"
    )
    assert snapshot() == after


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--job", "job_999999"], "no job 'job_999999'"),
        (["--since", "yesterday"], "--since 'yesterday' is not"),
        (["--target", "https://x/"], "--target: 'https://x/' is not a host"),
        (["--since", "2026-01-02T00:00:00Z", "--until", "2026-01-01T00:00:00Z"], "--until must be after --since"),
    ],
)
def test_requeue_dead_refuses_bad_input_in_one_line(args: list[str], words: str) -> None:
    with pytest.raises(CommandError, match=words):
        run("requeue_dead", *args)


# ---- pause_target / resume_target


def test_pause_and_resume_target_dry_runs_change_nothing_and_second_runs_change_nothing(owner: Any) -> None:
    job = new_job(owner)
    before = snapshot()
    assert run("pause_target", "reports.internal", "--dry-run").strip() == (
        "reports.internal would pause: 1 waiting run(s) of 1 job(s)"
    )
    assert snapshot() == before
    assert (
        run("pause_target", "reports.internal").strip() == "reports.internal paused: held 1 waiting run(s) of 1 job(s)"
    )
    assert Run.objects.get(job=job).held
    paused = snapshot()
    assert "was already paused: held 0" in run("pause_target", "reports.internal")
    assert snapshot() == paused
    assert "would resume: 1 held run(s)" in run("resume_target", "reports.internal", "--dry-run")
    assert snapshot() == paused
    assert run("resume_target", "reports.internal").strip() == (
        "reports.internal resumed: released 1 held run(s) of 1 job(s)"
    )
    resumed = snapshot()
    assert "was not paused: released 0" in run("resume_target", "reports.internal")
    assert snapshot() == resumed and not Run.objects.get(job=job).held


def test_pause_target_on_a_host_no_job_calls_is_refused_as_a_likely_typo(owner: Any) -> None:
    new_job(owner)
    before = snapshot()
    with pytest.raises(CommandError) as refused:
        run("pause_target", "reprots.internal")
    assert str(refused.value) == (
        "no job calls reprots.internal (the host as written in target URLs, port included); "
        "check the spelling, or pass --force to pause it before any job uses it"
    )
    assert snapshot() == before


def test_pause_target_with_force_pauses_a_host_before_any_job_calls_it(owner: Any) -> None:
    assert run("pause_target", "later.internal", "--force").strip() == (
        "later.internal paused: held 0 waiting run(s) of 0 job(s)"
    )
    assert PausedTarget.objects.filter(host="later.internal").exists()
    job = new_job(owner, target="https://later.internal/x")
    assert Run.objects.get(job=job).held


@pytest.mark.parametrize("command", ["pause_target", "resume_target"])
@pytest.mark.parametrize("host", ["", "https://reports.internal/x"])
def test_target_commands_refuse_a_url_or_nothing(command: str, host: str) -> None:
    with pytest.raises(CommandError, match="host"):
        run(command, host)


# ---- prune_runs


def test_prune_runs_dry_run_counts_and_changes_nothing_and_a_second_run_deletes_nothing(owner: Any) -> None:
    job = new_job(owner)
    dead_run(job, ago(days=100), finished=ago(days=100))
    make_run(job, ago(days=200), status=S.SCHEDULED, is_backfill=True)  # open: never pruned
    before = snapshot()
    assert run("prune_runs", "--older-than", "90d", "--dry-run").startswith(
        "would delete 1 finished run(s) and 1 event(s)"
    )
    assert snapshot() == before
    assert run("prune_runs", "--older-than", "90d").startswith("deleted 1 finished run(s) and 1 event(s)")
    after = snapshot()
    assert run("prune_runs", "--older-than", "90d").startswith("deleted 0 finished run(s)")
    assert snapshot() == after and Run.objects.filter(status=S.SCHEDULED).count() == 2


def test_prune_runs_says_a_zero_age_once_in_plain_words() -> None:
    with pytest.raises(CommandError) as refused:
        run("prune_runs", "--older-than", "0s")
    assert str(refused.value) == "--older-than must be more than 0s, not '0s'; give an age like 90d"


@pytest.mark.parametrize("value", ["ninety days", "0s", "-5d"])
def test_prune_runs_refuses_a_bad_age(value: str) -> None:
    with pytest.raises(CommandError, match="--older-than"):
        run("prune_runs", "--older-than", value)


# ---- backfill


def test_backfill_dry_run_changes_nothing_and_a_second_run_creates_nothing(owner: Any) -> None:
    job = created_long_ago(new_job(owner, schedule="0 * * * *", timezone="UTC"))
    hour = ago().replace(minute=0, second=0)
    since, until = (hour - timedelta(hours=30)).isoformat(), (hour - timedelta(hours=2)).isoformat()
    before = snapshot()
    out = run("backfill", job.public_id, "--since", since, "--until", until, "--dry-run")
    assert "would create 28 runs from" in out and snapshot() == before
    assert "created 28 runs" in run("backfill", job.public_id, "--since", since, "--until", until)
    after = snapshot()
    assert "created 0 runs; 28 times already had a run" in run(
        "backfill", job.public_id, "--since", since, "--until", until
    )
    assert snapshot() == after


def test_backfill_shows_a_progress_bar_on_stderr_only_for_large_ranges(owner: Any) -> None:
    job = created_long_ago(new_job(owner, schedule="* * * * *", timezone="UTC"))
    err = StringIO()
    call_command(
        "backfill",
        job.public_id,
        "--since",
        ago(hours=20).isoformat(),
        "--until",
        ago(hours=10).isoformat(),
        stdout=StringIO(),
        stderr=err,
    )
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("[") and lines[-1] == f"[{'#' * 30}] 600/600 runs"
    small = StringIO()
    call_command(
        "backfill",
        job.public_id,
        "--since",
        ago(hours=5).isoformat(),
        "--until",
        ago(hours=4).isoformat(),
        stdout=StringIO(),
        stderr=small,
    )
    assert small.getvalue() == ""


# ---- the exit code, from a real process


def manage(*args: str) -> subprocess.CompletedProcess[str]:
    db = connection.settings_dict
    env = dict(os.environ)
    if connection.vendor == "postgresql":
        env["DATABASE_URL"] = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["requeue_dead", "--since", "yesterday"], "--since 'yesterday' is not an ISO 8601 time"),
        (["pause_target", "https://reports.internal/x"], "is not a host"),
        (["resume_target", " "], "HOST is empty"),
        (["prune_runs", "--older-than", "soon"], "--older-than: 'soon' is not a duration"),
        (["backfill", "job_999999", "--since", "2026-01-01T00:00:00Z", "--until", "later"], "no job 'job_999999'"),
    ],
)
def test_each_command_exits_non_zero_with_one_line_and_no_traceback(args: list[str], words: str) -> None:
    if connection.vendor != "postgresql" and args[0] == "backfill":
        pytest.skip("finding the job needs the test database, which SQLite keeps in this process's memory")
    done = manage(*args)
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("CommandError: ") and words in lines[0], done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
