"""Run a module or script with its clock shifted, for the clock-skew tests only:

    python tests/clockshift.py --offset 120 -- manage.py scanner --identifier fast
    python tests/clockshift.py --offset -120 -- -m celery -A scheduler_project worker ...

time-machine moves every wall-clock read of the process (time.time, datetime.now,
and so timezone.now) by `offset` seconds, ticking; the monotonic clock is left
alone, as a skewed machine's would be. Forked children (Celery's prefork pool)
inherit the shift. No production code knows about this: a machine whose clock is
wrong is the thing being imitated, not a setting.
"""
from __future__ import annotations

import argparse
import runpy
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import time_machine

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offset", type=float, required=True, help="seconds; negative runs behind")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then `-m module args` or `script args`")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("nothing to run")
    sys.path.insert(0, str(ROOT))
    time_machine.travel(datetime.now(timezone.utc) + timedelta(seconds=args.offset), tick=True).start()
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
