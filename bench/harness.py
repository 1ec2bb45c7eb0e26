"""The production layout for benches: a bench database, a Redis db, a ZooKeeper of
its own, scanner and worker processes, a no-op target, and CPU accounting.

Everything runs on loopback, every process started here is ended here by its id,
and every wait is bounded.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
BENCH_DB = os.environ.get("BENCH_DB", "sched_bench")
PG = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
REDIS_DB = os.environ.get("BENCH_REDIS_DB", "8")
ZK_PORT = int(os.environ.get("BENCH_ZK_PORT", "21812"))
# The no-op targets listen on BENCH_TARGET_PORT and the next few ports (one per scenario),
# so two benches with their own BENCH_TARGET_PORT can run side by side.
TARGET_PORT_BASE = int(os.environ.get("BENCH_TARGET_PORT", "18081"))
# Where write_result puts the JSON; bench/baseline.py points it at a scratch directory.
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR") or ROOT / "bench" / "results")
TICKS = os.sysconf("SC_CLK_TCK")


def target_port(offset: int) -> int:
    """The port of a scenario's target: sustained and spike 0, failover 1, beat 2."""
    return TARGET_PORT_BASE + offset


def bench_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # Only what a scenario sets on purpose: issue 17's figures are taken with the default
    # scan interval, so one left in the shell must not leak into them.
    env.pop("SCHEDULER_SCAN_INTERVAL", None)
    env.update(
        {
            "DATABASE_URL": f"{PG}/{BENCH_DB}",
            "SECRET_KEY": "bench-only-secret-key-0123456789abcdefghijklmnopqrstuvwxyz",
            "CELERY_BROKER_URL": f"redis://127.0.0.1:6379/{REDIS_DB}",
            "ZOOKEEPER_HOSTS": f"127.0.0.1:{ZK_PORT}",
            "SCHEDULER_ZK_ROOT": "/scheduler-bench",
            "SCHEDULER_LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.update(extra)
    return env


def scan_interval_env(value: str | None) -> dict[str, str]:
    """SCHEDULER_SCAN_INTERVAL only when the scenario was given --scan-interval."""
    return {"SCHEDULER_SCAN_INTERVAL": value} if value else {}


def setup_django(**extra: str) -> None:
    """Point this process at the bench database and set Django up."""
    os.environ.update(bench_env(**extra))
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "scheduler_project.settings")
    import django

    django.setup()


def machine() -> dict[str, Any]:
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "cpu": model,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def sh(*argv: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=kwargs.pop("timeout", 600), **kwargs)


def psql(sql: str, db: str = "postgres") -> str:
    return sh("psql", f"{PG}/{db}", "-Atc", sql).stdout.strip()


def reset_database() -> None:
    psql(f"DROP DATABASE IF EXISTS {BENCH_DB} WITH (FORCE)")
    psql(f"CREATE DATABASE {BENCH_DB}")
    sh(PY, "manage.py", "migrate", "-v", "0", cwd=ROOT, env=bench_env())


def reset_redis() -> None:
    sh("redis-cli", "-n", REDIS_DB, "FLUSHDB")


def start_zookeeper() -> None:
    sh("bash", str(ROOT / "scripts" / "zookeeper.sh"), "start", str(ZK_PORT), f"/tmp/scheduler-zookeeper-bench-{ZK_PORT}")


def stop_zookeeper() -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "zookeeper.sh"), "stop", str(ZK_PORT), f"/tmp/scheduler-zookeeper-bench-{ZK_PORT}"],
        capture_output=True, timeout=60,
    )


def proc_cpu_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # utime, stime, cutime, cstime (children already reaped count in c*)
        return (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / TICKS
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == pgid:
                    pids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    return pids


def named_pids(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm") as f:
                    if f.read().strip() == name:
                        pids.append(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return pids


def cpu_of(pids: list[int]) -> float:
    return sum(proc_cpu_seconds(p) for p in pids)


class Proc:
    """One process and its group (a prefork worker's children too), logging to a file
    of its own; ended only by its own process group id. `generation` counts restarts
    (the soak's), each with its own log; `kind` groups CPU figures (the benches')."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, generation: int = 1,
                 kind: str = "") -> None:
        self.name, self.argv, self.env, self.log_dir, self.generation = name, argv, env, log_dir, generation
        self.kind = kind or name
        self.log_path = log_dir / f"{name}.{generation}.log"
        self.started_at = time.time()
        with open(self.log_path, "wb") as log:
            self.popen = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.stopped = False  # SIGSTOPped (the soak's freeze)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def cpu(self) -> float:
        return cpu_of(group_pids(self.pid))

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)
        self.stopped = True

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)
        self.stopped = False

    def stop(self, grace: float = 10) -> None:
        if self.alive():
            self.thaw()
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # leftovers of the group, if any
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Layout:
    """The processes of one bench run."""

    env: dict[str, str]
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="sched-bench-")))
    procs: list[Proc] = field(default_factory=list)

    def start(self, kind: str, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, env or self.env, self.workdir, kind=kind)
        self.procs.append(proc)
        return proc

    def scanner(self, name: str = "scanner-1", env: dict[str, str] | None = None) -> Proc:
        return self.start("scanner", name, [PY, "manage.py", "scanner", "--identifier", name], env)

    def worker(self, name: str = "worker-1", concurrency: int = 4, pool: str = "prefork", extra: list[str] | None = None,
               env: dict[str, str] | None = None) -> Proc:
        argv = [PY, "-m", "celery", "-A", "scheduler_project", "worker", "-l", "WARNING", "-c", str(concurrency),
                "-P", pool, "-n", f"{name}@%h", "--without-heartbeat", "--without-gossip", "--without-mingle"]
        return self.start("worker", name, argv + (extra or []), env)

    def target(self, port: int, delay_ms: float = 0.0) -> Proc:
        argv = [PY, str(ROOT / "bench" / "noop_target.py"), "--port", str(port), "--delay-ms", str(delay_ms),
                "--log", str(self.workdir / f"arrivals-{port}.csv")]
        proc = self.start("target", f"target-{port}", argv)
        wait_for(lambda: "listening" in proc.output(), 10, "the target to listen")
        return proc

    def arrivals(self, port: int) -> list[tuple[float, int]]:
        path = self.workdir / f"arrivals-{port}.csv"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                at, run_id = line.split(",", 1)
                if run_id.startswith("run_"):
                    rows.append((float(at), int(run_id[4:])))
        return rows

    def cpu_by_kind(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for proc in self.procs:
            totals[proc.kind] = totals.get(proc.kind, 0.0) + proc.cpu()
        totals["postgres"] = cpu_of(named_pids("postgres"))
        totals["redis"] = cpu_of(named_pids("redis-server"))
        return totals

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop(grace=15)

    def cleanup(self) -> None:
        self.stop_all()
        shutil.rmtree(self.workdir, ignore_errors=True)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


_last_handed_out = 0


def free_port() -> int:
    """A loopback port nothing listens on. With BENCH_PORTS=LO-HI (a machine shared by
    several runs, each given a range), the next free one of the range after the last
    this process handed out (round the range, so that one not bound yet is not handed
    out twice in a row); otherwise any the kernel picks."""
    global _last_handed_out
    lo, _, hi = os.environ.get("BENCH_PORTS", "").partition("-")
    if not lo:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    ports = list(range(int(lo), int(hi or lo) + 1))
    start = ports.index(_last_handed_out) + 1 if _last_handed_out in ports else 0
    for port in ports[start:] + ports[:start]:
        with socket.socket() as s:
            # As the servers bind (SO_REUSEADDR): a port that a closed connection left in
            # TIME_WAIT is free for them; one a server listens on is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _last_handed_out = port
        return port
    raise RuntimeError(f"no free port left in BENCH_PORTS={lo}-{hi}")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, int(round(q / 100 * (len(ordered) - 1)))))
    return ordered[index]


def tree_commit() -> str:
    """The commit of the code under test (bench/baseline.py exports a tree without .git)."""
    if os.environ.get("BENCH_TREE_COMMIT"):
        return os.environ["BENCH_TREE_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    if done.returncode:
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, timeout=30).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def write_result(scenario: str, summary: dict[str, Any]) -> Path:
    """bench/results/<scenario>.json; a `baseline` already in the file (bench/baseline.py's) is kept."""
    out = RESULTS_DIR / f"{scenario}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"scenario": scenario, "machine": machine(), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "commit": tree_commit(), "load_average_at_end": load_average(), **summary}
    if out.exists() and "baseline" not in summary:
        try:
            previous = json.loads(out.read_text())
        except ValueError:
            previous = {}
        if isinstance(previous, dict) and "baseline" in previous:
            summary["baseline"] = previous["baseline"]
    out.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return out


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    print("-" * (width + 24))
    for key, value in rows:
        shown = f"{value:,.3f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")
