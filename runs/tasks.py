"""Celery tasks: thin, an id in, a service call."""
from __future__ import annotations

from celery import shared_task

from runs.services import run_execute


@shared_task(name="runs.execute_run", ignore_result=True)
def execute_run(run_id: int) -> str:
    return run_execute(run_id=run_id)
