"""Run a scenario on an older commit's code, with today's bench, for a result's `baseline`.

    python bench/baseline.py 40a7cbc idle --minutes 5
    python bench/baseline.py 40a7cbc sustained --rate 10 --minutes 2 --out-name sustained-10

Exports COMMIT's tree (`git archive`, so no worktree is registered) into a directory
under /tmp, copies today's bench/ over its own (the harness, the scenarios, the
loaders; not bench/results), links this tree's .venv, and runs
`python bench/run.py SCENARIO ARGS...` there, against that commit's manage.py, models
and processes. Each JSON the run writes goes under the `baseline` key of the file of
the same name in this tree's bench/results/ (the rest of that file is left as it is,
and a later run of the scenario here keeps the `baseline`).

The bench's loaders read the models of the tree they run in (bench/load.py fills every
column it is not given with the model's default), so they fit an older schema as long
as it has the columns they name; the run fails loudly where it does not.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def export_tree(commit: str, keep: bool) -> Path:
    tree = Path(tempfile.mkdtemp(prefix=f"sched-baseline-{commit}-"))
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True,
                             timeout=300)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=300)
    overlay_bench(tree)
    (tree / ".venv").symlink_to((ROOT / ".venv").resolve())
    print(f"{commit} exported to {tree}" + (" (kept)" if keep else ""), flush=True)
    return tree


def overlay_bench(tree: Path) -> None:
    """Today's bench code over the old one; results and caches stay behind."""
    for path in (ROOT / "bench").rglob("*"):
        relative = path.relative_to(ROOT / "bench")
        if relative.parts[0] in ("results", "__pycache__") or "__pycache__" in relative.parts or path.is_dir():
            continue
        dest = tree / "bench" / relative
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)


def run_scenario(tree: Path, commit: str, argv: list[str], scratch: Path) -> int:
    env = dict(os.environ, BENCH_RESULTS_DIR=str(scratch), BENCH_TREE_COMMIT=commit)
    python = tree / ".venv" / "bin" / "python"
    return subprocess.run([str(python), str(tree / "bench" / "run.py"), *argv], cwd=tree, env=env).returncode


def merge_baselines(scratch: Path) -> list[Path]:
    written = []
    for result in sorted(scratch.glob("*.json")):
        baseline: dict[str, Any] = json.loads(result.read_text())
        baseline["tree"] = "exported by bench/baseline.py, today's bench/ copied over it"
        out = RESULTS / result.name
        current: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"scenario": baseline.get("scenario")}
        current["baseline"] = baseline
        out.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
        written.append(out)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commit", help="the commit to measure, e.g. 40a7cbc")
    parser.add_argument("--keep", action="store_true", help="leave the exported tree in /tmp")
    parser.add_argument("scenario_args", nargs=argparse.REMAINDER, help="SCENARIO [ARGS...], as for bench/run.py")
    args = parser.parse_args()
    if not args.scenario_args:
        parser.error("name a scenario, e.g. `idle` or `sustained --rate 10`")
    commit = subprocess.run(["git", "rev-parse", "--short", "--verify", f"{args.commit}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    tree = export_tree(commit, args.keep)
    scratch = Path(tempfile.mkdtemp(prefix="sched-baseline-results-"))
    try:
        code = run_scenario(tree, commit, args.scenario_args, scratch)
        if code:
            print(f"the scenario failed on {commit} (exit {code}); nothing written", file=sys.stderr)
            return code
        for out in merge_baselines(scratch):
            print(f"written {out} (under `baseline`, {commit})")
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(tree, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
