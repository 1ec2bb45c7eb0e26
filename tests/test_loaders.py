"""scheduler_project.loaders: times and JSON read from PostgreSQL are decoded by
psycopg's C loaders, and come back as Django's own would give them."""
from __future__ import annotations

import datetime

import psycopg
import pytest
from django.db import connection
from psycopg.pq import Format

from jobs.services import service_account_ensure
from runs.models import Run
from tests.factories import make_job, make_run

pytestmark = pytest.mark.skipif(connection.vendor != "postgresql", reason="PostgreSQL's loaders")

TIMESTAMPTZ_OID = psycopg.postgres.types["timestamptz"].oid
JSONB_OID = psycopg.postgres.types["jsonb"].oid


def text_loader(oid: int) -> type:
    connection.ensure_connection()
    return connection.connection.adapters.get_loader(oid, Format.TEXT)


def test_a_new_store_connection_decodes_times_and_json_with_psycopgs_c_loaders(db: None) -> None:
    # Django's own timestamptz loader is a Python subclass of psycopg's pure-Python one;
    # psycopg's C classes live in psycopg_binary (or psycopg_c).
    assert psycopg.pq.__impl__ != "python"
    times = text_loader(TIMESTAMPTZ_OID)
    assert times.__module__ == "scheduler_project.loaders"
    assert type(times(TIMESTAMPTZ_OID, connection.connection).load).__module__ != "psycopg.types.datetime"
    assert text_loader(JSONB_OID).__module__.startswith(("psycopg_binary", "psycopg_c"))


def test_times_read_back_are_utc_as_djangos_loader_made_them(db: None) -> None:
    owner, _ = service_account_ensure(name="loaders")
    due = datetime.datetime(2026, 3, 8, 7, 0, 0, 123456, tzinfo=datetime.timezone.utc)
    run = make_run(make_job(owner, name="loaders"), due)
    read = Run.objects.get(pk=run.pk)
    assert read.due_at == due
    assert read.due_at.tzinfo is datetime.timezone.utc  # the object Django's loader sets
    with connection.cursor() as cursor:
        cursor.execute("SELECT timestamptz '2026-11-01 05:30:00+00', timestamptz '1970-01-01 00:00:00.5+00', NULL::timestamptz")
        found = cursor.fetchone()
    assert found == (datetime.datetime(2026, 11, 1, 5, 30, tzinfo=datetime.timezone.utc),
                     datetime.datetime(1970, 1, 1, 0, 0, 0, 500000, tzinfo=datetime.timezone.utc), None)
    assert all(t.tzinfo is datetime.timezone.utc for t in found[:2])


def test_json_fields_read_back_as_written(db: None) -> None:
    owner, _ = service_account_ensure(name="loaders")
    job = make_job(owner, name="loaders", payload={"ünïcode": ["é", 1, None, {"x": 1.5}]})
    job.refresh_from_db()
    assert job.payload == {"ünïcode": ["é", 1, None, {"x": 1.5}]}


def test_a_cursor_keeps_the_fast_loader(db: None) -> None:
    # Django's create_cursor puts its own loader on a cursor whose connection's
    # loader names another time zone; ours names UTC, so a cursor keeps it.
    with connection.cursor() as cursor:
        assert cursor.cursor.adapters.get_loader(TIMESTAMPTZ_OID, Format.TEXT).__module__ == "scheduler_project.loaders"
