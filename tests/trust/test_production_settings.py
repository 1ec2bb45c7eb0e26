"""The production layout (DATABASE_URL set) is safe by default: `check --deploy` is
clean once TLS is in front, and the project refuses to start with DEBUG on or no
SECRET_KEY, saying why. And a system check refuses TIME_ZONE other than UTC."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from django.core.checks import run_checks
from django.test import override_settings

from scheduler_project.checks import durations_parse, time_zone_is_utc
from tests.trust.conftest import production_env

ROOT = Path(__file__).resolve().parents[2]


def manage(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, capture_output=True, text=True,
        env=production_env(**env), timeout=120,
    )


def test_check_deploy_with_tls_in_front_reports_no_warning() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", SCHEDULER_BEHIND_TLS_PROXY="1")

    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues (0 silenced)." in result.stdout


def test_check_deploy_with_gunicorn_serving_tls_itself_reports_no_warning() -> None:
    result = manage("check", "--deploy", "--fail-level", "WARNING", SCHEDULER_SSL_REDIRECT="1")

    assert result.returncode == 0, result.stdout + result.stderr


def test_without_tls_the_only_deploy_warning_is_the_missing_https_redirect() -> None:
    # Cookies are secure and HSTS is on by default; plain http itself is what is left.
    result = manage("check", "--deploy")

    assert result.returncode == 0
    assert "security.W008" in result.stderr
    assert [line for line in result.stderr.splitlines() if "security.W" in line and "W008" not in line] == []


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"DEBUG": "1"}, "DEBUG=1 is refused in the production layout"),
        ({"SECRET_KEY": ""}, "SECRET_KEY is required when DATABASE_URL is set"),
    ],
)
def test_the_production_layout_refuses_to_start_unsafe_and_says_why(env: dict[str, str], words: str) -> None:
    result = manage("check", **env)

    assert result.returncode != 0
    # Django prints the traceback of the settings import; its last line is the reason.
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("django.core.exceptions.ImproperlyConfigured: ") and words in last


def test_a_bad_tls_setting_is_refused_in_words() -> None:
    result = manage("check", SCHEDULER_BEHIND_TLS_PROXY="maybe")

    assert result.returncode != 0 and "SCHEDULER_BEHIND_TLS_PROXY must be 1 or 0" in result.stderr


@override_settings(TIME_ZONE="Asia/Kolkata")
def test_a_time_zone_other_than_utc_is_a_system_check_error() -> None:
    [error] = time_zone_is_utc()

    assert error.id == "scheduler.E001" and "Asia/Kolkata" in error.msg
    assert "scheduler.E001" in {message.id for message in run_checks()}


def test_utc_passes_the_time_zone_check() -> None:
    assert time_zone_is_utc() == []


@override_settings(SCHEDULER_MIN_INTERVAL="5 minutes", SCHEDULER_SIGNING_OVERLAP="1d")
def test_a_duration_setting_that_does_not_parse_is_a_system_check_error() -> None:
    [error] = durations_parse()

    assert error.id == "scheduler.E002" and error.msg.startswith("SCHEDULER_MIN_INTERVAL:")
