"""The worker's call threads: made as calls need them, given back when a burst is over,
and one TLS context for all of them (docs/performance.md, "Memory")."""
from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runs import delivery
from runs.delivery import CallPool
from tests.webhook import HttpsWebhook


def eventually(check: object, *, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return bool(check())  # type: ignore[operator]


def pool_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(f"{name}-")]


def test_a_bursts_threads_end_once_it_is_over() -> None:
    pool = CallPool(50, idle_seconds=0.3, name="burst")
    release = threading.Event()
    futures = [pool.submit(release.wait, 10) for _ in range(20)]

    assert eventually(lambda: pool.threads() == 20)  # twenty calls at once: twenty threads
    release.set()
    assert all(f.result(timeout=5) is True for f in futures)

    assert eventually(lambda: pool.threads() == 0 and not pool_threads("burst"))


def test_a_steady_stream_keeps_one_thread_warm_and_reuses_it() -> None:
    pool = CallPool(50, idle_seconds=5, name="steady")
    names = [pool.submit(lambda: threading.current_thread().name).result(timeout=5) for _ in range(30)]

    assert set(names) == {"steady-1"}  # the thread that went idle last takes the next call
    assert pool.threads() == 1


def test_calls_over_the_limit_wait_in_order_for_a_thread() -> None:
    pool = CallPool(3, idle_seconds=5, name="limit")
    release = threading.Event()
    started: list[int] = []
    lock = threading.Lock()

    def call(i: int) -> int:
        with lock:
            started.append(i)
        release.wait(10)
        return i

    futures = [pool.submit(call, i) for i in range(10)]
    assert eventually(lambda: len(started) == 3)
    time.sleep(0.1)
    assert sorted(started) == [0, 1, 2] and pool.threads() == 3  # no fourth thread
    release.set()

    assert [f.result(timeout=5) for f in futures] == list(range(10))
    assert started[3:] == list(range(3, 10))  # the waiting ones, first come first served
    assert pool.threads() <= 3


def test_a_call_that_raises_reaches_its_caller_and_the_thread_goes_on() -> None:
    pool = CallPool(2, idle_seconds=5, name="raises")

    def boom() -> None:
        raise ValueError("from the call")

    with pytest.raises(ValueError, match="from the call"):
        pool.submit(boom).result(timeout=5)
    assert pool.submit(lambda: 7).result(timeout=5) == 7
    assert pool.threads() == 1


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[HttpsWebhook]:
    hook = HttpsWebhook(tmp_path / "tls")
    hook.start()
    yield hook
    hook.stop()


def test_every_call_thread_shares_one_tls_context(
    webhook: HttpsWebhook, settings: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A context holds its own copy of the CA bundle (785 KiB resident, measured): one a
    thread came to 157 MB for a worker child's 200 call threads. Failed before the fix:
    twenty threads made twenty contexts."""
    # A CA file no context was made for yet: the context is made here.
    settings.SCHEDULER_TLS_CA_FILE = webhook.cert  # type: ignore[attr-defined]
    made: list[ssl.SSLContext] = []
    create = ssl.create_default_context

    def counted(*args: object, **kwargs: object) -> ssl.SSLContext:
        made.append(create(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(ssl, "create_default_context", counted)
    delivery.close_connections()
    pool = CallPool(20, idle_seconds=1, name="tls")
    request = delivery.Request(method="POST", url=webhook.url("/hook"), headers={"Content-Type": "application/json"},
                               body=b"{}", addresses=("127.0.0.1",))
    barrier = threading.Barrier(20, timeout=10)

    def call_together() -> int | None:
        barrier.wait()  # twenty threads at once, each with a connection of its own
        return delivery.call(request, timeout_seconds=10).status

    try:
        statuses = [f.result(timeout=30) for f in [pool.submit(call_together) for _ in range(20)]]
    finally:
        delivery.close_connections()

    assert statuses == [200] * 20  # verified against the test's CA: the shared context checks certificates
    assert len(made) == 1
    assert len(webhook.calls()) == 20
