"""Service tokens are stored only as a hash, shown once when made, listed in the admin
by prefix and dates only; a service may hold several, each revocable; the embedded
SQLite file and its WAL are private to the account that runs the scheduler."""
from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.contrib import admin
from django.core.management import call_command
from django.db import connection
from django.test import Client
from rest_framework.test import APIClient

from tests.conftest import Service
from tests.integration.conftest import ROOT

pytestmark = pytest.mark.django_db


def created_token(name: str, capsys: pytest.CaptureFixture[str]) -> str:
    call_command("create_service_token", name)
    out = capsys.readouterr().out
    assert out.endswith("\n") and out.count("\n") == 1, out  # only the token on stdout
    return out.strip()


def api(token: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return client


def every_stored_text() -> str:
    """Every row of every table, as text: what a database dump would show."""
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        rows = []
        for table in connection.introspection.table_names():
            cursor.execute(f"SELECT * FROM {quote(table)}")  # noqa: S608 (table names from introspection)
            rows.extend(repr(row) for row in cursor.fetchall())
    return "\n".join(rows)


def test_a_service_token_is_stored_only_as_a_hash_nowhere_in_clear(capsys: pytest.CaptureFixture[str]) -> None:
    token = created_token("reports", capsys)

    assert len(token) >= 40
    stored = every_stored_text()
    assert token not in stored
    assert token[8:] not in stored  # not even the secret part past the shown prefix
    assert hashlib.sha256(token.encode()).hexdigest() in stored  # what is stored instead
    jobs = api(token).get("/api/jobs/")
    assert jobs.status_code == 200 and jobs.json()["count"] == 0


def test_the_admin_shows_a_tokens_prefix_and_dates_and_never_the_token(
    superuser: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    token = created_token("reports", capsys)
    client = Client()
    client.force_login(superuser)

    seen = []
    for model, model_admin in admin.site._registry.items():
        meta = model._meta
        listing = client.get(f"/admin/{meta.app_label}/{meta.model_name}/")
        seen.append(listing.content.decode())
        for obj in model_admin.get_queryset(listing.wsgi_request)[:20]:
            seen.append(client.get(f"/admin/{meta.app_label}/{meta.model_name}/{obj.pk}/change/").content.decode())
    pages = "\n".join(seen)
    assert token not in pages and token[8:] not in pages
    tokens_page = client.get("/admin/jobs/servicetoken/").content.decode()
    assert token[:8] in tokens_page and "reports" in tokens_page


def test_each_create_makes_a_new_token_and_the_earlier_ones_keep_working(capsys: pytest.CaptureFixture[str]) -> None:
    first = created_token("reports", capsys)
    second = created_token("reports", capsys)

    assert first != second
    assert api(first).get("/api/jobs/").status_code == 200
    assert api(second).get("/api/jobs/").status_code == 200


def test_rotate_makes_a_new_token_and_revokes_every_other(capsys: pytest.CaptureFixture[str]) -> None:
    first, second = created_token("reports", capsys), created_token("reports", capsys)

    call_command("rotate_service_token", "reports")
    new = capsys.readouterr().out
    assert new.endswith("\n") and new.count("\n") == 1
    new = new.strip()

    assert new not in (first, second)
    for old in (first, second):
        refused = api(old).get("/api/jobs/")
        assert refused.status_code == 401 and refused["WWW-Authenticate"] == "Token"
    assert api(new).get("/api/jobs/").status_code == 200


def test_revoke_revokes_every_token_of_the_service_and_no_other(
    capsys: pytest.CaptureFixture[str], other_service: Service
) -> None:
    first, second = created_token("reports", capsys), created_token("reports", capsys)

    call_command("revoke_service_token", "reports")
    assert capsys.readouterr().out.strip() == "reports: revoked 2 API tokens"

    assert [api(t).get("/api/jobs/").status_code for t in (first, second)] == [401, 401]
    assert other_service.get("/api/jobs/").status_code == 200


def test_a_token_is_shown_once_and_making_one_is_audited(capsys: pytest.CaptureFixture[str]) -> None:
    from jobs.models import AuditEntry

    token = created_token("reports", capsys)

    entries = list(AuditEntry.objects.filter(object_type="service", object_id="reports").values_list("action", "detail"))
    assert [action for action, _ in entries] == ["token_created", "created"]
    assert entries[0][1] == {"prefix": token[:8]}
    assert token not in every_stored_text()


def test_a_bad_token_with_a_known_prefix_is_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    token = created_token("reports", capsys)
    forged = token[:8] + ("A" if token[8] != "A" else "B") + token[9:]

    refused = api(forged).get("/api/jobs/")

    assert refused.status_code == 401 and refused["WWW-Authenticate"] == "Token"
    assert "detail" in refused.json()


def test_a_legacy_authtoken_key_is_converted_to_a_hash_and_keeps_working(transactional_db: None) -> None:
    """A database from before: DRF authtoken's table with a key in clear. The migration
    turns every key into a hashed row and drops that table: old tokens keep working."""
    from django.db.migrations.executor import MigrationExecutor

    from jobs.tokens import token_digest

    before = [("jobs", "0002_signingsecret_auditentry")]
    executor = MigrationExecutor(connection)
    executor.migrate(before)
    old_apps = executor.loader.project_state(before).apps
    user = old_apps.get_model("auth", "User").objects.create(username="legacy", password="!")
    old_apps.get_model("jobs", "ServiceAccount").objects.create(user=user)
    key = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:  # rest_framework.authtoken's table, as its migrations left it
        cursor.execute(
            "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created timestamp with time zone NOT NULL,"
            " user_id integer NOT NULL UNIQUE)"
            if connection.vendor == "postgresql"
            else "CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, created datetime NOT NULL, user_id integer NOT NULL UNIQUE)"
        )
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, %s, %s)", [key, "2026-01-02T03:04:05+00:00", user.pk])

    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes())

    assert "authtoken_token" not in connection.introspection.table_names()
    assert key not in every_stored_text() and token_digest(key) in every_stored_text()
    assert api(key).get("/api/jobs/").status_code == 200


@pytest.mark.embedded
def test_the_embedded_sqlite_file_and_its_wal_are_private(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "CELERY_BROKER_URL", "SECRET_KEY")}
    env["SCHEDULER_DATA_DIR"] = str(tmp_path / "var")
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    data = tmp_path / "var"
    # While a process has the file open in WAL mode, SQLite makes the -wal and -shm
    # files with the database file's own mode: a private file gives private companions.
    reader = sqlite3.connect(data / "scheduler.sqlite3")
    try:
        reader.execute("PRAGMA journal_mode=WAL")
        reader.execute("CREATE TABLE IF NOT EXISTS wal_probe (x)")
        reader.execute("INSERT INTO wal_probe VALUES (1)")
        reader.commit()
        private = [data / name for name in ("scheduler.sqlite3", "scheduler.sqlite3-wal", "scheduler.sqlite3-shm", "secret_key")]
        modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in private}
    finally:
        reader.close()
    assert modes == {p.name: "0o600" for p in private}
