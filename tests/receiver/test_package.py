"""The receiver helper is a package of its own (packages/scheduler-receiver): it
builds as a wheel, installs into a fresh virtualenv without the scheduler, and its
own tests pass there (Django targets, and plain WSGI/ASGI targets without Django)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packages" / "scheduler-receiver"


def run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, f"{' '.join(argv)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_receiver_package_installs_into_a_fresh_virtualenv_and_its_tests_pass_there(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    run([sys.base_prefix + "/bin/python3", "-m", "venv", str(venv)], tmp_path, 60)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-q"]
    # Built from a copy: a build leaves build/ and *.egg-info behind in its source.
    source = tmp_path / "source"
    shutil.copytree(PACKAGE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    run([*pip, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(source)], tmp_path, 120)
    [wheel] = (tmp_path / "dist").glob("scheduler_receiver-*.whl")
    run([*pip, "install", f"{wheel}[test]"], tmp_path, 180)

    # The tests run from a copy, away from the source: what they import is the installed wheel.
    work = tmp_path / "work"
    shutil.copytree(PACKAGE / "tests", work / "tests")
    shutil.copy(PACKAGE / "pyproject.toml", work / "pyproject.toml")
    python = str(venv / "bin" / "python")
    where = run([python, "-c", "import receiver; print(receiver.__file__)"], work, 30).stdout.strip()
    assert where.startswith(str(venv)), where
    for name in ("scheduler_project", "runs", "jobs"):  # the scheduler is not there
        probe = subprocess.run([python, "-c", f"import {name}"], cwd=work, capture_output=True, timeout=30)
        assert probe.returncode != 0, f"{name} importable in the fresh virtualenv"

    tests = run([str(venv / "bin" / "pytest"), "-q"], work, 120)
    assert " passed" in tests.stdout and "failed" not in tests.stdout and "error" not in tests.stdout, tests.stdout
