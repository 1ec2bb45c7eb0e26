"""Draw a soak's memory samples (bench/soak.py's JSON, `memory`): one panel per process
kind, a line per process (RSS solid, PSS dotted), MiB against minutes.

    .venv/bin/python bench/plot_memory.py bench/results/soak.json [--out docs/img/soak-memory.png]

matplotlib (bench/requirements.txt).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("scanner", "worker_parent", "worker_child", "target", "redis")


def series(memory: dict) -> dict[str, dict[str, list[tuple[float, int, int | None]]]]:
    """kind -> process -> [(t, rss_kib, pss_kib)]."""
    found: dict[str, dict[str, list[tuple[float, int, int | None]]]] = defaultdict(lambda: defaultdict(list))
    for sample in memory["samples"]:
        for proc, values in sample["processes"].items():
            found[values["kind"]][proc].append((sample["t"], values["rss_kib"], values["pss_kib"]))
    return found


def plot(report: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = report["memory"]
    by_kind = series(memory)
    kinds = [k for k in KINDS if k in by_kind] + sorted(set(by_kind) - set(KINDS))
    fig, axes = plt.subplots(len(kinds), 1, figsize=(9, 2.3 * len(kinds)), sharex=True, squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        for proc, points in sorted(by_kind[kind].items()):
            t = [p[0] / 60 for p in points]
            line, = ax.plot(t, [p[1] / 1024 for p in points], linewidth=0.9, label=proc.rsplit("/", 1)[0])
            if any(p[2] is not None for p in points):
                ax.plot(t, [(p[2] or 0) / 1024 for p in points], linestyle=":", linewidth=0.9, color=line.get_color())
        growth = memory["kinds"].get(kind, {}).get("max_rss_growth_pct")
        ax.set_title(f"{kind}: RSS (solid), PSS (dotted)"
                     + (f"; most growth {growth:+.1f}% from {memory['baseline_s'] / 60:.1f} min" if growth is not None
                        else ""), fontsize=9)
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        if len(by_kind[kind]) <= 6:
            ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("minutes into the soak")
    fig.suptitle(f"memory per process, sampled every {memory['every_s']:g} s "
                 f"({report.get('args', {}).get('duration', '?')} s soak)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="a soak's JSON (bench/soak.py --json)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "img" / "soak-memory.png"))
    args = parser.parse_args(argv)
    report = json.loads(Path(args.json).read_text())
    if "memory" not in report:
        print(f"{args.json} has no memory samples (a soak from before bench/memory.py)", file=sys.stderr)
        return 1
    print("written", plot(report, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
