"""The store gate (runs.storegate): a worker whose heartbeats cannot reach the store
stops taking run messages, and hands back those it gets, until a beat succeeds.
The two-worker partition test (tests/reliability/test_partitions.py) measures it
end to end; these pin its parts."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator

import pytest
from django.conf import settings
from kombu import Connection

from runs import storegate
from runs.tasks import execute_runs


@pytest.fixture
def switches() -> Iterator[list[str]]:
    told: list[str] = []
    yield told
    storegate._closed.value = 0  # the flag is the process's: leave it open for the next test


def gate_for(told: list[str]) -> storegate.Gate:
    return storegate.Gate(lambda: told.append("stop"), lambda: told.append("resume"))


def test_a_failed_beat_closes_the_gate_once_and_the_next_good_beat_opens_it(switches: list[str]) -> None:
    gate = gate_for(switches)

    for _ in range(2):
        gate.beat_started()
        gate.beat_ended(ok=False)
    assert storegate.is_closed() and switches == ["stop"]

    gate.beat_started()
    gate.beat_ended(ok=True)
    assert not storegate.is_closed() and switches == ["stop", "resume"]


def test_a_beat_that_does_not_come_back_closes_the_gate_while_it_still_waits(
        switches: list[str], settings: object) -> None:
    settings.SCHEDULER_WORKER_HEARTBEAT = 1  # type: ignore[attr-defined]
    gate = gate_for(switches)

    gate.beat_started()  # and nothing comes back: a statement on a silent link
    deadline = time.monotonic() + storegate.unreachable_after() + 3
    # Both: the timer's thread sets the flag, then calls `stop` (a fresh-clone run of
    # 10cc7a0 read the flag set and the switch not yet called).
    while not (storegate.is_closed() and switches) and time.monotonic() < deadline:
        time.sleep(0.05)

    assert storegate.is_closed() and switches == ["stop"]
    gate.beat_ended(ok=True)  # the link came back, the statement ended
    assert not storegate.is_closed() and switches == ["stop", "resume"]


def test_a_beat_that_comes_back_in_time_leaves_the_gate_open(switches: list[str], settings: object) -> None:
    settings.SCHEDULER_WORKER_HEARTBEAT = 1  # type: ignore[attr-defined]
    gate = gate_for(switches)

    gate.beat_started()
    gate.beat_ended(ok=True)
    time.sleep(storegate.unreachable_after() + 0.5)  # past the bound: the cancelled timer must not fire

    assert not storegate.is_closed() and switches == []


def test_a_run_message_taken_while_the_gate_is_closed_is_handed_back_to_its_queue_untouched(
        switches: list[str]) -> None:
    if not settings.CELERY_BROKER_URL.startswith("redis://"):
        pytest.skip("needs the production layout's Redis broker")
    queue = f"handback-test-{uuid.uuid4().hex[:8]}"
    storegate._closed.value = 1

    # As a worker gets it: delivery_info names the queue it came from.
    outcome = execute_runs.apply(args=([41, 42],), kwargs={"handbacks": 1}, routing_key=queue)
    handed = storegate.hand_back([43], handbacks=storegate.MAX_HANDBACKS, queue=queue, why="test")

    assert outcome.get() == {41: "handed_back", 42: "handed_back"}
    assert handed is False  # handed back too often: left to the scanner's requeue
    with Connection(settings.CELERY_BROKER_URL) as conn:
        simple = conn.SimpleQueue(queue)
        message = simple.get(timeout=5)
        message.ack()
        with pytest.raises(simple.Empty):  # one message: the one handed back, not the one refused
            simple.get(timeout=0.5)
        simple.close()
    args, kwargs, _ = json.loads(message.body) if isinstance(message.body, (str, bytes)) else message.body
    assert message.headers["task"] == "runs.execute_runs"
    assert args == [[41, 42]] and kwargs == {"handbacks": 2}


def test_the_gate_can_be_turned_off_only_by_the_tests_two_variables(
        switches: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    storegate._closed.value = 1
    monkeypatch.setenv("SCHEDULER_TEST_NO_STORE_GATE", "1")
    monkeypatch.delenv("SCHEDULER_TESTING", raising=False)
    assert storegate.is_closed()
    monkeypatch.setenv("SCHEDULER_TESTING", "1")
    assert not storegate.is_closed()
