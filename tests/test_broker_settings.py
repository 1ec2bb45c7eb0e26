"""The run queue's broker settings, as a fresh process reads them from its
environment: on AMQP publisher confirms are on and the bulkhead's slots are rows
in the database; on Redis neither (the slots live in Redis)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import json; from scheduler_project.celery import app; from django.conf import settings; "
    "print(json.dumps({'options': app.conf.broker_transport_options or {}, 'bulkhead': settings.SCHEDULER_BULKHEAD, "
    "'acks_late': app.conf.task_acks_late, "
    "'cancel': app.conf.worker_cancel_long_running_tasks_on_connection_loss}))"
)


def settings_for(broker: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_BULKHEAD", "CELERY_"))}
    env.update({"CELERY_BROKER_URL": broker, "DJANGO_SETTINGS_MODULE": "scheduler_project.settings",
                "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/unused",
                "SECRET_KEY": "test-only-secret-key-not-for-production-0123456789abcdef"})
    done = subprocess.run([sys.executable, "-c", "import django; django.setup(); " + PROBE], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_amqp_the_run_queue_is_published_with_confirms_and_the_bulkhead_is_in_the_database() -> None:
    found = settings_for("amqp://guest:guest@127.0.0.1:5672/scheduler")
    assert found["options"].get("confirm_publish") is True
    assert found["bulkhead"] == "database"
    assert found["acks_late"] is False and found["cancel"] is True  # calls in flight survive a reconnect


def test_on_redis_there_are_no_confirms_to_ask_for_and_the_bulkhead_is_in_redis() -> None:
    found = settings_for("redis://127.0.0.1:6379/14")
    assert "confirm_publish" not in found["options"]
    assert found["bulkhead"] == "redis"
