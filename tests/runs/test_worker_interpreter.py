"""A worker child's interpreter is tuned when it starts (scheduler_project/celery.py):
the GIL handed over every SCHEDULER_WORKER_SWITCH_INTERVAL, and what the child has
loaded frozen out of the garbage collector's passes."""
from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator

import pytest
from celery.signals import worker_process_init
from django.test import override_settings

from scheduler_project import celery as celery_app


@pytest.fixture
def interpreter() -> Iterator[None]:
    interval = sys.getswitchinterval()
    try:
        yield
    finally:
        sys.setswitchinterval(interval)
        gc.unfreeze()


def connected(receiver: object) -> bool:
    """Among the signal's receivers (Celery keeps a weak reference to a function)."""
    found = [ref() if isinstance(ref, weakref.ReferenceType) else ref for _, ref in worker_process_init.receivers]
    return receiver in found


def test_the_tuning_is_connected_to_each_worker_childs_start() -> None:
    assert connected(celery_app._tune_interpreter)


@override_settings(SCHEDULER_WORKER_SWITCH_INTERVAL=0.001)
def test_a_worker_child_hands_the_gil_over_every_millisecond_and_freezes_what_it_loaded(interpreter: None) -> None:
    sys.setswitchinterval(0.005)  # CPython's default
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    celery_app._tune_interpreter()
    assert sys.getswitchinterval() == pytest.approx(0.001)
    assert gc.get_freeze_count() > 1000  # Django, Celery and the project's modules


@override_settings(SCHEDULER_WORKER_SWITCH_INTERVAL=0)
def test_a_switch_interval_of_0_leaves_cpythons_own(interpreter: None) -> None:
    sys.setswitchinterval(0.005)
    celery_app._tune_interpreter()
    assert sys.getswitchinterval() == pytest.approx(0.005)
