"""Rows stored before today's rules are reported on upgrade: `manage.py check
--database default` (and `migrate`, which runs the database checks first) names the
task jobs on a refused queue, the grants covering Celery's or the scheduler's own
tasks, and the job names holding control characters (jobs/checks.py)."""
from __future__ import annotations

from io import StringIO

import pytest
from django.core.checks import run_checks
from django.core.management import call_command

from jobs.models import Job, ServiceAccount
from tests.factories import make_job

pytestmark = pytest.mark.embedded


def stored_warnings() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for message in run_checks(databases=["default"]):
        if message.id.startswith("jobs.W00"):
            found.setdefault(message.id, []).append(message.msg)
    return found


def test_a_clean_store_reports_nothing(service) -> None:
    make_job(service.user, task="reports.tasks.rebuild", target="", queue="celery")
    make_job(service.user, task="reports.tasks.rebuild", target="", queue="reports", name="own queue")
    assert stored_warnings() == {}


def test_rows_todays_rules_refuse_are_each_named_with_what_to_do(service) -> None:
    bad = [make_job(service.user, task="reports.tasks.rebuild", target="", name=f"q{i}") for i in range(7)]
    Job.objects.filter(pk__in=[j.pk for j in bad]).update(queue="unacked_index")
    make_job(service.user, task="reports.tasks.rebuild", target="", queue="runs", name="on the run queue")
    gone = make_job(service.user, task="reports.tasks.rebuild", target="", queue="celeryev", name="deleted")
    Job.objects.filter(pk=gone.pk).update(state=Job.State.DELETED)
    ServiceAccount.objects.filter(user=service.user).update(task_prefixes=["reports.", "celery."])
    escaped = make_job(service.user, name="build \x1b[2Jreport")

    found = stored_warnings()
    assert sorted(found) == ["jobs.W001", "jobs.W002", "jobs.W003"], found
    queues = " ".join(found["jobs.W001"])
    assert "7 task job(s) publish to the queue 'unacked_index'" in queues and "and 2 more" in queues
    assert "1 task job(s) publish to the queue 'runs'" in queues and "queue 'celeryev'" not in queues
    [grant] = found["jobs.W002"]
    assert "'reports' holds the grant 'celery.'" in grant
    [names] = found["jobs.W003"]
    assert names.startswith("1 job name(s) hold control characters") and f"job_{escaped.pk}" in names

    err = StringIO()
    call_command("check", "--database", "default", stdout=StringIO(), stderr=err)
    assert "jobs.W001" in err.getvalue() and "grant_tasks reports --revoke celery." in err.getvalue()
