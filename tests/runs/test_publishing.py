"""Celery task targets in the worker: after the claim, a run publishes one Celery
message (protocol 2) to SCHEDULER_TASK_BROKER_URL instead of calling a URL."""
from __future__ import annotations

import base64
import json
import socket
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.core.management import call_command
from django.test import override_settings
from django.utils import timezone

from jobs.models import Job
from jobs.services import job_create, service_tasks_grant
from runs import ops
from runs.models import Run
from runs.services import run_execute, run_execute_many
from tests.factories import make_job, timeline_of, timeline_types, entry

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status


def redis_broker() -> str:
    url = settings.CELERY_BROKER_URL
    if not url.startswith("redis://"):
        pytest.skip("needs the production layout's Redis broker")
    return url


@pytest.fixture
def queue() -> str:
    return f"tasks-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def granted(service: Any) -> Any:
    service_tasks_grant(name=service.user.username, prefixes=["reports."])
    return service.user


def task_job(owner: Any, queue: str, **fields: Any) -> Job:
    values: dict[str, Any] = {
        "name": "t", "schedule": "*/5 * * * *", "task": "reports.tasks.rebuild", "queue": queue,
        "args": [7, "full"], "kwargs": {"dry_run": False}, "retry_base_seconds": 1,
    }
    values.update(fields)
    return job_create(owner=owner, fields=values)


def queue_now(job: Job) -> Run:
    run = Run.objects.get(job=job, status=S.SCHEDULED, is_backfill=False)
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED, queued_at=timezone.now(), due_at=timezone.now())
    run.refresh_from_db()
    return run


def types(run: Run) -> list[str]:
    return timeline_types(run)


def messages(url: str, queue: str) -> list[dict[str, Any]]:
    """The Celery messages waiting on a Redis queue, as kombu's Redis transport stores them."""
    client = redis.Redis.from_url(url)
    try:
        return [json.loads(raw) for raw in client.lrange(queue, 0, -1)]
    finally:
        client.delete(queue)
        client.close()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_a_task_jobs_run_publishes_one_celery_message_with_the_run_headers(granted: Any, queue: str) -> None:
    url = redis_broker()
    job = task_job(granted, queue)
    run = queue_now(job)
    with override_settings(SCHEDULER_TASK_BROKER_URL=url):
        assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED and run.fence == 1 and run.attempt == 1
    assert types(run) == ["scheduled", "claimed", "published", "succeeded"]
    [message] = messages(url, queue)
    headers = message["headers"]
    assert headers["task"] == "reports.tasks.rebuild" and headers["lang"] == "py"  # Celery protocol 2
    assert headers["idempotency_key"] == run.idempotency_key == f"{job.public_id}@{run.scheduled_for:%Y-%m-%dT%H:%M:%SZ}"
    assert (headers["fence_token"], headers["attempt"], headers["run_id"]) == (1, 1, run.public_id)
    assert headers["scheduled_for"] == f"{run.scheduled_for:%Y-%m-%dT%H:%M:%SZ}"
    args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    assert (args, kwargs) == ([7, "full"], {"dry_run": False})
    published = entry(run, "published").detail
    assert published["queue"] == queue and published["task_id"] == headers["id"]
    assert published["broker"] == url and published["fence"] == 1
    assert Run.objects.filter(job=job, status=S.SCHEDULED).count() == 1  # the next run


def test_the_published_event_shows_the_broker_without_its_password(granted: Any, queue: str) -> None:
    # This Redis has no password; redis-py goes on when the server says AUTH is not needed.
    url = redis_broker().replace("redis://", "redis://:hunter2@")
    job = task_job(granted, queue, retry_max=0)
    run = queue_now(job)
    with override_settings(SCHEDULER_TASK_BROKER_URL=url):
        run_execute(run_id=run.pk, worker="w1")
    run.refresh_from_db()
    assert run.status == S.SUCCEEDED
    assert entry(run, "published").detail["broker"] == url.replace(":hunter2@", ":**@")
    text = json.dumps([e.detail for e in timeline_of(run)]) + run.last_error
    assert "hunter2" not in text
    messages(redis_broker(), queue)


def test_a_broker_that_refuses_the_publish_is_retried_then_dead(granted: Any, queue: str) -> None:
    job = task_job(granted, queue, retry_max=1)
    run = queue_now(job)
    url = f"redis://127.0.0.1:{closed_port()}/0"
    with override_settings(SCHEDULER_TASK_BROKER_URL=url):
        assert run_execute(run_id=run.pk, worker="w1") == "retry_scheduled"
        run.refresh_from_db()
        assert "connection refused" in run.last_error and url.split("//")[1] in run.last_error
        Run.objects.filter(pk=run.pk).update(status=S.QUEUED, due_at=timezone.now())
        assert run_execute(run_id=run.pk, worker="w1") == "dead"
    run.refresh_from_db()
    assert run.status == S.DEAD and run.attempt == 2
    dead = entry(run, "dead").detail["reason"]
    assert dead.startswith("out of tries after 2 attempts: publish to") and "connection refused" in dead
    assert "published" not in types(run)


def test_a_run_whose_task_grant_was_revoked_ends_dead_unpublished(granted: Any, queue: str) -> None:
    url = redis_broker()
    job = task_job(granted, queue)
    run = queue_now(job)
    call_command("grant_tasks", granted.username, "--revoke", "reports.", stdout=open("/dev/null", "w"))
    with override_settings(SCHEDULER_TASK_BROKER_URL=url):
        assert run_execute(run_id=run.pk, worker="w1") == "dead"
    run.refresh_from_db()
    assert run.status == S.DEAD and run.attempt == 1
    assert run.last_error.startswith("task refused: 'reports.tasks.rebuild' is not granted to reports")
    assert messages(url, queue) == []


def test_in_a_batch_one_runs_refusal_costs_that_run_only(granted: Any, queue: str, other_service: Any) -> None:
    url = redis_broker()
    service_tasks_grant(name="billing", prefixes=["billing."])
    kept = task_job(granted, queue)
    revoked = task_job(other_service.user, queue, task="billing.tasks.sync")
    service_tasks_grant(name="billing", prefixes=["billing."], revoke=True)
    runs = [queue_now(kept), queue_now(revoked)]
    with override_settings(SCHEDULER_TASK_BROKER_URL=url):
        outcomes = run_execute_many(run_ids=[r.pk for r in runs], worker="w1")
    assert outcomes == {runs[0].pk: "succeeded", runs[1].pk: "dead"}
    assert [m["headers"]["task"] for m in messages(url, queue)] == ["reports.tasks.rebuild"]


def test_pause_target_celery_queue_holds_a_task_jobs_runs_and_resume_releases_them(granted: Any, queue: str) -> None:
    job = task_job(granted, queue)
    url_job = make_job(owner=granted, target="http://127.0.0.1:9/hook")
    other = task_job(granted, f"{queue}-other")
    result = ops.target_pause(host=f"celery:{queue}")
    assert result.host == f"celery:{queue}" and result.jobs == 1 and result.runs == 1
    assert Run.objects.get(job=job).held is True
    assert Run.objects.get(job=other).held is False
    assert not Run.objects.filter(job=url_job, held=True).exists()
    # A run made while the queue is paused is made held too (runs.nextrun.is_held).
    from runs.nextrun import is_held

    assert is_held(Job.objects.get(pk=job.pk)) and not is_held(Job.objects.get(pk=other.pk))
    released = ops.target_resume(host=f"celery:{queue}")
    assert released.runs == 1 and Run.objects.get(job=job).held is False


def test_pause_target_command_takes_a_celery_key_and_refuses_a_bad_queue(granted: Any, queue: str) -> None:
    job = task_job(granted, queue)
    call_command("pause_target", f"celery:{queue}", stdout=open("/dev/null", "w"))
    assert Run.objects.get(job=job).held is True
    from django.core.management import CommandError

    with pytest.raises(CommandError, match="is not a queue name"):
        call_command("pause_target", "celery:bad queue", stdout=open("/dev/null", "w"))
    call_command("resume_target", f"celery:{queue}", stdout=open("/dev/null", "w"))
    assert Run.objects.get(job=job).held is False


@pytest.mark.embedded
def test_the_embedded_file_system_broker_can_carry_task_targets(granted: Any, queue: str, tmp_path: Path) -> None:
    folder = tmp_path / "broker"
    folder.mkdir()
    options = {"data_folder_in": str(folder), "data_folder_out": str(folder), "store_processed": False}
    job = task_job(granted, queue)
    run = queue_now(job)
    with override_settings(SCHEDULER_TASK_BROKER_URL="filesystem://", SCHEDULER_TASK_BROKER_TRANSPORT_OPTIONS=options):
        assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    [path] = [p for p in folder.iterdir() if p.name.endswith(f".{queue}.msg")]
    headers = json.loads(path.read_text())["headers"]
    assert headers["task"] == "reports.tasks.rebuild" and headers["idempotency_key"] == run.idempotency_key


@pytest.fixture
def rabbitmq_vhost() -> Any:
    """A vhost of this test's own on the machine's RabbitMQ (docs: RECIPES), removed after."""
    import shutil
    import subprocess

    if shutil.which("rabbitmqctl") is None:
        pytest.skip("RabbitMQ is not installed")
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
    except OSError:
        pytest.skip("RabbitMQ is not running on 127.0.0.1:5672")
    vhost = f"sched-tasks-{uuid.uuid4().hex[:8]}"

    def ctl(*args: str) -> None:
        subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)

    ctl("add_vhost", vhost)
    try:
        ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
        yield f"amqp://guest:guest@127.0.0.1:5672/{vhost}"
    finally:
        ctl("delete_vhost", vhost)


def test_on_amqp_the_run_succeeds_on_the_brokers_confirm_and_the_message_waits_on_its_queue(
    granted: Any, queue: str, rabbitmq_vhost: str
) -> None:
    from kombu import Connection

    from runs.publishing import _transport_options

    assert _transport_options(rabbitmq_vhost, 5)["confirm_publish"] is True
    job = task_job(granted, queue)
    run = queue_now(job)
    with override_settings(SCHEDULER_TASK_BROKER_URL=rabbitmq_vhost):
        assert run_execute(run_id=run.pk, worker="w1") == "succeeded"
    # Declared by the publish (as `celery worker -Q <queue>` would): it waits for a consumer.
    with Connection(rabbitmq_vhost) as conn:
        message = conn.SimpleQueue(queue).get(timeout=5)
        headers = message.headers
        message.ack()
    assert headers["task"] == "reports.tasks.rebuild" and headers["idempotency_key"] == run.idempotency_key
    assert headers["fence_token"] == 1
    assert entry(run, "published").detail["broker"] == rabbitmq_vhost.replace(":guest@", ":**@")


def test_requeue_dead_takes_a_celery_key_for_task_jobs(granted: Any, queue: str) -> None:
    job = task_job(granted, queue)
    url_job = make_job(owner=granted, target="http://127.0.0.1:9/hook")
    dead = [queue_now(job), Run.objects.create(job=url_job, scheduled_for=timezone.now(), due_at=timezone.now(),
                                               partition=url_job.partition)]
    Run.objects.filter(pk__in=[r.pk for r in dead]).update(status=S.DEAD, finished_at=timezone.now())
    assert list(ops.dead_runs(host=ops.check_host(f"celery:{queue}"))) == [dead[0]]


def test_runs_the_broker_accepted_do_not_open_the_queues_breaker(granted: Any, queue: str) -> None:
    """A publish has no HTTP status; it once counted as trouble, so five accepted
    publishes in a row opened celery:<queue>'s breaker and held every run after
    (found by bench/run.py beat's task leg)."""
    from runs.models import TargetBreaker

    url = redis_broker()
    jobs = [task_job(granted, queue, name=f"t{i}") for i in range(7)]
    with override_settings(SCHEDULER_TASK_BROKER_URL=url):
        outcomes = [run_execute(run_id=queue_now(job).pk, worker="w1") for job in jobs]
    assert outcomes == ["succeeded"] * 7
    assert len(messages(url, queue)) == 7
    assert not TargetBreaker.objects.filter(host=f"celery:{queue}").exclude(state=TargetBreaker.State.CLOSED).exists()


@pytest.mark.parametrize("reserved", ["unacked_index", "runs"])
def test_a_job_stored_with_a_reserved_queue_ends_dead_and_publishes_nothing(granted: Any, reserved: str) -> None:
    """A job written before its queue's name was refused (or straight to the table):
    its run names the refusal and the broker key is left as it was. On 75cfded the
    publish to `unacked_index` turned kombu's sorted set into a list."""
    url = redis_broker()
    job = task_job(granted, "reports")
    Job.objects.filter(pk=job.pk).update(queue=reserved)
    run = queue_now(job)
    client = redis.Redis.from_url(url)
    key = f"{reserved}-publish-test-{uuid.uuid4().hex[:6]}"
    try:
        with override_settings(SCHEDULER_TASK_BROKER_URL=url, CELERY_TASK_DEFAULT_QUEUE=key if reserved == "runs" else "runs"):
            if reserved == "runs":
                Job.objects.filter(pk=job.pk).update(queue=key)
            kind_before = client.type(key if reserved == "runs" else reserved)
            assert run_execute(run_id=run.pk, worker="w1") == "dead"
            assert client.type(key if reserved == "runs" else reserved) == kind_before
    finally:
        client.delete(key)
        client.close()
    run.refresh_from_db()
    assert run.status == S.DEAD and run.last_error.startswith("queue refused: ")
    assert "published" not in types(run)
