"""Celery tasks: thin, an id in, a service call."""
from __future__ import annotations

import os
import threading

from celery import Task, shared_task

from runs.services import run_execute


@shared_task(bind=True, name="runs.execute_run", ignore_result=True)
def execute_run(self: Task, run_id: int) -> str:
    # The worker's name in the run's timeline: Celery node, process, thread.
    worker = f"{self.request.hostname or 'worker'}/{os.getpid()}/{threading.get_ident() % 100000}"
    return run_execute(run_id=run_id, worker=worker)
