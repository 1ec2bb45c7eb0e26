"""Break it: a fault-injection soak on the production layout.

    .venv/bin/python bench/soak.py --duration 120 [--settle 45] [--db sched_soak] [--json PATH]
        [--actions all [--actions-per-kind N]]

Its own PostgreSQL databases (the scheduler's and the target's), a private Redis,
a private ZooKeeper, an idempotent target on two loopback ports (bench/soak_target.py),
two scanners and two workers. Jobs (every-minute cron, one-off `at`, a stream of
`delay` jobs; some with windows, all with retries) run for --duration seconds
while faults are injected at random, each kind about as often as the others:

  worker_kill    kill -9 of a worker in the middle of a call, then a restart
  worker_stop    SIGSTOP of a worker in the middle of a call, past its lease, then SIGCONT
  scanner_kill   kill -9 of a scanner, then a restart
  redis_flush    FLUSHALL on the broker: every queued message is lost
  zk_restart     ZooKeeper stopped and started again (its state wiped: every session ends)
  pg_terminate   pg_terminate_backend on a worker's connections (found by application_name)
  target_slow    one target host answers in 3 s for a while
  target_errors  one target host answers 503 for a while
  duplicate_delivery  every running run's message delivered again (brokers deliver at least once)

and since issue 19 (docs/reliability.md, "The soak"), each where the layout takes it:

  zk_leader_kill, zk_follower_kill   kill -9 of an ensemble node, started again (--zk-nodes 3)
  zk_quorum_loss the leader and a follower killed past a session, then started: scanning must stop
  scanner_zk_cut a scanner's links to ZooKeeper cut (tests/netproxy.py) for two sessions: it must stop
  worker_pg_cut  a worker's link to PostgreSQL cut mid-call, past its lease
  pg_restart     the private PostgreSQL (--private-pg) restarted: a fast shutdown or its postmaster killed
  redis_restart  the private Redis restarted, empty
  broker_restart, broker_purge       RabbitMQ (--broker amqp): the vhost's connections closed, the run
                 queue purged

--rate R adds a steady load of R runs a second (bench/soak_load.py) on a batching target
(bench/soak_load_target.py), its accounting in SQL over every run; --max-rate measures the
layout's highest sustained rate without faults.

With --actions (bench/soak_actions.py), user actions are injected too, each a fault
kind: edits, pauses, resumes, deletes, run now and backfills of the soak's own jobs.

Then every process is healed, the soak waits --settle seconds, and measures: runs due
(by the measurement minus --margin), started, succeeded, dead (why), missed (a time
of the reference schedule, which follows every user action, that no run started
for), runs started while their job was paused or deleted, effects the target applied
twice, stale writes rejected, the
invariants of runs/invariants.py, lateness past the window, each fault's count,
and the handover times. Duplicate effects are counted from both sides: effects
the target applied twice (its own records), and runs the store records as
applied under two fences (recorded_applied_twice). It prints one table, writes a
JSON summary, and exits 1 if a run was missed, a run of a paused or deleted job
started, an effect was applied twice (by either count), or an invariant broken.
All along it samples the memory (RSS, and PSS) of every scanner, worker parent and
child, the target and Redis every --memory-every seconds (bench/memory.py) into the
JSON's `memory`; bench/plot_memory.py draws it.

Bounded: it stops by itself (an alarm ends it after duration + settle + 10 minutes
whatever happens), and everything it starts it stops, by process id.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import statistics
import sys
import threading
import time
import traceback
from collections import Counter, defaultdict
from datetime import datetime, timedelta, timezone as dt_timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import group_pids  # noqa: E402
from bench.memory import MemorySampler  # noqa: E402
from bench.soak_actions import USER_KINDS, UserActions, judge, run_facts  # noqa: E402
from bench import soak_load  # noqa: E402
from bench.soak_stack import (  # noqa: E402
    ROOT, ZK_TICK_S, ApiServer, Databases, Fleet, LoadTarget, PrivateRedis, Target, ZooKeeper, ZooKeeperEnsemble,
)

METRICS_TOKEN = "soak-metrics-scrape"  # the API's /metrics bearer token (--api)

KINDS = ("worker_kill", "worker_stop", "scanner_kill", "redis_flush", "zk_restart", "pg_terminate",
         "target_slow", "target_errors", "duplicate_delivery",
         # issue 19: the ensemble's, partitions, server restarts, the AMQP broker's
         "zk_leader_kill", "zk_follower_kill", "zk_quorum_loss", "scanner_zk_cut", "worker_pg_cut",
         "pg_restart", "redis_restart", "broker_restart", "broker_purge")
ENSEMBLE_KINDS = ("zk_leader_kill", "zk_follower_kill", "zk_quorum_loss")
REDIS_KINDS = ("redis_flush", "redis_restart")
AMQP_KINDS = ("broker_restart", "broker_purge")
# The faults after which the soak measures when runs flow again (a run queued after the
# fault began, claimed), and for how long some partition had no scanner.
FLOW_KINDS = ("pg_restart", "redis_restart", "broker_restart", "zk_quorum_loss", "zk_restart")
ZK_GAP_KINDS = ("zk_leader_kill", "zk_follower_kill", "zk_quorum_loss", "zk_restart", "scanner_zk_cut")


def applicable_kinds(args: argparse.Namespace) -> list[str]:
    """The fault kinds the layout can take: the ensemble's only with three nodes, a
    PostgreSQL restart only on the soak's private server, each broker's own."""
    return [k for k in KINDS
            if not (k in ENSEMBLE_KINDS and args.zk_nodes != 3)
            and not (k == "pg_restart" and not args.private_pg)
            and not (k in REDIS_KINDS and args.broker != "redis")
            and not (k in AMQP_KINDS and args.broker != "amqp")]
RUN_QUEUE = "runs-soak"
PARTITION_LINE = re.compile(r"^partitions \[([\d, ]*)\] at ([\d.]+)\s*$", re.M)
DEFERRALS = ("bulkhead_wait", "held_by_breaker")
# The events recorded_applied_twice reads.
APPLIED_EVIDENCE = ("claimed", "succeeded", "target_answered")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=120, help="seconds of load with faults")
    p.add_argument("--settle", type=float, default=45, help="seconds of healthy running before measuring")
    p.add_argument("--margin", type=float, default=10, help="runs due later than measurement minus this are not judged")
    p.add_argument("--jobs", type=int, default=24, help="cron and `at` jobs made at the start")
    p.add_argument("--delay-every", type=float, default=2.0, help="a new `delay` job every this many seconds")
    p.add_argument("--faults-per-kind", type=int, default=0, help="default: as many as fit, about one every 20 s")
    p.add_argument("--kinds", default=None,
                   help="comma-separated fault kinds to inject (default: every kind the layout can take; '' none)")
    p.add_argument("--zk-nodes", type=int, default=1, choices=(1, 3),
                   help="1: one ZooKeeper (scripts/zookeeper.sh); 3: an ensemble (tests/zkensemble.py)")
    p.add_argument("--private-pg", action="store_true",
                   help="the scheduler's database on a private PostgreSQL (tests/pgpair.PgServer) the soak may "
                        "restart; the target's stays on --pg")
    p.add_argument("--broker", default="redis", choices=("redis", "amqp"),
                   help="redis: a private redis-server; amqp: the machine's RabbitMQ on a vhost of the soak's own")
    p.add_argument("--actions", default="",
                   help=f"comma-separated user actions to inject alongside the faults, or `all` ({', '.join(USER_KINDS)});"
                        " default none")
    p.add_argument("--actions-per-kind", type=int, default=0,
                   help="how many of each user action (default: as many as fit, about one action every 6 s)")
    p.add_argument("--scanners", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=4, help="each worker's prefork pool")
    p.add_argument("--lease", type=int, default=4, help="SCHEDULER_LEASE_SECONDS")
    p.add_argument("--scan-interval", type=float, default=0.5)
    p.add_argument("--requeue-after", type=int, default=5)
    p.add_argument("--zk-session", type=float, default=4)
    p.add_argument("--zk-boundary", type=float, default=None,
                   help="ignored: the coordinator no longer waits for membership to settle (kept for old scripts)")
    p.add_argument("--target-concurrency", type=int, default=None,
                   help="SCHEDULER_TARGET_CONCURRENCY (default 3; with --rate, 256: more than the slots a batch of "
                        "SCHEDULER_DISPATCH_BATCH runs holds, each until the whole batch ends)")
    p.add_argument("--breaker-failures", type=int, default=5)
    p.add_argument("--breaker-cooldown", type=int, default=5)
    p.add_argument("--pg", default=_pg_server(), help="PostgreSQL server URL, without a database")
    p.add_argument("--db", default="sched_soak", help="the scheduler's database (the target's gets _target)")
    p.add_argument("--json", default=str(ROOT / "bench" / "results" / "soak.json"))
    p.add_argument("--workdir", default="", help="logs go here (default: a new /tmp/sched-soak-* folder)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--drop", action="store_true", help="drop both databases at the end")
    p.add_argument("--inject-bug", action="store_true",
                   help="turn on the deliberate fence bug (runs/claims.py) in the workers: the soak must fail")
    p.add_argument("--stop-on-violation", action="store_true", help="end the faults early once an invariant breaks")
    p.add_argument("--stop-on-duplicate", action="store_true",
                   help="end the faults early once a duplicate effect is found (either count)")
    p.add_argument("--rate", type=int, default=0,
                   help="a steady load of this many runs a second (bench/soak_load.py: rate*60 every-minute jobs "
                        "spread over --load-window), on the batching target (bench/soak_load_target.py); "
                        "its accounting covers every run, in SQL")
    p.add_argument("--load-window", type=int, default=59, help="the load jobs' window, seconds")
    p.add_argument("--max-rate", action="store_true",
                   help="the layout's highest sustained rate: no faults, no user actions; offer --rate above it, "
                        "read `load.steady.started_per_s` (runs left late by the backlog are not a failure here)")
    p.add_argument("--dispatch-batch", type=int, default=0, help="SCHEDULER_DISPATCH_BATCH (default: the setting's)")
    p.add_argument("--worker-calls", type=int, default=0, help="SCHEDULER_WORKER_CALLS (default: the setting's)")
    p.add_argument("--lookahead", type=float, default=None, help="SCHEDULER_LOOKAHEAD (default: the setting's)")
    p.add_argument("--spare-from-kills", action="store_true",
                   help="worker-a and scanner-a are never the ones a worker_kill or scanner_kill picks (the other "
                        "worker and scanner take every kill): one process of each kind lives through the soak, "
                        "for its memory growth; freezes and cuts still pick any")
    p.add_argument("--api", action="store_true",
                   help="serve the REST API (gunicorn) and ask it a request every --api-every seconds all along, "
                        "for its memory")
    p.add_argument("--api-every", type=float, default=0.25)
    p.add_argument("--memory-every", type=float, default=15,
                   help="seconds between samples of each process's RSS and PSS (bench/memory.py)")
    args = p.parse_args(argv)
    if args.max_rate:
        if not args.rate:
            p.error("--max-rate needs --rate (offer more than the layout can take)")
        args.kinds, args.actions = "", ""
    if args.kinds is None:
        args.kinds = ",".join(applicable_kinds(args))
    if args.target_concurrency is None:
        args.target_concurrency = 256 if args.rate else 3
    return args


def _pg_server() -> str:
    url = os.environ.get("DATABASE_URL", "")
    return url.rsplit("/", 1)[0] if url.startswith("postgres") else "postgres://postgres@127.0.0.1:5432"


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, dt_timezone.utc)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kinds = [k for k in args.kinds.split(",") if k]
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise SystemExit(f"unknown fault kinds: {', '.join(sorted(unknown))}")
        unfit = set(self.kinds) - set(applicable_kinds(args))
        if unfit:
            raise SystemExit(f"fault kinds this layout cannot take: {', '.join(sorted(unfit))} "
                             "(the ensemble's need --zk-nodes 3, pg_restart --private-pg, each broker its own)")
        self.action_kinds = list(USER_KINDS) if args.actions == "all" else [k for k in args.actions.split(",") if k]
        unknown = set(self.action_kinds) - set(USER_KINDS)
        if unknown:
            raise SystemExit(f"unknown user actions: {', '.join(sorted(unknown))}")
        self.actions: UserActions | None = None
        self.workdir = Path(args.workdir) if args.workdir else Path(f"/tmp/sched-soak-{int(time.time())}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pg: Any = None  # tests/pgpair.PgServer with --private-pg
        if args.private_pg:
            from tests.pgpair import PgServer

            self.pg = PgServer()
        self.dbs = Databases(args.pg, args.db, store=self.pg.url if self.pg is not None else None)
        self.redis: PrivateRedis | None = None
        self.rabbit: Any = None  # tests/rabbitmq.RabbitVhost with --broker amqp
        self.zk: Any = ZooKeeperEnsemble(self.workdir) if args.zk_nodes == 3 else ZooKeeper()
        # The dropping proxies (tests/netproxy.py): each scanner's links to ZooKeeper, each worker's to PostgreSQL.
        self.zk_proxies: dict[str, list[Any]] = {}
        self.pg_proxies: dict[str, Any] = {}
        self.zk_faults: list[dict[str, Any]] = []  # ensemble faults, cuts: when, for the gap in scanning
        self.flow_faults: list[dict[str, Any]] = []  # server restarts: when, for the time until runs flow again
        self.target: Target | None = None
        self.api: ApiServer | None = None  # --api: the REST API under use, for its memory
        self.fleet: Fleet | None = None
        self.modes: dict[int, dict[str, Any]] = {}
        self.faults: list[dict[str, Any]] = []
        self.worker_losses: list[dict[str, Any]] = []  # (kind, at, runs in flight) for worker handovers
        self.scanner_deaths: list[dict[str, Any]] = []
        self.zk_restarts: list[float] = []
        self.scanner_cuts: list[dict[str, Any]] = []
        self.stop_stream = threading.Event()
        self.stopped_early = ""
        self.memory = MemorySampler(self._memory_groups, every=args.memory_every)
        self.spared = {"worker-a", "scanner-a"} if args.spare_from_kills else set()
        self.api_token = ""
        self.api_env: dict[str, str] = {}
        self.load_range: tuple[int, int] | None = None  # the load jobs' ids (--rate)
        self.load_first: datetime | None = None

    # ----------------------------------------------------------------- the layout

    def env(self) -> dict[str, str]:
        a = self.args
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SCHEDULER_", "DJANGO_"))}
        env.update({
            "DATABASE_URL": self.dbs.url(),
            "SECRET_KEY": "soak-only-secret-key-0123456789abcdefghijklmnopqrstuvwxyz",
            "CELERY_BROKER_URL": self.rabbit.url if self.rabbit is not None else self.redis.url,
            "ZOOKEEPER_HOSTS": self.zk.hosts,
            "SCHEDULER_ZK_ROOT": "/scheduler-soak",
            "SCHEDULER_RUN_QUEUE": RUN_QUEUE,
            "SCHEDULER_DATA_DIR": str(self.workdir / "var"),
            "SCHEDULER_LEASE_SECONDS": str(a.lease),
            "SCHEDULER_SCAN_INTERVAL": str(a.scan_interval),
            "SCHEDULER_REQUEUE_AFTER": str(a.requeue_after),
            "SCHEDULER_ZK_SESSION_TIMEOUT": str(a.zk_session),
            "SCHEDULER_TARGET_CONCURRENCY": str(a.target_concurrency),
            "SCHEDULER_BREAKER_FAILURES": str(a.breaker_failures),
            "SCHEDULER_BREAKER_COOLDOWN": str(a.breaker_cooldown),
            "SCHEDULER_LOG_LEVEL": "WARNING",
            "EMAIL_BACKEND": "django.core.mail.backends.dummy.EmailBackend",
            "PYTHONUNBUFFERED": "1",
        })
        if a.dispatch_batch:
            env["SCHEDULER_DISPATCH_BATCH"] = str(a.dispatch_batch)
        if a.worker_calls:
            env["SCHEDULER_WORKER_CALLS"] = str(a.worker_calls)
        if a.lookahead is not None:
            env["SCHEDULER_LOOKAHEAD"] = str(a.lookahead)
        for name in ("DEBUG", "RECEIVER_SIGNING_SECRETS"):
            env.pop(name, None)
        return env

    def up(self) -> None:
        if self.args.broker == "amqp":
            from tests.rabbitmq import RabbitVhost

            why = RabbitVhost.available()
            if why:
                raise SystemExit(f"--broker amqp: {why}")
            self.rabbit = RabbitVhost("sched-soak").__enter__()
        else:
            self.redis = PrivateRedis(self.workdir)
        if self.pg is not None:
            self.pg.start()
        self.zk.start()
        env = self.env()
        if self.rabbit is not None:  # the bulkhead follows the broker: database (runs/bulkhead.py)
            for key in ("SCHEDULER_BULKHEAD", "SCHEDULER_BULKHEAD_REDIS_URL", "SCHEDULER_TASK_BROKER_URL"):
                env.pop(key, None)
        self.dbs.create(env)
        target_env = {**env, "DATABASE_URL": self.dbs.url(target=True)}
        self.target = LoadTarget(target_env, self.workdir, db_url=self.dbs.url(target=True)) if self.args.rate \
            else Target(target_env, self.workdir)
        self.target.start()
        self.api_env = {**env, "SCHEDULER_METRICS_TOKEN": METRICS_TOKEN}
        worker_env = dict(env)
        if self.args.inject_bug:
            worker_env.update({"SCHEDULER_TESTING": "1", "SCHEDULER_TEST_DISABLE_FENCE": "1"})
        self.fleet = Fleet(worker_env, self.workdir, self.args.concurrency)
        self._proxies(env)
        for i in range(self.args.scanners):
            self.fleet.start(f"scanner-{chr(97 + i)}")
        for i in range(self.args.workers):
            self.fleet.start(f"worker-{chr(97 + i)}")
        self._django(env)
        from scanners.coordination import all_partitions

        every = set(all_partitions())
        # Start the clock once the scanners share every partition between them.
        self._wait(lambda: set().union(*(self._owned_now(n) for n in self.fleet.names("scanner"))) == every, 60,
                   "the scanners to own every partition")

    def _proxies(self, env: dict[str, str]) -> None:
        """With scanner_zk_cut or worker_pg_cut: each scanner reaches every ZooKeeper node,
        and each worker PostgreSQL, through a dropping proxy of its own (tests/netproxy.py)."""
        from urllib.parse import urlsplit

        from tests.netproxy import NetProxy

        assert self.fleet is not None
        if "scanner_zk_cut" in self.kinds:
            for i in range(self.args.scanners):
                name = f"scanner-{chr(97 + i)}"
                self.zk_proxies[name] = [NetProxy(port).start() for port in self.zk.client_ports()]
                self.fleet.overrides.setdefault(name, {})["ZOOKEEPER_HOSTS"] = ",".join(
                    p.address for p in self.zk_proxies[name])
        if "worker_pg_cut" in self.kinds:
            db = urlsplit(env["DATABASE_URL"])
            for i in range(self.args.workers):
                name = f"worker-{chr(97 + i)}"
                proxy = self.pg_proxies[name] = NetProxy(db.port or 5432, db.hostname or "127.0.0.1").start()
                self.fleet.overrides.setdefault(name, {})["DATABASE_URL"] = db._replace(
                    netloc=f"{db.username}@{proxy.address}").geturl()

    def _django(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        os.environ["SCHEDULER_DB_APPLICATION_NAME"] = "soak-driver"
        os.environ["DJANGO_SETTINGS_MODULE"] = "scheduler_project.settings"
        import django

        django.setup()

    def down(self) -> None:
        if self.fleet is not None:
            self.fleet.stop_all()
        if self.target is not None:
            self.target.stop()
        if self.api is not None:
            self.api.stop()
        if self.redis is not None:
            self.redis.stop()
        for proxy in [*self.pg_proxies.values(), *(p for ps in self.zk_proxies.values() for p in ps)]:
            proxy.stop()
        try:
            self.zk.stop()
        except Exception:
            traceback.print_exc()
        if self.rabbit is not None:
            try:
                self.rabbit.__exit__(None, None, None)  # the soak's vhost deleted
            except Exception:
                traceback.print_exc()
        if self.args.drop:
            from django.db import connections

            connections.close_all()
            self.dbs.drop()
        if self.pg is not None:  # its data directory goes with it
            from django.db import connections

            connections.close_all()
            self.pg.stop()

    def _wait(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.2)

    # ----------------------------------------------------------------- the load

    def make_load(self) -> None:
        """--rate: the load jobs, their first runs at the next whole minute at least 20 s
        away; returns once it has come, so the faults start under the load."""
        if not self.args.rate:
            return
        assert self.target is not None
        from django.db import connection

        first = utc((int(time.time() + 20) // 60 + 1) * 60)
        urls = [self.target.url(port, "load") for port in self.target.ports]
        made = time.time()
        self.load_range = soak_load.insert_load_jobs(rate=self.args.rate, window_s=self.args.load_window, urls=urls,
                                                     first=first)
        self.load_first = first
        connection.close()
        print(f"load: {self.args.rate * 60} every-minute jobs (ids {self.load_range[0]}-{self.load_range[1]}) made in "
              f"{time.time() - made:.1f} s, first runs at {first:%H:%M:%S}", flush=True)
        while time.time() < first.timestamp():
            time.sleep(0.2)

    def make_jobs(self) -> None:
        from jobs.services import job_create, service_account_ensure

        self.owner, self.api_token = service_account_ensure(name="soak")
        assert self.target is not None
        # Every job's history (timings, pauses, deletion) is kept for the reference schedule.
        self.actions = UserActions(self.owner, self._job_fields, self.target.ports, self.target.url)
        now = time.time()
        crons = self.args.jobs * 2 // 3
        for i in range(self.args.jobs):
            fields = self._job_fields(f"j{i}")
            if i < crons:
                fields.update(schedule="* * * * *", window_seconds=random.choice([0, 0, 5, 20]))
                if self.action_kinds:  # resuming applies the misfire policy: try each
                    fields["misfire"] = ("run_once", "skip", "run_all")[i % 3]
            else:
                fields.update(run_at=utc(int(now + random.uniform(10, self.args.duration))),
                              window_seconds=random.choice([0, 5]))
            created_at = utc(time.time())
            self.actions.created(job_create(owner=self.owner, fields=fields, now=created_at), created_at, in_pool=True)
        self.stream = threading.Thread(target=self._delay_stream, name="delay-jobs", daemon=True)
        self.stream.start()

    def _job_fields(self, name: str) -> dict[str, Any]:
        assert self.target is not None
        port = random.choice(self.target.ports)
        return {
            "name": name, "target": self.target.url(port, name), "payload": {"job": name},
            "retry_max": 5, "retry_backoff": "exponential", "retry_base_seconds": 1, "retry_cap_seconds": 8,
            "timeout_seconds": 10,
        }

    def _delay_stream(self) -> None:
        from django.db import OperationalError, connection

        from jobs.services import job_create

        n = 0
        try:
            while not self.stop_stream.wait(self.args.delay_every):
                n += 1
                fields = self._job_fields(f"d{n}")
                fields.update(run_at=utc(int(time.time() + random.uniform(1, 8)) + 1),
                              window_seconds=random.choice([0, 0, 3]))
                try:
                    created_at = utc(time.time())
                    assert self.actions is not None
                    self.actions.created(job_create(owner=self.owner, fields=fields, now=created_at), created_at,
                                         in_pool=False)
                except OperationalError as exc:  # the store is down (pg_restart): this job is not made
                    print(f"delay job d{n} not made: the store is down ({str(exc).strip()[:80]})", flush=True)
                    connection.close()
                except Exception:
                    traceback.print_exc()
                    connection.close()
        finally:
            connection.close()

    # ----------------------------------------------------------------- the faults

    def plan(self, kinds_: list[str] | None = None, per_kind: int = 0, every: float = 20) -> list[tuple[float, str]]:
        """Fault times from a short warm-up to the end, each kind about as often (by
        default the machine faults, about one every `every` seconds)."""
        kinds_ = self.kinds if kinds_ is None else kinds_
        if not kinds_:
            return []
        warmup = min(10.0, self.args.duration / 5)
        per_kind = per_kind or (self.args.faults_per_kind if kinds_ is self.kinds else 0) \
            or max(1, int((self.args.duration - warmup) / every / len(kinds_)))
        kinds: list[str] = []
        for _ in range(per_kind):
            cycle = list(kinds_)
            random.shuffle(cycle)
            kinds += cycle
        step = (self.args.duration - warmup) / len(kinds)
        return [(warmup + i * step + random.uniform(0, step / 3), kind) for i, kind in enumerate(kinds)]

    def inject(self) -> None:
        plan = self.plan()  # before the job stream's thread also draws from `random`
        action_plan = self.plan(self.action_kinds, self.args.actions_per_kind, every=6)
        self.started = time.time()
        self.memory.start()
        self.make_jobs()
        if self.args.api:
            from django.db import connection

            from jobs.models import Job

            self.api = ApiServer(dict(self.api_env), self.workdir, every=self.args.api_every)
            jobs = [j.public_id for j in Job.objects.filter(owner=self.owner).only("id")]
            self.api.start(self.api_token, METRICS_TOKEN, jobs)
            connection.close()
        # User actions on a thread of their own, on their own plan: a fault that takes
        # seconds (a frozen worker) does not hold them back, nor they it.
        self.stop_actions = threading.Event()
        actor = threading.Thread(target=self._act, args=(action_plan,), name="user-actions", daemon=True)
        actor.start()
        try:
            self._follow(plan, lambda kind: getattr(self, f"fault_{kind}")(), checks=True)
            while time.time() < self.started + self.args.duration:
                time.sleep(0.2)
        finally:
            self.stop_actions.set()
            actor.join(timeout=60)

    def _act(self, plan: list[tuple[float, str]]) -> None:
        from django.db import connection

        assert self.actions is not None
        try:
            self._follow(plan, lambda kind: getattr(self.actions, kind)(), stop=self.stop_actions)
        finally:
            connection.close()

    def _follow(self, plan: list[tuple[float, str]], do: Any, checks: bool = False,
                stop: threading.Event | None = None) -> None:
        """Inject each planned fault (or user action) at its time; record and print it."""
        last_check = time.time()
        for offset, kind in plan:
            while time.time() < self.started + offset:
                time.sleep(0.2)
                if stop is not None and stop.is_set():
                    return
                if checks and (self.args.stop_on_violation or self.args.stop_on_duplicate) \
                        and time.time() - last_check > 2:
                    last_check = time.time()
                    if (self.args.stop_on_violation and self._violations_now()) or \
                            (self.args.stop_on_duplicate and self._duplicates_now()):
                        return
            at = time.time()
            try:
                detail = do(kind)
            except Exception as exc:  # a fault that could not be injected is reported, the soak goes on
                detail = {"error": repr(exc)}
                traceback.print_exc()
            detail.setdefault("hit", _hit(kind, detail))
            self.faults.append({"kind": kind, "at": at, "t": round(at - self.started, 1), **detail})
            print(f"[{at - self.started:7.1f}s] {kind} {json.dumps(detail, default=str)}", flush=True)

    def _violations_now(self) -> bool:
        from runs.invariants import timelines

        found = timelines()
        if found:
            self.stopped_early = found[0]
            print(f"stopping early: {found[0]}", flush=True)
        return bool(found)

    def _duplicates_now(self) -> bool:
        from bench.timelines import timelines_by_id

        if self.load_range is not None:
            found = soak_load.recorded_applied_twice()
        else:
            # Rows and the entries on the run rows (runs.timeline), in timeline order.
            timeline: dict[int, list[tuple[datetime, str, dict[str, Any]]]] = defaultdict(list)
            for run_id, entries in timelines_by_id(types=APPLIED_EVIDENCE).items():
                timeline[run_id] += [(e.at, e.type, e.detail or {}) for e in entries]
            found = recorded_applied_twice(timeline)
        twice = self.dbs.target_rows("SELECT key FROM soak_effects GROUP BY key HAVING count(*) > 1")
        if found or twice:
            self.stopped_early = found[0] if found else f"{twice[0][0]} applied twice at the target"
            print(f"stopping early: {self.stopped_early}", flush=True)
        return bool(found or twice)

    def _worker_mid_call(self, kill: bool = False) -> tuple[str, list[tuple[int, int]]]:
        """A worker with a call in flight (waiting up to 5 s for one), and its runs.
        `kill`: not one spared from kills (--spare-from-kills)."""
        from django.utils import timezone

        from runs.models import Run

        assert self.fleet is not None
        names = self.fleet.names("worker")
        if kill:
            names = [n for n in names if n not in self.spared] or names
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            random.shuffle(names)
            for name in names:
                running = list(
                    Run.objects.filter(status=Run.Status.RUNNING, lease_owner__startswith=f"{name}@",
                                       lease_expires_at__gt=timezone.now()).values_list("pk", "fence")
                )
                if running and not self.fleet.procs[name].stopped:
                    return name, running
            time.sleep(0.05)
        return random.choice(names), []

    def fault_worker_kill(self) -> dict[str, Any]:
        assert self.fleet is not None
        name, running = self._worker_mid_call(kill=True)
        at = time.time()
        self.fleet.procs[name].kill()
        self.worker_losses.append({"kind": "worker_kill", "at": at, "runs": running})
        time.sleep(random.uniform(0.5, 2))
        self.fleet.start(name)
        return {"worker": name, "runs_in_flight": len(running)}

    def fault_worker_stop(self) -> dict[str, Any]:
        assert self.fleet is not None
        name, running = self._worker_mid_call()
        proc = self.fleet.procs[name]
        at = time.time()
        proc.freeze()
        self.worker_losses.append({"kind": "worker_stop", "at": at, "runs": running})
        stopped_for = self.args.lease + 2 * self.args.scan_interval + 1.5  # past the lease and a scan
        time.sleep(stopped_for)
        proc.thaw()
        return {"worker": name, "runs_in_flight": len(running), "stopped_s": stopped_for}

    def fault_scanner_kill(self) -> dict[str, Any]:
        assert self.fleet is not None
        # A scanner that owns partitions right now (after a ZooKeeper restart all may own none for a while).
        names = [n for n in self.fleet.names("scanner") if n not in self.spared] or self.fleet.names("scanner")
        deadline = time.monotonic() + 15
        while not any(self._owned_now(n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.2)
        name = random.choice([n for n in names if self._owned_now(n)] or names)
        proc = self.fleet.procs[name]
        owned = self._owned_now(name)
        # Whether another scanner was scanning at the time: if none was (each still starting, or
        # still rejoining after a ZooKeeper restart), the handover waits for that too.
        survivor = any(self._owned_now(n) for n in self.fleet.names("scanner") if n != name)
        at = time.time()
        proc.kill()
        self.scanner_deaths.append({"at": at, "name": name, "generation": proc.generation, "owned": sorted(owned),
                                    "survivor_scanning": survivor})
        time.sleep(random.uniform(1, 3))
        self.fleet.start(name)
        return {"scanner": name, "owned": sorted(owned), "survivor_scanning": survivor}

    def fault_duplicate_delivery(self) -> dict[str, Any]:
        from runs.models import Run
        from scanners.messages import publish_runs

        deadline = time.monotonic() + 5
        running: list[int] = []
        while not running and time.monotonic() < deadline:
            running = list(Run.objects.filter(status=Run.Status.RUNNING).values_list("pk", flat=True))
            time.sleep(0.05)
        if running:
            publish_runs(running)
        return {"runs": len(running)}

    def fault_redis_flush(self) -> dict[str, Any]:
        assert self.redis is not None
        self.redis.flushall()
        return {}

    def fault_zk_restart(self) -> dict[str, Any]:
        if isinstance(self.zk, ZooKeeperEnsemble):  # every node, wiped: every session ends
            at = self.zk.restart_wiped(hold=random.uniform(0.5, 2))
        else:
            at = time.time()
            self.zk.stop()
            time.sleep(random.uniform(0.5, 2))
            self.zk.start()
        self.zk_restarts.append(at)
        self.zk_faults.append({"kind": "zk_restart", "at": at})
        self.flow_faults.append({"kind": "zk_restart", "at": at})
        return {"down_s": round(time.time() - at, 1)}

    # --- the ensemble (--zk-nodes 3): each node killed by its own id, started again

    def _zk_node_down(self, kind: str, nodes: list[int], hold: float) -> dict[str, Any]:
        ens = self.zk.ensemble
        at = time.time()
        for n in nodes:
            ens.kill(n)
        self.zk_faults.append({"kind": kind, "at": at})
        detail: dict[str, Any] = {"nodes": nodes}
        if len(nodes) == 1:  # the two left keep a quorum: a leader among them (a new one, if it was the leader)
            try:
                detail["leader_again_s"] = round(_wait_until(lambda: ens.leader() is not None, 30) - at, 2)
            except TimeoutError:
                detail["leader_again_s"] = None
        else:  # quorum lost: every scanner must stop scanning
            self.flow_faults.append({"kind": kind, "at": at})
            stopped = _wait_until(lambda: not any(self._owned_now(n) for n in self.fleet.names("scanner")),
                                  self.args.zk_session + 10, default=None)
            detail["scanning_stopped_everywhere_s"] = round(stopped - at, 2) if stopped else None
        time.sleep(max(0.0, at + hold - time.time()))
        back = time.time()
        for n in nodes:
            ens.start_node(n)
        try:
            detail["quorum_again_s"] = round(ens.wait_for_quorum(60) - back, 2)
        except TimeoutError:
            detail["quorum_again_s"] = None
        detail["down_s"] = round(back - at, 2)
        return detail

    def fault_zk_leader_kill(self) -> dict[str, Any]:
        leader = self.zk.ensemble.leader()
        if leader is None:
            return {"error": "no leader"}
        return self._zk_node_down("zk_leader_kill", [leader], random.uniform(2, 5))

    def fault_zk_follower_kill(self) -> dict[str, Any]:
        followers = self.zk.ensemble.followers()
        if not followers:
            return {"error": "no follower"}
        return self._zk_node_down("zk_follower_kill", [random.choice(followers)], random.uniform(2, 5))

    def fault_zk_quorum_loss(self) -> dict[str, Any]:
        ens = self.zk.ensemble
        leader, followers = ens.leader(), ens.followers()
        if leader is None or not followers:
            return {"error": f"not serving: {ens.modes()}"}
        # Two of three down (the leader among them), for longer than a session: scanning stops, then resumes.
        return self._zk_node_down("zk_quorum_loss", [leader, random.choice(followers)],
                                  self.args.zk_session + random.uniform(1, 4))

    # --- partitions: the dropping proxies

    def fault_scanner_zk_cut(self) -> dict[str, Any]:
        """A scanner cut off from ZooKeeper (every node), not from PostgreSQL, for two
        session timeouts: it must stop scanning within its session timeout."""
        names = [n for n in self.fleet.names("scanner") if self._owned_now(n)] or self.fleet.names("scanner")
        name = random.choice(names)
        owned = self._owned_now(name)
        at = time.time()
        for proxy in self.zk_proxies[name]:
            proxy.drop()
        self.zk_faults.append({"kind": "scanner_zk_cut", "at": at})
        stopped = _wait_until(lambda: not self._owned_now(name), self.args.zk_session + 10, default=None)
        time.sleep(max(0.0, at + 2 * self.args.zk_session - time.time()))
        still = sorted(self._owned_now(name))  # scanning while cut off past its session: a finding
        for proxy in self.zk_proxies[name]:
            proxy.restore()
        cut = {"at": at, "name": name, "owned": sorted(owned), "stopped_at": stopped, "scanning_at_restore": still}
        self.scanner_cuts.append(cut)
        return {"scanner": name, "owned": sorted(owned),
                "stopped_scanning_s": round(stopped - at, 2) if stopped else None, "scanning_at_restore": still,
                "cut_s": round(time.time() - at, 1)}

    def fault_worker_pg_cut(self) -> dict[str, Any]:
        """A worker cut off from PostgreSQL in the middle of a call, past its lease: the call
        lands, its outcome cannot be written; another worker takes the run over, and the
        late outcome, held in the link, is refused by the fence once the link is back."""
        name, running = self._worker_mid_call()
        proxy = self.pg_proxies[name]
        at = proxy.drop()
        self.worker_losses.append({"kind": "worker_pg_cut", "at": at, "runs": running})
        cut_for = self.args.lease + 2 * self.args.scan_interval + 1.5
        time.sleep(cut_for)
        proxy.restore()
        return {"worker": name, "runs_in_flight": len(running), "cut_s": cut_for}

    # --- server restarts

    def fault_pg_restart(self) -> dict[str, Any]:
        """The soak's private PostgreSQL restarted: a fast shutdown, or its postmaster
        killed (crash recovery), in turn."""
        from django.db import connections

        killed = sum(1 for f in self.flow_faults if f["kind"] == "pg_restart") % 2 == 1
        began, up = (self.pg.restart_killed if killed else self.pg.restart_fast)(hold=random.uniform(0, 2))
        connections.close_all()  # the driver's own connection died with the server
        self.flow_faults.append({"kind": "pg_restart", "at": began, "up": up})
        return {"how": "kill -9 postmaster" if killed else "fast shutdown", "down_s": round(up - began, 2)}

    def fault_redis_restart(self) -> dict[str, Any]:
        assert self.redis is not None
        began, up = self.redis.restart(hold=random.uniform(0, 2))
        self.flow_faults.append({"kind": "redis_restart", "at": began, "up": up})
        return {"down_s": round(up - began, 2)}

    def fault_broker_restart(self) -> dict[str, Any]:
        """RabbitMQ closes every connection of the soak's vhost, as a broker restart does
        to its clients (tests/reliability/test_broker_restart.py); the machine's broker is
        never stopped."""
        before = len(self.rabbit.connections())
        at = time.time()
        self.rabbit.close_connections("soak broker restart")
        self.flow_faults.append({"kind": "broker_restart", "at": at, "up": time.time()})
        return {"connections_closed": before}

    def fault_broker_purge(self) -> dict[str, Any]:
        """Every message of the run queue lost (the AMQP analogue of redis_flush)."""
        listed = self.rabbit.ctl("list_queues", "--no-table-headers", "-p", self.rabbit.name, "name", "messages")
        waiting = next((int(n) for name, n in (line.split() for line in listed.splitlines() if len(line.split()) == 2)
                        if name == RUN_QUEUE and n.isdigit()), 0)
        self.rabbit.ctl("purge_queue", "-p", self.rabbit.name, RUN_QUEUE)
        # Messages a worker has taken and not acked are not in the queue's count, nor purged.
        return {"messages": waiting}

    def fault_pg_terminate(self) -> dict[str, Any]:
        assert self.fleet is not None
        names = self.fleet.names("worker")
        deadline = time.monotonic() + 15  # a worker whose processes hold no connection now has nothing to end
        while True:
            random.shuffle(names)
            for name in names:
                ended = self.dbs.terminate(f"soak-{name}")
                if ended:
                    return {"worker": name, "connections": ended}
            if time.monotonic() > deadline:
                return {"worker": "", "connections": 0}
            time.sleep(0.2)

    def _misbehave(self, mode: str, seconds: float) -> dict[str, Any]:
        assert self.target is not None
        port = random.choice(self.target.ports)
        self.modes[port] = {"mode": mode, "until": time.time() + seconds, "slow_s": 3}
        self.target.set_modes(self.modes)
        return {"host": f"127.0.0.1:{port}", "for_s": round(seconds, 1)}

    def fault_target_slow(self) -> dict[str, Any]:
        return self._misbehave("slow", random.uniform(8, 15))

    def fault_target_errors(self) -> dict[str, Any]:
        return self._misbehave("error", random.uniform(10, 20))

    def _memory_groups(self) -> dict[str, list[tuple[str, int]]]:
        """The processes whose memory is sampled, by kind (bench/memory.py)."""
        assert self.fleet is not None and self.target is not None
        groups: dict[str, list[tuple[str, int]]] = defaultdict(list)
        for name, proc in self.fleet.procs.items():
            label = f"{name}.{proc.generation}"
            if name.startswith("scanner"):
                groups["scanner"].append((label, proc.pid))
                continue
            groups["worker_parent"].append((label, proc.pid))
            groups["worker_child"] += [(f"{label}-child", pid) for pid in group_pids(proc.pid) if pid != proc.pid]
        if self.target.proc is not None:
            master = self.target.proc.pid
            groups["target"] += [("target-master" if pid == master else "target-worker", pid)
                                 for pid in group_pids(master)]
        if self.redis is not None:
            groups["redis"].append(("redis", self.redis.proc.pid))
        if self.api is not None and self.api.proc is not None:
            master = self.api.proc.pid
            groups["api"] += [("api-master" if pid == master else "api-worker", pid) for pid in group_pids(master)]
        groups["zookeeper"] += [(f"zookeeper-{pid}", pid) for pid in self.zk.pids()]
        return groups

    def _owned_now(self, name: str) -> set[int]:
        assert self.fleet is not None
        lines = PARTITION_LINE.findall(self.fleet.procs[name].output())
        return {int(p) for p in lines[-1][0].split(",") if p.strip()} if lines else set()

    # ----------------------------------------------------------------- settle and measure

    def settle(self) -> None:
        self.faults_ended = time.time()
        self.stop_stream.set()
        assert self.fleet is not None and self.target is not None
        self.modes = {}
        self.target.set_modes({})
        # Every process the soak killed it restarted at once: one that is down now died by itself.
        self.unexpected_exits = [p.name for p in self.fleet.procs.values() if not p.alive()]
        self.fleet.heal()
        self.zk.start()  # a no-op when ours is up
        settle = self.args.settle if not self.stopped_early else min(self.args.settle, 20)
        time.sleep(settle)

    def measure(self) -> dict[str, Any]:
        from django.conf import settings
        from django.db import close_old_connections

        from runs import invariants
        from runs.models import BreakerTransition, Run
        from bench.timelines import timelines_by_id

        self.memory.stop()
        measured_at = time.time()
        # Everything stops before anything is read: the store and the target's records are then
        # one still picture (a run that succeeds between two reads would look unapplied). The
        # target flushes its last batch of records as it stops.
        assert self.fleet is not None and self.target is not None
        self.fleet.stop_all()
        self.target.stop()
        if self.api is not None:
            self.api.stop()
        close_old_connections()
        cutoff = utc(measured_at - self.args.margin)
        small = Run.objects.select_related("job")
        if self.load_range is not None:  # the load jobs' runs are judged in SQL (bench/soak_load.py)
            small = small.exclude(job_id__gte=self.load_range[0], job_id__lte=self.load_range[1])
        runs = {r.pk: r for r in small}
        # The timelines read in Python: the small jobs' runs, and the runs a worker had in flight
        # when it was lost (for the handover times). Under load, that is not every run.
        wanted: list[int] | None = None  # every run's timeline
        if self.load_range is not None:
            lost = {run_id for loss in self.worker_losses for run_id, _ in loss["runs"]}
            wanted = list(runs) + sorted(lost)
        timeline: dict[int, list[tuple[datetime, str, dict[str, Any]]]] = defaultdict(list)
        for run_id, entries in timelines_by_id(run_ids=wanted).items():  # rows and the entries on the run rows
            timeline[run_id] += [(e.at, e.type, e.detail or {}) for e in entries]

        due, lateness, lateness_plain = [], [], []
        for run in runs.values():
            events = timeline[run.pk]
            first_due = next((_parse(d.get("due_at")) for _, t, d in events if t == "scheduled"), None) or run.scheduled_for
            if run.status == Run.Status.CANCELLED or first_due > cutoff:
                continue
            due.append(run)
            deferred = any(t in DEFERRALS for _, t, _ in events)
            claimed = [at for at, t, _ in events if t == "claimed"]
            # Backfills are late on purpose, and a run a pause held waited on purpose.
            if claimed and not run.is_backfill and not any(t == "held" for _, t, _ in events):
                late = (claimed[0] - (run.scheduled_for + timedelta(seconds=run.job.window_seconds))).total_seconds()
                lateness.append((late, run.public_id))
                if not deferred:
                    lateness_plain.append((late, run.public_id))
        # Missed: against the reference schedule, which follows each user action (bench/soak_actions.py).
        assert self.actions is not None
        facts = [run_facts(run, timeline[run.pk], cutoff, DEFERRALS) for run in runs.values()]
        reference = judge(self.actions.histories, facts, cutoff, settings.SCHEDULER_MISFIRE_GRACE,
                          retried=self.actions.retried)
        missed = reference.pop("missed")
        started_paused = reference.pop("started_while_paused_or_deleted")

        applied = [invariants.Applied(key, fence) for key, fence in self.dbs.target_rows("SELECT key, fence FROM soak_effects")]
        calls = dict(self.dbs.target_rows("SELECT outcome, count(*) FROM soak_calls GROUP BY outcome"))
        if self.load_range is None:
            twice = invariants.effects_applied_once(applied)
            recorded_twice = recorded_applied_twice(timeline)
        else:  # every run, set-based: the target's table grouped by key, the store's events in one statement
            twice = [f"{key} applied {n} times, under fences {fences}" for key, n, fences in self.dbs.target_rows(
                "SELECT key, count(*), array_agg(fence ORDER BY fence) FROM soak_effects GROUP BY key"
                " HAVING count(*) > 1 ORDER BY key")]
            recorded_twice = soak_load.recorded_applied_twice()
        load = None
        if self.load_range is not None:
            assert self.load_first is not None
            # The steady span: from a minute after the first runs (the scanners and workers warm, the
            # first minute's backlog gone) to the end of the faults.
            steady = (self.load_first + timedelta(seconds=min(60.0, self.args.duration / 3)), utc(self.faults_ended))
            load = soak_load.accounting(lo=self.load_range[0], hi=self.load_range[1], first=self.load_first,
                                        window_s=self.args.load_window, cutoff=cutoff, steady=steady)
        violations = {
            "one open run per job": invariants.one_open_run_per_job(),
            "kept_for follows the status": invariants.kept_for_rule(),
            "timelines in order": invariants.timelines(),
            "due runs terminal or running": invariants.due_runs_settled(cutoff=cutoff),
            "succeeded runs applied": invariants.succeeded_runs_applied(applied),
            "scanning stopped when cut off from ZooKeeper": self._kept_scanning(),
        }
        superseded = [v for v in violations["timelines in order"] if "written under fence" in v]
        status = Counter(r.status for r in due)
        dead_why = Counter(_reason(r.last_error) for r in due if r.status == Run.Status.DEAD)
        for error, n in (load.pop("dead_errors") if load else []):
            dead_why[_reason(error or "")] += n
        event_counts = Counter(soak_load.event_counts())  # every run's events, counted in SQL
        breaker = Counter(BreakerTransition.objects.values_list("state", flat=True))
        report = {
            "started_at": utc(self.started).isoformat(), "faults_ended_at": utc(self.faults_ended).isoformat(),
            "measured_at": utc(measured_at).isoformat(), "cutoff": cutoff.isoformat(),
            "stopped_early": self.stopped_early,
            "runs_due": len(due) + (load["due_times"] if load else 0),
            "started": sum(1 for r in due if r.started_at is not None) + (load["started"] if load else 0),
            "succeeded": status[Run.Status.SUCCEEDED] + (load["statuses"].get("succeeded", 0) if load else 0),
            "dead": status[Run.Status.DEAD] + (load["statuses"].get("dead", 0) if load else 0),
            "dead_reasons": dict(dead_why),
            "open_at_end": sum(status[s] for s in Run.OPEN) + (sum(load["statuses"].get(s, 0) for s in Run.OPEN)
                                                               if load else 0),
            "missed": len(missed) + (load["missed"] if load else 0),
            "missed_runs": (missed + (load["missed_runs"] if load else []))[:50], "reference": reference,
            "load": load,
            "started_while_paused_or_deleted": len(started_paused),
            "started_while_paused_or_deleted_runs": started_paused[:50],
            "effects_applied": len(applied), "effects_applied_twice": len(twice), "applied_twice": twice[:50],
            "recorded_applied_twice": len(recorded_twice), "recorded_twice": recorded_twice[:50],
            "calls": calls,
            "stale_writes_rejected": event_counts["stale_write_rejected"],
            "misfired": event_counts["misfired"],
            # Published again (a lost message, or one still waiting after SCHEDULER_REQUEUE_AFTER),
            # and leases taken back: how much recovery work the faults made.
            "requeued": event_counts["requeued"], "queued": event_counts["queued"],
            "leases_taken_back": event_counts["lease_expired"],
            "bulkhead_waits": event_counts["bulkhead_wait"], "breaker_holds": event_counts["held_by_breaker"],
            "breaker_transitions": dict(breaker),
            "invariant_violations": sum(len(v) for v in violations.values()),
            "outcomes_under_superseded_fence": len(superseded),
            "violations": {k: v[:50] for k, v in violations.items() if v},
            "lateness_past_window_s": _lateness(lateness), "lateness_without_holds_s": _lateness(lateness_plain),
            "faults": dict(Counter(f["kind"] for f in self.faults)),
            "faults_that_hit": dict(Counter(f["kind"] for f in self.faults if f["hit"])), "fault_log": self.faults,
            "user_actions": {k: sum(1 for f in self.faults if f["kind"] == k) for k in USER_KINDS},
            "user_actions_that_hit": {k: sum(1 for f in self.faults if f["kind"] == k and f["hit"]) for k in USER_KINDS},
            "handover": self.handovers(timeline),
        }
        report["unexpected_exits"] = self.unexpected_exits
        report["memory"] = self.memory.report()
        report["spared_from_kills"] = sorted(self.spared)
        report["api_answers"] = dict(self.api.answered) if self.api is not None else None
        if self.args.max_rate:  # offered above capacity: a backlog, late and unstarted runs, on purpose
            report["highest_sustained_rate"] = load["steady"]["started_per_s"] if load else None
        broken = report["invariant_violations"]
        if self.args.max_rate:  # the backlog leaves due runs waiting: that one invariant is not asked here
            broken -= len(violations["due runs terminal or running"])
        report["ok"] = not ((report["missed"] and not self.args.max_rate) or report["effects_applied_twice"]
                            or report["recorded_applied_twice"] or broken
                            or report["started_while_paused_or_deleted"] or self.unexpected_exits)
        return report

    # ----------------------------------------------------------------- handovers

    def handovers(self, timeline: dict[int, list[tuple[datetime, str, dict[str, Any]]]]) -> dict[str, Any]:
        worker: dict[str, list[float]] = defaultdict(list)
        slowest: dict[str, Any] = {}  # the run that took longest, with its timeline after the loss
        for loss in self.worker_losses:
            lost_at = utc(loss["at"])
            for run_id, fence in loss["runs"]:
                later = [(at, t, d) for at, t, d in timeline[run_id] if at >= lost_at]
                again = next((at for at, t, d in later if t == "claimed" and d.get("fence", 0) > fence), None)
                if again is None:
                    continue
                # A run its target's breaker or bulkhead held meanwhile waited on purpose: not a handover time.
                held = any(t in DEFERRALS and at < again for at, t, _ in later)
                took = (again - lost_at).total_seconds()
                worker[loss["kind"] + ("_held" if held else "")].append(took)
                if took > slowest.get("took_s", -1):
                    slowest = {"took_s": round(took, 2), "kind": loss["kind"], "run": run_id, "fence": fence,
                               "lost_at": lost_at.isoformat(), "after_loss": [
                                   (round((at - lost_at).total_seconds(), 3), t, d) for at, t, d in later if at <= again]}
        return {
            "slowest_worker_handover": slowest,
            "worker_death_to_run_claimed_s": _stats(worker["worker_kill"]),
            "worker_frozen_to_run_claimed_s": _stats(worker["worker_stop"]),
            "runs_held_by_breaker_or_bulkhead_meanwhile": len(worker["worker_kill_held"] + worker["worker_stop_held"]
                                                              + worker["worker_pg_cut_held"]),
            "scanner_death_to_partitions_scanned_s": _stats(self._scanner_handovers(survivor_scanning=True)),
            "scanner_death_without_a_scanning_survivor_s": _stats(self._scanner_handovers(survivor_scanning=False)),
            "zookeeper_restart_to_all_partitions_scanned_s": _stats(self._zk_handovers()),
            "worker_cut_from_pg_to_run_claimed_s": _stats(worker["worker_pg_cut"]),
            "scanner_cut_from_zk_to_stopped_scanning_s": _stats(
                [c["stopped_at"] - c["at"] for c in self.scanner_cuts if c["stopped_at"]]),
            "scanner_cut_from_zk_to_partitions_scanned_by_others_s": _stats(self._cut_handovers()),
            **{f"{kind}_partitions_unscanned_s": _stats(self._gaps(kind)) for kind in ZK_GAP_KINDS
               if kind in self.kinds},
            **{f"{kind}_to_runs_flowing_s": _stats(self._flowing(kind)) for kind in FLOW_KINDS if kind in self.kinds},
        }

    def _kept_scanning(self) -> list[str]:
        """A scanner cut off from ZooKeeper, or left without a quorum, must stop scanning
        within its session timeout (+ 1 s: the soak reads its lines every 0.1 s, and the
        server expires sessions on its tick), and not scan again while it is cut off."""
        bound = self.args.zk_session + 1
        found = []
        for cut in self.scanner_cuts:
            took = cut["stopped_at"] - cut["at"] if cut["stopped_at"] else None
            if took is None or took > bound:
                found.append(f"{cut['name']} cut off from ZooKeeper at {utc(cut['at']):%H:%M:%S} stopped scanning "
                             + (f"after {took:.2f} s (bound {bound:g} s)" if took else "never"))
            if cut["scanning_at_restore"]:
                found.append(f"{cut['name']} cut off from ZooKeeper scanned {cut['scanning_at_restore']} when its "
                             "link came back")
        for fault in self.faults:
            if fault["kind"] == "zk_quorum_loss" and "error" not in fault:
                took = fault.get("scanning_stopped_everywhere_s")
                if took is None or took > bound:
                    found.append(f"ZooKeeper quorum lost at {utc(fault['at']):%H:%M:%S}: scanning stopped everywhere "
                                 + (f"after {took} s (bound {bound:g} s)" if took is not None else "never"))
        return found

    def _cut_handovers(self) -> list[float]:
        times = []
        for cut in self.scanner_cuts:
            if cut["owned"]:
                at = self._covered_at(cut["at"], set(cut["owned"]))
                if at is not None:
                    times.append(at - cut["at"])
        return times

    def _gaps(self, kind: str, window: float = 60) -> list[float]:
        """For each fault of `kind`: for how long, in the `window` seconds after it (or until
        the next ZooKeeper fault), some partition had no live scanner owning it."""
        from scanners.coordination import all_partitions

        every = set(all_partitions())
        starts = sorted(f["at"] for f in self.zk_faults)
        died = {f"{d['name']}.{d['generation']}": d["at"] for d in self.scanner_deaths}
        lines = self._ownership()
        gaps = []
        for fault in (f for f in self.zk_faults if f["kind"] == kind):
            since = fault["at"]
            until = min([since + window] + [t for t in starts if t > since])
            owned: dict[str, set[int]] = {}
            uncovered, gap_from = 0.0, None
            for at, proc, parts in lines:
                if at > until:
                    break
                owned[proc] = parts
                if at <= since:
                    continue
                alive = [p for name, p in owned.items() if died.get(name, float("inf")) > at]
                covered = every <= set().union(*alive)
                if not covered and gap_from is None:
                    gap_from = at
                elif covered and gap_from is not None:
                    uncovered += at - gap_from
                    gap_from = None
            if gap_from is not None:
                uncovered += until - gap_from
            gaps.append(uncovered)
        return gaps

    def _flowing(self, kind: str) -> list[float]:
        times = []
        for fault in (f for f in self.flow_faults if f["kind"] == kind):
            again = soak_load.flowing_again(utc(fault["at"]))
            if again is not None:
                times.append(again.timestamp() - fault["at"])
        return times

    def _ownership(self) -> list[tuple[float, str, set[int]]]:
        """Every 'partitions [...] at T' line of every scanner process, oldest first."""
        assert self.fleet is not None
        lines = []
        for name in self.fleet.names("scanner"):
            for proc in self.fleet.all_generations(name):
                for parts, at in PARTITION_LINE.findall(proc.output()):
                    lines.append((float(at), f"{name}.{proc.generation}", {int(p) for p in parts.split(",") if p.strip()}))
        return sorted(lines, key=lambda line: line[0])

    def _covered_at(self, since: float, wanted: set[int], fresh: bool = False) -> float | None:
        """The first moment after `since` at which live scanners own all of `wanted`.

        A process counts with its latest line, from the moment it printed it until it
        was killed; with `fresh`, only lines printed after `since` count (after a
        ZooKeeper restart, what a scanner owned before means nothing)."""
        died = {f"{d['name']}.{d['generation']}": d["at"] for d in self.scanner_deaths}
        owned: dict[str, set[int]] = {}
        for at, proc, parts in self._ownership():
            if fresh and at < since:
                continue
            owned[proc] = parts
            alive = [p for name, p in owned.items() if died.get(name, float("inf")) > at]
            if at >= since and wanted <= set().union(*alive):
                return at
        return None

    def _scanner_handovers(self, survivor_scanning: bool) -> list[float]:
        times = []
        for death in self.scanner_deaths:
            if death["owned"] and death["survivor_scanning"] == survivor_scanning:
                at = self._covered_at(death["at"], set(death["owned"]))
                if at is not None:
                    times.append(at - death["at"])
        return times

    def _zk_handovers(self) -> list[float]:
        from scanners.coordination import all_partitions

        every = set(all_partitions())
        times = []
        for stopped in self.zk_restarts:
            at = self._covered_at(stopped, every, fresh=True)
            if at is not None:
                times.append(at - stopped)
        return times


def recorded_applied_twice(timeline: dict[int, list[tuple[datetime, str, dict[str, Any]]]]) -> list[str]:
    """Runs the store records as applied under two different fences: the scheduler's
    side of "effects applied twice", whatever the target did with the calls.

    A fence is recorded as applied when the store took a success under it (a
    `succeeded` event), or when the holder of the run's latest claim got a 2xx
    (`target_answered`): the current holder's success is one the store must take.
    A correct store has at most one such fence per run: it takes a success only
    from the holder of the latest claim, and a run that succeeded is never claimed
    again. A superseded holder's 2xx (its call landed, or was replayed, before its
    lease was taken over) is refused and does not count. Events in id order."""
    found = []
    for run_id, events in timeline.items():
        claims = [d["fence"] for _, t, d in events if t == "claimed" and isinstance(d.get("fence"), int)]
        latest = max(claims, default=None)
        fences = {d["fence"] for _, t, d in events if t == "succeeded" and isinstance(d.get("fence"), int)}
        fences |= {d["fence"] for _, t, d in events if t == "target_answered" and latest is not None
                   and d.get("fence") == latest and isinstance(d.get("status"), int) and 200 <= d["status"] < 300}
        if len(fences) > 1:
            succeeded = sorted(d.get("fence") for _, t, d in events if t == "succeeded")
            found.append(f"run_{run_id} recorded as applied under fences {sorted(fences)} "
                         f"(succeeded under {succeeded}, latest claim {latest})")
    return found


def _wait_until(predicate: Any, timeout: float, default: Any = TimeoutError) -> Any:
    """time.time() once `predicate()` holds; at the timeout, raise (or return `default`)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            if default is TimeoutError:
                raise TimeoutError(f"not within {timeout}s")
            return default
        time.sleep(0.1)
    return time.time()


def _hit(kind: str, detail: dict[str, Any]) -> bool:
    """Whether a fault found its mark: a call in flight, a connection, a run, partitions."""
    if "error" in detail:
        return False
    mark = {"worker_kill": "runs_in_flight", "worker_stop": "runs_in_flight", "pg_terminate": "connections",
            "duplicate_delivery": "runs", "scanner_kill": "owned", "worker_pg_cut": "runs_in_flight",
            "scanner_zk_cut": "owned", "broker_purge": "messages"}.get(kind)
    return mark is None or bool(detail.get(mark))


def _parse(text: Any) -> datetime | None:
    if not isinstance(text, str):
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _reason(error: str) -> str:
    # "out of tries after 6 attempts: HTTP 503: {...}" -> "out of tries after N attempts: HTTP 503"
    short = re.sub(r"\d+(?:\.\d+)?s\b", "Ns", error.split(": {")[0])
    return re.sub(r"after \d+ attempts", "after N attempts", short)[:90]


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "min": round(min(values), 2), "median": round(statistics.median(values), 2),
            "max": round(max(values), 2)}


def _lateness(values: list[tuple[float, str]]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * (len(ordered) - 1)))][0]
    return {"n": len(values), "max": round(ordered[-1][0], 2), "run": ordered[-1][1], "p99": round(p99, 2)}


def _fault_count(report: dict[str, Any], kind: str) -> str:
    n, hit = report["faults"].get(kind, 0), report["faults_that_hit"].get(kind, 0)
    return str(n) if n == hit else f"{n} ({n - hit} found nothing to hit)"


def machine() -> dict[str, Any]:
    with open("/proc/meminfo") as f:
        mem_kb = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    return {"nproc": os.cpu_count(), "memory_gib": round(mem_kb / 1024 / 1024, 1),
            "python": platform.python_version(), "kernel": platform.release()}


def memory_row(found: dict[str, Any], baseline_s: float) -> str:
    end, growth = found["rss_kib_at_end"], found["max_rss_growth_pct"]
    shown = f"RSS {end['median'] / 1024:.1f} MiB at the end (median)" if end else "RSS -"
    return (f"{shown}, {found['processes']} processes, most growth from {baseline_s:g} s "
            + (f"{growth:+.1f}%" if growth is not None else "-"))


def table(report: dict[str, Any], args: argparse.Namespace) -> str:
    def span(s: dict[str, Any]) -> str:
        return f"n={s['n']}" if not s.get("n") else f"median {s['median']} s, max {s['max']} s (min {s['min']}, n={s['n']})"

    late, plain = report["lateness_past_window_s"], report["lateness_without_holds_s"]
    rows = [
        ("runs due", report["runs_due"]),
        ("started", report["started"]),
        ("succeeded", report["succeeded"]),
        ("dead", report["dead"]),
        *[(f"  dead: {why}", n) for why, n in sorted(report["dead_reasons"].items())],
        ("still open (retrying or running)", report["open_at_end"]),
        ("times due (reference schedule, after each edit)", report["reference"]["due_times"]),
        ("  started", report["reference"]["due_times_started"]),
        ("  skipped on resume (misfire policy)", report["reference"]["skipped_after_pause"]),
        ("  skipped: the job's run before was in flight (overlap policy skip)",
         report["reference"]["skipped_while_in_flight"]),
        ("  ended or held by a user action in time", report["reference"]["excused_by_user_action"]),
        ("  fell while paused, never resumed (not due)", report["reference"]["paused_at_end"]),
        ("extra runs due (backfill, run now) / started",
         f"{report['reference']['extra_runs_due']} / {report['reference']['extra_runs_started']}"),
        ("dead runs retried / started again",
         f"{report['reference'].get('retried_dead', 0)} / {report['reference'].get('retried_dead_started', 0)}"),
        *([("load: offered", f"{args.rate} runs/s ({report['load']['jobs']} every-minute jobs, window "
                             f"{report['load']['window_s']} s)"),
           ("load: times due / started / missed", f"{report['load']['due_times']} / {report['load']['started']} / "
                                                  f"{report['load']['missed']}"),
           ("load: lateness past the window", "max {max} s, p99 {p99} s, p50 {p50} s".format(
               **report["load"]["lateness_past_window_s"])),
           ("load: started per second, steady span", "{started_per_s} ({started} in {seconds} s)".format(
               **report["load"]["steady"])),
           ("load: start lag (first attempts)", "p50 {p50} s, p99 {p99} s, max {max} s".format(
               **report["load"]["steady"]["start_lag_s"]))] if report.get("load") else []),
        ("missed (due, never started)", report["missed"]),
        ("runs started while paused or deleted", report["started_while_paused_or_deleted"]),
        ("effects applied twice at the target", report["effects_applied_twice"]),
        ("runs recorded as applied under two fences", report["recorded_applied_twice"]),
        ("effects applied", report["effects_applied"]),
        ("target calls", ", ".join(f"{k} {v}" for k, v in sorted(report["calls"].items()))),
        ("stale writes rejected", report["stale_writes_rejected"]),
        ("late runs (misfired, run anyway)", report["misfired"]),
        ("published again (requeued) / queued", f"{report['requeued']} / {report['queued']}"),
        ("leases taken back", report["leases_taken_back"]),
        ("outcomes written under a superseded fence", report["outcomes_under_superseded_fence"]),
        ("invariant violations", report["invariant_violations"]),
        ("largest lateness past the window", f"{late.get('max', '-')} s (p99 {late.get('p99', '-')} s)"),
        ("  without bulkhead/breaker holds", f"{plain.get('max', '-')} s (p99 {plain.get('p99', '-')} s)"),
        ("bulkhead waits / breaker holds", f"{report['bulkhead_waits']} / {report['breaker_holds']}"),
        ("breaker transitions", ", ".join(f"{k} {v}" for k, v in sorted(report["breaker_transitions"].items())) or "none"),
        *[(f"fault: {kind}", _fault_count(report, kind)) for kind in KINDS if kind in args.kinds.split(",")],
        *[(f"user action: {kind[5:]}", _fault_count(report, kind)) for kind in USER_KINDS if report["faults"].get(kind)],
        ("processes that died by themselves", ", ".join(report["unexpected_exits"]) or "none"),
    ]
    h = report["handover"]
    rows += [
        ("handover: worker killed -> run claimed again", span(h["worker_death_to_run_claimed_s"])),
        ("handover: worker frozen -> run claimed again", span(h["worker_frozen_to_run_claimed_s"])),
        ("handover: scanner killed -> its partitions scanned", span(h["scanner_death_to_partitions_scanned_s"])),
        ("  killed while no other scanner was scanning", span(h["scanner_death_without_a_scanning_survivor_s"])),
        ("handover: ZooKeeper restart -> all partitions scanned", span(h["zookeeper_restart_to_all_partitions_scanned_s"])),
        ("handover: worker cut from PostgreSQL -> run claimed again", span(h["worker_cut_from_pg_to_run_claimed_s"])),
        ("scanner cut from ZooKeeper -> it stopped scanning", span(h["scanner_cut_from_zk_to_stopped_scanning_s"])),
        ("  -> its partitions scanned by the others", span(h["scanner_cut_from_zk_to_partitions_scanned_by_others_s"])),
        *[(f"{key[:-2].replace('_', ' ')}", span(v)) for key, v in sorted(h.items())
          if key.endswith(("_partitions_unscanned_s", "_to_runs_flowing_s"))],
    ]
    rows += [(f"memory: {kind}", memory_row(found, report["memory"]["baseline_s"]))
             for kind, found in sorted(report["memory"]["kinds"].items())]
    width = max(len(k) for k, _ in rows)
    head = (f"soak: {args.duration:g} s of faults + {args.settle:g} s settle, lease {args.lease} s, scan "
            f"{args.scan_interval:g} s, requeue after {args.requeue_after} s, ZooKeeper session {args.zk_session:g} s"
            f" (tick {ZK_TICK_S:g} s), {args.scanners} scanners, {args.workers} workers x {args.concurrency}"
            + (", DELIBERATE FENCE BUG ON" if args.inject_bug else ""))
    lines = [head, "-" * len(head)] + [f"{k:<{width}}  {v}" for k, v in rows]
    if "highest_sustained_rate" in report:
        lines.append(f"{'highest sustained rate (runs/s)':<{width}}  {report['highest_sustained_rate']} "
                     f"(offered {args.rate}/s)")
    lines.append(f"{'result':<{width}}  {'PASS' if report['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.seed is not None:
        random.seed(args.seed)

    def give_up(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the soak was ended by signal {signum}")

    signal.signal(signal.SIGALRM, give_up)
    signal.signal(signal.SIGTERM, give_up)
    signal.alarm(int(args.duration + args.settle + 600))
    soak = Soak(args)
    print(f"soak: logs in {soak.workdir}", flush=True)
    try:
        soak.up()
        soak.make_load()
        soak.inject()
        soak.settle()
        report = soak.measure()
    finally:
        signal.alarm(0)
        soak.down()
    report.update({"machine": machine(), "args": vars(args), "workdir": str(soak.workdir)})
    text = table(report, args)
    report["table"] = text
    print("\n" + text, flush=True)
    for name, found in report["violations"].items():
        print(f"\n{name}:\n  " + "\n  ".join(found[:10]))
    if report["missed_runs"]:
        print("\nmissed:\n  " + "\n  ".join(report["missed_runs"][:10]))
    if report["started_while_paused_or_deleted_runs"]:
        print("\nstarted while paused or deleted:\n  " + "\n  ".join(report["started_while_paused_or_deleted_runs"][:10]))
    if report["applied_twice"]:
        print("\napplied twice at the target:\n  " + "\n  ".join(report["applied_twice"][:10]))
    if report["recorded_twice"]:
        print("\nrecorded as applied under two fences:\n  " + "\n  ".join(report["recorded_twice"][:10]))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    print(f"\nsummary: {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
