"""Celery task targets end to end (issue "A Celery platform", done-when 2), with real
processes: a scanner and scheduler workers (Redis, ZooKeeper, PostgreSQL), the API on
a live server, and a second, separate Celery app and worker (tests/celery_target_app.py)
with its own SQLite database, consuming the tasks broker on a queue of its own."""
from __future__ import annotations

import json
import sqlite3
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from bench.harness import Proc
from jobs.services import service_tasks_grant
from runs.models import Run
from tests.integration.conftest import Api, Stack, wait_for
from tests.factories import timeline_types, entry

pytestmark = [pytest.mark.integration, pytest.mark.zookeeper]
S = Run.Status
TASK = "integration.tasks.record"


class TargetTeam:
    """The target team's Celery worker (its own process) and what it has seen."""

    def __init__(self, stack: Stack, tmp_path: Path, broker: str, queue: str) -> None:
        self.db = tmp_path / "target-team.sqlite3"
        self.log = tmp_path / "target-team.jsonl"
        self.log.touch()
        env = {k: v for k, v in stack.env.items() if k not in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL")}
        env.update(CELERY_BROKER_URL=broker, TARGET_APP_DB=str(self.db), TARGET_APP_LOG=str(self.log))
        argv = [
            sys.executable, "-m", "celery", "-A", "tests.celery_target_app", "worker", "-l", "INFO", "-P", "solo",
            "-Q", queue, "-n", f"target-{queue}@%h", "--without-heartbeat", "--without-gossip", "--without-mingle",
        ]
        self.proc = Proc("target-team", argv, env, tmp_path)
        stack.procs.append(self.proc)  # ended with the stack, by its own process group

    def entries(self, kind: str) -> list[dict[str, Any]]:
        lines = self.log.read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["kind"] == kind]

    def rows(self, query: str) -> list[tuple[Any, ...]]:
        if not self.db.exists():
            return []
        with sqlite3.connect(self.db) as db:
            return db.execute(query).fetchall()

    def effects(self) -> list[str]:
        return [name for (name,) in self.rows("SELECT name FROM auth_group ORDER BY id")]


def run_of(job: dict[str, Any]) -> Run | None:
    return Run.objects.filter(job_id=int(job["id"].split("_")[1])).order_by("scheduled_for").first()


def ended(job: dict[str, Any], status: str) -> Run | None:
    run = run_of(job)
    return run if run is not None and run.status == status else None


def event_types(run: Run) -> list[str]:
    return timeline_types(run)


@pytest.fixture
def tasks_broker() -> str:
    url = settings.CELERY_BROKER_URL
    if not url.startswith("redis://"):
        pytest.skip("needs the production layout's Redis")
    return url


@pytest.fixture
def queue() -> str:
    return f"team-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def granted(api: Api) -> None:
    service_tasks_grant(name="integration", prefixes=["integration."])


def test_a_task_job_runs_its_task_once_per_run_and_the_task_sees_the_run_headers(
    stack: Stack, api: Api, granted: None, tasks_broker: str, queue: str, tmp_path: Path
) -> None:
    stack.env["SCHEDULER_TASK_BROKER_URL"] = tasks_broker
    stack.scanner("scanner-a")
    stack.worker("worker-a")
    team = TargetTeam(stack, tmp_path, tasks_broker, queue)
    jobs = [
        api.create_job(name=f"task-{n}", delay="1s", task=TASK, args=[f"label-{n}"], kwargs={"n": n}, queue=queue)
        for n in (1, 2)
    ]
    runs = [wait_for(lambda j=j: ended(j, S.SUCCEEDED), 60, what=f"{j['name']} to succeed") for j in jobs]
    wait_for(lambda: len(team.entries("applied")) == 2, 60, what="the target team's worker to apply both runs")

    delivered = team.entries("delivered")
    assert len(delivered) == 2  # once per run
    by_key = {e["attributes"]["idempotency_key"]: e for e in delivered}
    for n, run in zip((1, 2), runs):
        seen = by_key[run.idempotency_key]
        want = {
            "idempotency_key": run.idempotency_key, "fence_token": 1, "run_id": run.public_id, "attempt": 1,
            "scheduled_for": run.scheduled_for.strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        assert seen["attributes"] == want  # self.request.<name>
        assert seen["got"] == want  # self.request.get(name)
        assert (seen["task"], seen["args"], seen["kwargs"]) == (TASK, [f"label-{n}"], {"n": n})
        types = event_types(run)
        assert types == ["scheduled", "queued", "claimed", "published", "succeeded"]
        published = entry(run, "published").detail
        assert published["queue"] == queue and published["broker"] == tasks_broker
    assert sorted(team.effects()) == sorted(f"label-{n}|{r.idempotency_key}|1" for n, r in zip((1, 2), runs))


def test_a_worker_killed_after_publishing_is_recovered_and_the_task_applies_once(
    stack: Stack, api: Api, granted: None, tasks_broker: str, queue: str, tmp_path: Path
) -> None:
    stack.env.update(SCHEDULER_TASK_BROKER_URL=tasks_broker, SCHEDULER_LEASE_SECONDS="3")
    stack.scanner("scanner-a")
    team = TargetTeam(stack, tmp_path, tasks_broker, queue)
    # The doomed worker hangs between the broker's acceptance and its outcome's write
    # (runs.publishing's test-only seam), and is killed there.
    seam = dict(stack.env, SCHEDULER_TESTING="1", SCHEDULER_TEST_HANG_AFTER_PUBLISH="60")
    doomed = Proc("doomed", stack.worker_argv("doomed", 1), seam, tmp_path)
    stack.procs.append(doomed)
    job = api.create_job(name="once", delay="1s", task=TASK, args=["once"], queue=queue)
    wait_for(lambda: team.entries("applied"), 60, what="the first delivery to be applied")
    run = run_of(job)
    assert run is not None and run.status == S.RUNNING and run.fence == 1  # published, not yet recorded
    doomed.kill()
    stack.worker("rescuer")
    run = wait_for(lambda: ended(job, S.SUCCEEDED), 60, what="the run to succeed after the kill")
    wait_for(lambda: len(team.entries("delivered")) == 2, 30, what="the second delivery")

    fences = [e["attributes"]["fence_token"] for e in team.entries("delivered")]
    assert fences == [1, 2] and run.fence == 2  # delivered twice, by two lease holders
    assert team.effects() == [f"once|{run.idempotency_key}|1"]  # applied once
    assert team.rows("SELECT key, calls, highest_fence, applied FROM receiver_deliveries") == [
        (run.idempotency_key, 2, 2, 1)
    ]
    types = event_types(run)
    assert types.count("claimed") == 2 and "lease_expired" in types and types.count("published") == 1
    assert types[-1] == "succeeded"


def test_a_broker_that_refuses_the_publish_leads_to_retries_then_the_dead_list(
    stack: Stack, api: Api, granted: None, queue: str
) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once closed
    stack.env["SCHEDULER_TASK_BROKER_URL"] = f"redis://:secret-pw@127.0.0.1:{port}/0"
    stack.scanner("scanner-a")
    stack.worker("worker-a")
    job = api.create_job(name="refused", delay="1s", task=TASK, queue=queue, retry={"max": 2, "base": "1s", "cap": "1s"})
    run = wait_for(lambda: ended(job, S.DEAD), 90, what="the run to be dead")
    assert run.attempt == 3
    detail = api.get(f"/api/runs/{run.public_id}/")
    types = [e["type"] for e in detail["events"]]
    assert types.count("retry_scheduled") == 2 and types.count("claimed") == 3 and "published" not in types
    answers = [e["detail"] for e in detail["events"] if e["type"] == "target_answered"]
    assert len(answers) == 3 and all("connection refused" in a["error"] for a in answers)
    reason = detail["events"][-1]["detail"]["reason"]
    assert detail["events"][-1]["type"] == "dead" and "out of tries after 3 attempts" in reason
    assert f"127.0.0.1:{port}" in reason and "secret-pw" not in json.dumps(detail)
    assert run.public_id in {r["id"] for r in api.get("/api/runs/", status="dead")["results"]}
