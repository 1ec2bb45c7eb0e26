"""The memory of each process kind, sampled while a soak runs (bench/soak.py).

Every `every` seconds, for every process of every kind (a scanner; a worker's parent
and its prefork children; the target's gunicorn master and worker; the soak's Redis),
its resident set (VmRSS in /proc/PID/status) and, where /proc/PID/smaps_rollup is
readable, its proportional set (Pss: pages shared with the other children of a fork
counted once across them, so a worker's children do not count the parent's pages
again). A process is named by its soak name, generation and pid: a restarted worker
is a new process.

    sampler = MemorySampler(lambda: {"scanner": [(name, pid), ...], ...}, every=15)
    sampler.start(); ...; sampler.stop(); report = sampler.report()

`report()` has every sample, and per kind the growth of each process that lived
through the measured span: from its first sample at or after `baseline_s` (5
minutes, or half the soak when shorter) to its last.
"""
from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

Groups = Callable[[], dict[str, list[tuple[str, int]]]]  # kind -> [(process name, pid)]
WARM_UP_S = 300  # the "after the first 5 minutes"


def memory_kib(pid: int) -> tuple[int | None, int | None]:
    """(RSS, PSS) in KiB; None where the process is gone or the file unreadable."""
    rss = pss = None
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), None)
    except OSError:
        return None, None
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            pss = next((int(line.split()[1]) for line in f if line.startswith("Pss:")), None)
    except OSError:
        pass
    return rss, pss


class MemorySampler:
    def __init__(self, groups: Groups, every: float = 15) -> None:
        self.groups, self.every = groups, every
        self.samples: list[dict[str, Any]] = []
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self.started = time.time()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.sample()  # the last word, at the end

    def _run(self) -> None:
        self.sample()
        while not self._stop.wait(self.every):
            self.sample()

    def sample(self) -> None:
        t = round(time.time() - self.started, 1)
        processes = {}
        try:
            groups = self.groups()
        except Exception as exc:  # a fleet changing under us: the next sample
            self.samples.append({"t": t, "error": repr(exc), "processes": {}})
            return
        for kind, members in groups.items():
            for name, pid in members:
                rss, pss = memory_kib(pid)
                if rss is not None:
                    processes[f"{name}/{pid}"] = {"kind": kind, "rss_kib": rss, "pss_kib": pss}
        self.samples.append({"t": t, "processes": processes})

    def report(self, baseline_s: float | None = None) -> dict[str, Any]:
        span = self.samples[-1]["t"] if self.samples else 0.0
        baseline_s = baseline_s if baseline_s is not None else min(WARM_UP_S, span / 2)
        series: dict[str, list[tuple[float, dict[str, Any]]]] = defaultdict(list)
        for sample in self.samples:
            for proc, values in sample["processes"].items():
                series[proc].append((sample["t"], values))
        kinds: dict[str, Any] = defaultdict(lambda: {"processes": 0, "growth": []})
        for proc, points in series.items():
            kind = points[0][1]["kind"]
            kinds[kind]["processes"] += 1
            after = [(t, v) for t, v in points if t >= baseline_s]
            # Lived through the span: sampled at the baseline (within one period) and at the end.
            if len(after) < 2 or after[0][0] > baseline_s + self.every + 1 or after[-1][0] < span - self.every - 1:
                continue
            (t0, first), (t1, last) = after[0], after[-1]
            kinds[kind]["growth"].append({
                "process": proc, "from_s": t0, "to_s": t1,
                "rss_kib": [first["rss_kib"], last["rss_kib"]], "rss_growth_pct": _pct(first["rss_kib"], last["rss_kib"]),
                "pss_kib": [first["pss_kib"], last["pss_kib"]], "pss_growth_pct": _pct(first["pss_kib"], last["pss_kib"]),
            })
        for kind, found in kinds.items():
            growth = [g["rss_growth_pct"] for g in found["growth"] if g["rss_growth_pct"] is not None]
            last = [v["rss_kib"] for v in self.samples[-1]["processes"].values() if v["kind"] == kind] \
                if self.samples else []
            found["rss_kib_at_end"] = {"median": statistics.median(last), "max": max(last)} if last else None
            found["max_rss_growth_pct"] = max(growth) if growth else None
        return {"every_s": self.every, "baseline_s": round(baseline_s, 1), "span_s": span,
                "kinds": dict(kinds), "samples": self.samples}


def _pct(first: int | None, last: int | None) -> float | None:
    return None if not first or last is None else round(100 * (last - first) / first, 1)
