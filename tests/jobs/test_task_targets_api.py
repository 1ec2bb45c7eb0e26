"""Celery task targets through the API and the admin's commands (docs/reference.md, the API fields: task)."""
from __future__ import annotations

from typing import Any

import pytest
from django.core.management import CommandError, call_command

from jobs.models import Job, ServiceAccount
from jobs.validators import task_name_granted
from tests.conftest import Service
from tests.jobs.conftest import row_counts

pytestmark = pytest.mark.embedded

JOBS = "/api/jobs/"


def task_job(**fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"name": "sync", "schedule": "*/5 * * * *", "task": "reports.tasks.rebuild"}
    body.update(fields)
    return body


def grant(service: Service, *prefixes: str) -> None:
    call_command("grant_tasks", service.user.username, *prefixes, stdout=_Sink())


class _Sink:
    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> None:
        self.text += text


def test_a_task_job_is_created_with_its_args_kwargs_and_queue(service: Service) -> None:
    grant(service, "reports.")
    response = service.post(JOBS, task_job(args=[1, "a"], kwargs={"full": True}, queue="reports"))
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["task"] == "reports.tasks.rebuild"
    assert (body["args"], body["kwargs"], body["queue"]) == ([1, "a"], {"full": True}, "reports")
    assert body["target"] is None and body["method"] is None and body["payload"] is None
    job = Job.objects.get()
    assert (job.task, job.target, job.args, job.kwargs, job.queue) == (
        "reports.tasks.rebuild", "", [1, "a"], {"full": True}, "reports"
    )
    assert job.runs.count() == 1


def test_a_task_jobs_queue_defaults_to_celery_and_its_args_to_empty(service: Service) -> None:
    grant(service, "reports.")
    body = service.post(JOBS, task_job()).json()
    assert (body["args"], body["kwargs"], body["queue"]) == ([], {}, "celery")


def test_a_url_job_shows_no_task_fields(service: Service) -> None:
    body = service.post(JOBS, {"schedule": "* * * * *", "target": "https://r.internal/x"}).json()
    assert (body["task"], body["args"], body["kwargs"], body["queue"]) == (None, None, None, None)


def test_both_target_and_task_is_a_400_naming_both_and_writes_nothing(service: Service) -> None:
    grant(service, "reports.")
    before = row_counts()
    response = service.post(JOBS, task_job(target="https://r.internal/x"))
    assert response.status_code == 400
    errors = response.json()
    assert set(errors) == {"target", "task"}
    assert "only one of target" in errors["task"][0]
    assert row_counts() == before


def test_neither_target_nor_task_is_a_400_naming_both(service: Service) -> None:
    response = service.post(JOBS, {"schedule": "* * * * *"})
    assert response.status_code == 400
    assert set(response.json()) == {"target", "task"}
    assert Job.objects.count() == 0


def test_a_task_another_service_was_granted_is_a_400_naming_task(service: Service, other_service: Service) -> None:
    grant(service, "reports.")
    grant(other_service, "billing.")
    response = service.post(JOBS, task_job(task="billing.tasks.sync"))
    assert response.status_code == 400
    assert list(response.json()) == ["task"]
    assert "not under a task prefix granted to reports" in response.json()["task"][0]
    assert Job.objects.count() == 0


def test_a_service_with_no_grant_may_name_no_task(service: Service) -> None:
    response = service.post(JOBS, task_job())
    assert response.status_code == 400
    assert "may name no Celery task" in response.json()["task"][0]


@pytest.mark.parametrize(
    ("name", "prefixes", "granted"),
    [
        ("billing.tasks.sync", ["billing."], True),
        ("billingx.run", ["billing."], False),
        ("billing", ["billing."], False),
        ("billing", ["billing"], True),
        ("billing.sync", ["billing"], True),
        ("billingx.sync", ["billing"], False),
        ("billing.tasks.sync", ["billing.tasks"], True),
        ("billing.tasksx", ["billing.tasks"], False),
        ("other.run", ["billing.", "other."], True),
    ],
)
def test_task_prefixes_match_on_dot_boundaries(name: str, prefixes: list[str], granted: bool) -> None:
    assert task_name_granted(name, prefixes) is granted


def test_a_prefix_without_a_dot_grants_the_name_itself_through_the_api(service: Service) -> None:
    grant(service, "reports")
    assert service.post(JOBS, task_job(task="reports")).status_code == 201
    assert service.post(JOBS, task_job(task="reportsx.run")).status_code == 400


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("task", "reports.tasks.", "is not a Celery task name"),
        ("task", "reports tasks", "is not a Celery task name"),
        ("task", "1reports.x", "is not a Celery task name"),
        ("task", "reports." + "x" * 200, "at most 200 characters"),
        ("queue", "", "must not be empty"),
        ("queue", "a b", "is not a queue name"),
        ("queue", "-x", "is not a queue name"),
        ("args", {"a": 1}, "must be a list"),
        ("kwargs", [1], "must be an object"),
        ("method", "GET", "applies to a URL target only"),
        ("headers", {"X-A": "b"}, "applies to a URL target only"),
        ("payload", {"a": 1}, "applies to a URL target only"),
    ],
)
def test_a_bad_task_field_is_a_400_naming_it(service: Service, field: str, value: Any, words: str) -> None:
    grant(service, "reports.")
    response = service.post(JOBS, task_job(**{field: value}))
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert words in " ".join(response.json()[field])
    assert Job.objects.count() == 0


def test_task_fields_on_a_url_job_are_a_400_naming_them(service: Service) -> None:
    body = {"schedule": "* * * * *", "target": "https://r.internal/x", "args": [1], "queue": "q"}
    response = service.post(JOBS, body)
    assert response.status_code == 400
    assert set(response.json()) == {"args", "queue"}


def test_args_over_256_kib_are_a_400_naming_args(service: Service) -> None:
    grant(service, "reports.")
    response = service.post(JOBS, task_job(args=["x" * (256 * 1024)]))
    assert response.status_code == 400
    assert "the limit is 262144 bytes" in response.json()["args"][0]


def test_a_task_job_read_back_can_be_sent_again(service: Service) -> None:
    grant(service, "reports.")
    body = service.post(JOBS, task_job(kwargs={"a": 1})).json()
    again = {k: v for k, v in body.items() if k not in {"id", "state", "next_run", "created_at", "updated_at", "defined_in"}}
    response = service.patch(f"{JOBS}{body['id']}/", again)
    assert response.status_code == 200, response.content


def test_patching_the_task_checks_the_grant_again(service: Service) -> None:
    grant(service, "reports.")
    job = service.post(JOBS, task_job()).json()
    response = service.patch(f"{JOBS}{job['id']}/", {"task": "billing.tasks.sync"})
    assert response.status_code == 400
    assert list(response.json()) == ["task"]
    assert Job.objects.get().task == "reports.tasks.rebuild"


def test_patching_a_url_job_to_a_task_clears_its_http_fields(service: Service) -> None:
    grant(service, "reports.")
    created = service.post(
        JOBS, {"schedule": "* * * * *", "target": "https://r.internal/x", "headers": {"Authorization": "s"},
               "payload": {"a": 1}}
    ).json()
    response = service.patch(f"{JOBS}{created['id']}/", {"task": "reports.tasks.rebuild", "queue": "r"})
    assert response.status_code == 200, response.content
    job = Job.objects.get()
    assert (job.target, job.task, job.queue, job.payload, job.headers, job.secret_headers) == (
        "", "reports.tasks.rebuild", "r", None, {}, job.secret_headers
    )
    assert response.json()["headers"] == {}
    back = service.patch(f"{JOBS}{created['id']}/", {"target": "https://r.internal/y"})
    assert back.status_code == 200, back.content
    job.refresh_from_db()
    assert (job.target, job.task, job.args, job.kwargs) == ("https://r.internal/y", "", [], {})


def test_staff_may_name_any_task_for_a_job_they_own(staff_client: Any) -> None:
    response = staff_client.post(JOBS, task_job(task="anything.at.all"), format="json")
    assert response.status_code == 201, response.content


# --------------------------------------------------------------------------- grant_tasks


def test_grant_tasks_adds_prefixes_and_says_so(service: Service) -> None:
    out = _Sink()
    call_command("grant_tasks", "reports", "reports.", "shared.tasks", stdout=out)
    call_command("grant_tasks", "reports", "reports.", "more.", stdout=out)
    assert ServiceAccount.objects.get(user=service.user).task_prefixes == ["reports.", "shared.tasks", "more."]
    assert "reports: granted reports., shared.tasks" in out.text
    assert "reports., already granted" not in out.text and "reports. already granted" in out.text
    assert "may name tasks under: reports., shared.tasks, more." in out.text


def test_grant_tasks_revoke_removes_prefixes(service: Service) -> None:
    call_command("grant_tasks", "reports", "reports.", "shared.", stdout=_Sink())
    out = _Sink()
    call_command("grant_tasks", "reports", "--revoke", "reports.", stdout=out)
    assert ServiceAccount.objects.get(user=service.user).task_prefixes == ["shared."]
    assert "reports: revoked reports." in out.text


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["nobody", "x."], "there is no service account 'nobody'"),
        (["reports", "bad prefix"], "is not a task prefix"),
        (["reports", "a..b"], "is not a task prefix"),
    ],
)
def test_grant_tasks_refuses_bad_input_in_one_line(service: Service, args: list[str], words: str) -> None:
    with pytest.raises(CommandError, match=words):
        call_command("grant_tasks", *args, stdout=_Sink())
    assert ServiceAccount.objects.get(user=service.user).task_prefixes == []


@pytest.mark.parametrize("prefix", ["celery.", "celery", "runs.", "runs", "jobs.", "scanners.", "runs.tasks",
                                    "scheduler_project."])
def test_grant_tasks_refuses_a_prefix_that_covers_celerys_or_the_schedulers_own_tasks(
    service: Service, prefix: str
) -> None:
    """With `celery.` granted, a job {"task": "celery.starmap", "args": [{"task":
    "runs.keep_run_partitions", ...}]} made the scheduler's worker run its own upkeep."""
    with pytest.raises(CommandError, match="Celery's own tasks and the scheduler's are never granted"):
        call_command("grant_tasks", "reports", prefix, stdout=_Sink())
    assert ServiceAccount.objects.get(user=service.user).task_prefixes == []


@pytest.mark.parametrize("prefix", ["celeryapp.", "runsx.tasks", "c", "reports."])
def test_grant_tasks_takes_names_that_only_look_alike(service: Service, prefix: str) -> None:
    call_command("grant_tasks", "reports", prefix, stdout=_Sink())
    assert ServiceAccount.objects.get(user=service.user).task_prefixes == [prefix]


def test_a_grant_stored_before_the_refusal_names_no_reserved_task(service: Service) -> None:
    """A grant of `celery.` written before grant_tasks refused it: creating the job is a
    400 naming task, and a run of a job made then is refused at publishing (the worker
    asks the same question: jobs.selectors.task_refusal)."""
    from jobs.selectors import task_refusal

    ServiceAccount.objects.filter(user=service.user).update(task_prefixes=["celery."])
    response = service.client.post(JOBS, task_job(task="celery.starmap"), format="json")
    assert response.status_code == 400 and "task" in response.json(), response.json()
    assert "never granted to a service" in task_refusal(service.user, "celery.starmap")


@pytest.mark.parametrize("queue", ["runs", "RUNS", "celery", "celeryev", "celeryev.abc", "unacked", "unacked_index",
                                   "unacked_mutex", "_kombu.binding.celery", "celery.pidbox", "w1.reply.celery.pidbox",
                                   "amq.direct", "amq.gen-abc"])
def test_a_task_job_may_not_name_the_schedulers_queue_or_a_broker_key(service: Service, queue: str) -> None:
    """On 75cfded `queue: "unacked_index"` made the publish turn the Redis key kombu's
    worker keeps its unacked index in into a list: the scheduler's worker exited with
    WRONGTYPE, again after each restart. Refused: a 400 naming queue, nothing written."""
    grant(service, "reports.")
    before = row_counts()
    response = service.post(JOBS, task_job(queue=queue))
    assert response.status_code == 400, response.content
    assert list(response.json()) == ["queue"], response.json()
    assert "your service's own" in response.json()["queue"][0]
    assert row_counts() == before


def test_a_renamed_run_queue_is_refused_too(service: Service, settings: Any) -> None:
    settings.CELERY_TASK_DEFAULT_QUEUE = "sched-runs"
    grant(service, "reports.")
    assert service.post(JOBS, task_job(queue="sched-runs")).status_code == 400
    assert service.post(JOBS, task_job(queue="runsx", name="other")).status_code == 201


def test_a_job_on_the_default_queue_round_trips_its_celery(service: Service) -> None:
    """A job that left queue out reads back "celery"; a PATCH sending the body it read
    keeps it, while naming "celery" on a new job, or moving a job to it, is refused."""
    grant(service, "reports.")
    created = service.post(JOBS, task_job()).json()
    body = {k: v for k, v in created.items() if k in task_job() or k == "queue"}
    assert body["queue"] == "celery"
    response = service.patch(f"{JOBS}{created['id']}/", {**body, "name": "renamed"})
    assert response.status_code == 200, response.content
    moved = service.post(JOBS, task_job(name="second", queue="reports")).json()
    response = service.patch(f"{JOBS}{moved['id']}/", {"queue": "celery"})
    assert response.status_code == 400 and list(response.json()) == ["queue"]
    assert Job.objects.get(name="second").queue == "reports"
