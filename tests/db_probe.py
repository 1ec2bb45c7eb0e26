"""A process that talks to the store the way the scheduler's processes do (Django's
connection, the settings built from DATABASE_URL), one short statement after
another, and prints a line for each: `ok <time>` or `error <time> <seconds it
took> <what>`. For the silent-link test (tests/reliability/test_partitions.py).

    python -m tests.db_probe --seconds 60 [--statement-seconds 0.3]

Bounded: it exits after --seconds. After an error it closes its connection, as the
worker's heartbeat and the scanner do, so the next statement connects again.
"""
from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--statement-seconds", type=float, default=0.3)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")
    import django

    django.setup()
    from django.db import DatabaseError, connection

    print("probe started", flush=True)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        started = time.time()
        try:
            with connection.cursor() as cursor:
                # A statement in flight most of the time: a cut lands in the middle of one.
                cursor.execute("SELECT pg_sleep(%s)", [args.statement_seconds])
            print(f"ok {time.time():.3f}", flush=True)
        except DatabaseError as exc:
            took = time.time() - started
            print(f"error {time.time():.3f} {took:.2f} {str(exc).splitlines()[0][:200]}", flush=True)
            try:
                connection.close()
            except DatabaseError:
                pass
            time.sleep(0.2)


if __name__ == "__main__":
    main()
