"""Run a project command and count every statement its Django connections send.

    python bench/counted.py --out DIR manage.py scanner --identifier scanner-1
    python bench/counted.py --out DIR -m celery -A scheduler_project worker ...

A `connection.execute_wrapper` is added to every connection as it is made (the
`connection_created` signal), before the command starts, so it needs nothing from the
code under test: it counts the same way on today's tree and on an old commit's
(bench/baseline.py). Each process (a prefork child too) writes DIR/<pid>.json,
{"statements": N}, about once a second and when it exits.

What it cannot see: statements on a connection Django did not make (psycopg used
directly), and those libpq and Django send themselves (connection set-up, BEGIN and
COMMIT). The `idle` scenario counts those server-side beside it.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
FLUSH_SECONDS = 1.0


class Counter:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.flush_lock = threading.Lock()
        self.count = 0

    def wrapper(self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        with self.lock:
            self.count += 1
        return execute(sql, params, many, context)

    def flush(self) -> None:
        path = self.out / f"{os.getpid()}.json"
        tmp = path.with_suffix(".tmp")
        with self.flush_lock:
            tmp.write_text(json.dumps({"statements": self.count}))
            tmp.replace(path)  # a reader never sees half a file

    def flush_forever(self) -> None:
        while True:
            time.sleep(FLUSH_SECONDS)
            self.flush()

    def start(self) -> None:
        self.flush()
        threading.Thread(target=self.flush_forever, daemon=True).start()

    def after_fork(self) -> None:
        # A prefork child starts from its parent's count: its own file counts from 0.
        self.lock, self.flush_lock = threading.Lock(), threading.Lock()
        self.count = 0
        self.start()


def install(counter: Counter) -> None:
    from django.db.backends.signals import connection_created

    def add_wrapper(sender: Any, connection: Any, **kwargs: Any) -> None:
        if counter.wrapper not in connection.execute_wrappers:
            connection.execute_wrappers.append(counter.wrapper)

    connection_created.connect(add_wrapper, weak=False)
    os.register_at_fork(after_in_child=counter.after_fork)
    atexit.register(counter.flush)
    counter.start()


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[0] != "--out":
        raise SystemExit("usage: counted.py --out DIR (manage.py ARGS... | -m MODULE ARGS...)")
    out = Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    install(Counter(out))
    rest = argv[2:]
    sys.path[0] = str(ROOT)  # as if started from the tree's root, not from bench/
    if rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(str(ROOT / rest[0]), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
