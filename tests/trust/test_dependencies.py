"""Known vulnerabilities in the pinned runtime requirements, by pip-audit.

It reports what it finds (printed, `pytest -s` or -rA shows it). When the
advisory database cannot be reached, or answers for none of the pins, the test
is skipped with the reason: a machine without that service must still be able
to run the suite. When it can be reached, a pin with a known vulnerability
fails the test: bump the pin (pip-audit prints the fixed versions), or, when
there is no fix yet and the risk is understood, add the advisory's id to
ACKNOWLEDGED with why.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PIP_AUDIT = Path(sys.executable).with_name("pip-audit")
# advisory id -> why it is accepted for now (and until when).
ACKNOWLEDGED: dict[str, str] = {}


@dataclass
class AuditOutcome:
    reachable: bool
    reason: str = ""
    audited: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    vulnerabilities: list[str] = field(default_factory=list)  # "name version: ID (fixed in ...)"


def run_pip_audit(requirements: Path, env: dict[str, str] | None = None, cache: Path | None = None) -> AuditOutcome:
    # --no-deps: requirements.txt pins every package, so nothing needs resolving (or installing).
    extra = ["--cache-dir", str(cache)] if cache else []
    result = subprocess.run(
        [str(PIP_AUDIT), "-r", str(requirements), "--no-deps", "--disable-pip", "--progress-spinner", "off",
         "--format", "json", "--timeout", "15", *extra],
        capture_output=True, text=True, timeout=300, env=env,
    )
    try:
        report = json.loads(result.stdout)
    except ValueError:
        lines = result.stderr.strip().splitlines() or ["no output"]
        return AuditOutcome(reachable=False, reason=lines[-1][:300])
    return _outcome(report)


def _outcome(report: dict[str, Any]) -> AuditOutcome:
    outcome = AuditOutcome(reachable=True)
    for dependency in report.get("dependencies", []):
        pin = " ".join(filter(None, [dependency["name"], dependency.get("version")]))
        if dependency.get("skip_reason"):
            outcome.skipped.append(f"{pin}: {dependency['skip_reason']}")
            continue
        outcome.audited.append(pin)
        for vulnerability in dependency.get("vulns", []):
            if vulnerability["id"] in ACKNOWLEDGED:
                continue
            fixed = ", ".join(vulnerability.get("fix_versions", [])) or "no fix yet"
            outcome.vulnerabilities.append(f"{pin}: {vulnerability['id']} (fixed in {fixed})")
    if not outcome.audited:
        outcome.reachable = False
        outcome.reason = f"none of the {len(outcome.skipped)} pins could be audited ({outcome.skipped[0]})"
    return outcome


def test_the_pinned_requirements_have_no_known_vulnerability() -> None:
    assert PIP_AUDIT.exists(), "pip-audit is not installed: pip install -r requirements-dev.txt"

    outcome = run_pip_audit(ROOT / "requirements.txt")

    print(f"pip-audit: audited {len(outcome.audited)}, could not audit {len(outcome.skipped)}")
    for line in outcome.skipped + outcome.vulnerabilities:
        print(f"  {line}")
    if not outcome.reachable:
        pytest.skip(f"the advisory database could not be reached: {outcome.reason}")
    assert not outcome.vulnerabilities, "known vulnerabilities:\n" + "\n".join(outcome.vulnerabilities)


def test_an_unreachable_advisory_database_is_reported_not_failed(tmp_path: Path) -> None:
    assert PIP_AUDIT.exists(), "pip-audit is not installed: pip install -r requirements-dev.txt"
    dead_proxy = "http://127.0.0.1:9"  # nothing listens on the discard port
    env = {**os.environ, "HTTPS_PROXY": dead_proxy, "HTTP_PROXY": dead_proxy, "NO_PROXY": ""}
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("requests==2.34.2\n")

    outcome = run_pip_audit(requirements, env, cache=tmp_path / "cache")  # no cached answers either

    assert not outcome.reachable and outcome.reason


def test_a_reported_vulnerability_is_listed_with_its_fix() -> None:
    report = {"dependencies": [
        {"name": "django", "version": "5.2.0", "vulns": [{"id": "PYSEC-0000-1", "fix_versions": ["5.2.1"]}]},
        {"name": "kazoo", "version": "2.11.0", "vulns": []},
    ]}

    outcome = _outcome(report)

    assert outcome.reachable and outcome.vulnerabilities == ["django 5.2.0: PYSEC-0000-1 (fixed in 5.2.1)"]
