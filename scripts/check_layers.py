"""The house's layers, read from its imports: `python scripts/check_layers.py`.

Reads every product module of the four apps (jobs, runs, scanners,
scheduler_project; migrations and management commands aside, which sit on top),
counting imports inside functions as well as at the top, since they are
dependencies all the same, and prints

- each loop of imports among the modules (a strongly connected group),
- each pair of apps that import each other, directly or through a third,
- each module over MAX_LINES lines.

Exit status 1 when any is found, so CI and a reviewer can run it as a check.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPS = ("jobs", "runs", "scanners", "scheduler_project")
MAX_LINES = 800


def product_modules() -> dict[str, Path]:
    found = {}
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if "migrations" in parts or "management" in parts:
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """The product modules `path` imports, anywhere in it (`from runs import services`
    names the module runs.services; `from runs.services import x` too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively: the groups of nodes that reach each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def main() -> int:
    modules = product_modules()
    known = set(modules)
    graph = {name: imports_of(path, name, known) for name, path in modules.items()}
    problems = 0
    for group in strongly_connected(graph):
        problems += 1
        print(f"import loop among {len(group)} modules:")
        for member in group:
            inside = sorted(graph[member] & set(group))
            print(f"  {member} -> {', '.join(inside)}")
    apps = {app: set() for app in APPS}
    for name, targets in graph.items():
        for target in targets:
            a, b = name.split(".")[0], target.split(".")[0]
            if a != b:
                apps[a].add(b)
    for group in strongly_connected(apps):
        problems += 1
        print(f"apps importing each other: {' <-> '.join(group)}")
        for app in group:
            print(f"  {app} -> {', '.join(sorted(apps[app] & set(group)))}")
    for name, path in sorted(modules.items()):
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            problems += 1
            print(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_LINES})")
    print(f"{len(modules)} modules, {sum(len(t) for t in graph.values())} imports: "
          f"{'no loops, no module over ' + str(MAX_LINES) + ' lines' if not problems else str(problems) + ' problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
