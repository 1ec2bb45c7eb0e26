"""Run.kept_for, the key the history of ended runs is partitioned by (issue 18): the
store keeps it OPEN_KEPT_FOR while a run is open and its scheduled time once it has
ended, whichever way the row is written (migration runs 0014)."""
from __future__ import annotations

import importlib
from datetime import timedelta

import pytest
from django.db import IntegrityError, connection, transaction

from runs import invariants
from runs.models import OPEN_KEPT_FOR, Run, kept_for_of
from tests.factories import make_job, make_run, utc

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]

T = utc("2026-03-01T09:00:00Z")
S = Run.Status


def kept_for(run: Run) -> object:
    return Run.objects.values_list("kept_for", flat=True).get(pk=run.pk)


def test_an_insert_takes_the_key_of_its_status_one_row_or_in_bulk() -> None:
    job = make_job()
    open_run = make_run(job, T)
    skipped = make_run(job, T + timedelta(minutes=1), status=S.SKIPPED)
    bulk = Run.objects.bulk_create([
        Run(job=job, scheduled_for=T + timedelta(minutes=m), due_at=T, partition=0, status=status)
        for m, status in ((2, S.CANCELLED), (3, S.SKIPPED))
    ])
    assert kept_for(open_run) == OPEN_KEPT_FOR
    assert kept_for(skipped) == T + timedelta(minutes=1)
    assert sorted(Run.objects.filter(pk__in=[r.pk for r in bulk]).values_list("kept_for", flat=True)) == [
        T + timedelta(minutes=2), T + timedelta(minutes=3)]


def test_an_update_that_does_not_name_it_moves_it_both_ways() -> None:
    run = make_run(make_job(), T)
    Run.objects.filter(pk=run.pk).update(status=S.QUEUED)
    assert kept_for(run) == OPEN_KEPT_FOR
    Run.objects.filter(pk=run.pk).update(status=S.DEAD, finished_at=T)
    assert kept_for(run) == T
    # A requeued dead run is open again: back to the open key.
    Run.objects.filter(pk=run.pk).update(status=S.SCHEDULED, finished_at=None)
    assert kept_for(run) == OPEN_KEPT_FOR
    Run.objects.filter(pk=run.pk).update(status=S.CANCELLED)
    Run.objects.filter(pk=run.pk).update(scheduled_for=T + timedelta(hours=1))
    assert kept_for(run) == T + timedelta(hours=1)
    # A save of a stale copy (read while it was open) writes the key of what it saves.
    run.status = S.SUCCEEDED
    run.save()
    assert kept_for(run) == run.scheduled_for == T
    assert invariants.kept_for_rule() == []


def test_a_write_that_names_a_wrong_key_is_put_right_or_refused() -> None:
    run = make_run(make_job(), T)
    Run.objects.filter(pk=run.pk).update(kept_for=T)
    assert kept_for(run) == OPEN_KEPT_FOR
    if connection.vendor != "postgresql":
        return
    # An insert that bypasses the model (raw SQL) with the wrong key: the check refuses it.
    with pytest.raises(IntegrityError, match="runs_kept_for_rule"), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO runs (job_id, scheduled_for, due_at, partition, status, held, attempt, attempt_base,"
                " fence, lease_owner, last_error, is_backfill, detached, handled_by, created_at, on_row,"
                " on_row_worker, kept_for) SELECT job_id, scheduled_for + interval '1 day', due_at, partition,"
                " 'succeeded', held, 0, 0, 0, '', '', false, false, '', created_at, 0, '', %s FROM runs WHERE id = %s",
                [OPEN_KEPT_FOR, run.pk],
            )


def test_the_invariant_names_a_row_whose_key_broke_the_rule() -> None:
    job = make_job()
    good = make_run(job, T, status=S.SUCCEEDED)
    bad = make_run(job, T + timedelta(minutes=1))
    # What a store without its check (and, on SQLite, its trigger) would let through
    # from a statement written by hand.
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # the inserts' deferred key checks, first
            cursor.execute("ALTER TABLE runs DROP CONSTRAINT runs_kept_for_rule")
        else:
            cursor.execute("DROP TRIGGER runs_kept_for_update")
    try:
        with connection.cursor() as cursor:
            cursor.execute("UPDATE runs SET status = 'dead' WHERE id = %s", [bad.pk])
        assert invariants.kept_for_rule() == [f"{bad.public_id} is dead with kept_for 9999-12-31T00:00:00Z"]
        assert kept_for(good) == kept_for_of(S.SUCCEEDED, T)
    finally:
        # PostgreSQL rolls the DDL back with the test's transaction; SQLite is told again.
        if connection.vendor != "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(importlib.import_module("runs.migrations.0014_kept_for").SQLITE_FORWARD[2])


@pytest.mark.skipif(connection.vendor != "postgresql", reason="the check constraint: PostgreSQL")
def test_a_statement_written_by_hand_that_ends_a_run_without_its_key_is_refused() -> None:
    run = make_run(make_job(), T)
    with pytest.raises(IntegrityError, match="runs_kept_for_rule"), transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("UPDATE runs SET status = 'succeeded', finished_at = now() WHERE id = %s", [run.pk])
    assert kept_for(run) == OPEN_KEPT_FOR


def test_a_bulk_update_and_a_save_of_some_fields_set_the_key_too() -> None:
    first, second = make_run(make_job(), T), make_run(make_job(), T + timedelta(minutes=1))
    first.status, second.status = S.SKIPPED, S.QUEUED
    Run.objects.bulk_update([first, second], ["status"])
    assert (kept_for(first), kept_for(second)) == (T, OPEN_KEPT_FOR)
    second.status = S.CANCELLED
    second.save(update_fields=["status"])
    assert kept_for(second) == T + timedelta(minutes=1)
    assert invariants.kept_for_rule() == []


@pytest.mark.skipif(connection.vendor != "postgresql", reason="row locks: PostgreSQL")
def test_runs_has_no_before_update_row_trigger() -> None:
    """PostgreSQL locks each row an UPDATE touches before it asks a BEFORE UPDATE row
    trigger whether it fires: a WAL record a row on every claim, outcome and heartbeat
    (migration runs 0016). Nothing on runs or its partitions may have one."""
    with connection.cursor() as cursor:
        cursor.execute(
            """SELECT c.relname, t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
                WHERE (c.oid = 'runs'::regclass OR c.oid IN (SELECT inhrelid FROM pg_inherits
                                                            WHERE inhparent = 'runs'::regclass))
                  AND t.tgtype & 1 = 1 AND t.tgtype & 2 = 2 AND t.tgtype & 16 = 16""")
        assert cursor.fetchall() == []
