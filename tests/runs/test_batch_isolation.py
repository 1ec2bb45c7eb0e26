"""One run that cannot be prepared or sent costs that run only, never its batch."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection

from jobs.models import Job
from runs import delivery
from runs.models import Run
from runs.services import run_execute_many
from tests.runs.calls import events_of, queued_run
from tests.target import LoopbackTarget

pytestmark = pytest.mark.django_db(transaction=True)
S = Run.Status


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    delivery.close_connections()
    server.stop()


def test_one_runs_bad_header_or_secret_costs_that_run_only_and_the_batch_records_every_other_outcome(
    service: Any, other_service: Any, target: LoopbackTarget
) -> None:
    unsendable = queued_run(service.user, target.url("/note"))
    # Written straight into the database, as the API may refuse it (or did not, once).
    Job.objects.filter(pk=unsendable.job_id).update(headers={"X-Note": "price 5\u20ac"})
    undecryptable = queued_run(service.user, target.url("/secret"))
    Job.objects.filter(pk=undecryptable.job_id).update(secret_headers="gAAAAA-not-a-fernet-token")
    fine_a = queued_run(service.user, target.url("/a-fine"))
    fine_b1 = queued_run(other_service.user, target.url("/b-one"))
    target.script("/b-two", [503])
    fine_b2 = queued_run(other_service.user, target.url("/b-two"))
    batch = [unsendable.pk, fine_b1.pk, undecryptable.pk, fine_a.pk, fine_b2.pk]

    outcomes = run_execute_many(run_ids=batch, worker="w1")

    assert outcomes == {
        unsendable.pk: "dead", undecryptable.pk: "dead", fine_a.pk: "succeeded",
        fine_b1.pk: "succeeded", fine_b2.pk: "retry_scheduled",
    }
    for run in (unsendable, undecryptable, fine_a, fine_b1, fine_b2):
        run.refresh_from_db()
    assert unsendable.status == S.DEAD and "X-Note" in unsendable.last_error
    assert "5\u20ac" not in unsendable.last_error  # a header's value is never echoed (it may be a secret)
    assert undecryptable.status == S.DEAD and "decrypt" in undecryptable.last_error
    for bad in (unsendable, undecryptable):
        assert [t for t, _ in events_of(bad)] == ["claimed", "dead"]
        assert events_of(bad)[-1][1]["reason"] == bad.last_error
    # Every other run got its real outcome, its target its call.
    assert fine_a.status == S.SUCCEEDED and fine_b1.status == S.SUCCEEDED
    assert fine_b2.status == S.SCHEDULED and fine_b2.last_error.startswith("HTTP 503")
    assert [t for t, _ in events_of(fine_b1)] == ["claimed", "target_answered", "succeeded"]
    assert len(target.calls("/a-fine")) == 1 and len(target.calls("/b-one")) == 1 and len(target.calls("/b-two")) == 1
    assert target.calls("/note") == [] and target.calls("/secret") == []
    # Each job still has its next run: the dead ones too (the schedule goes on).
    for run in (unsendable, undecryptable, fine_a, fine_b1):
        assert Run.objects.filter(job_id=run.job_id, status=S.SCHEDULED).count() == 1


def test_an_exception_inside_the_call_is_a_failed_call_not_an_escape(target: LoopbackTarget) -> None:
    # A request no job could produce any more (build_request refuses it): the call
    # itself must still answer with a result, whatever raises inside it.
    request = delivery.Request(method="POST", url=target.url("/raw"), headers={"X-Note": "price 5\u20ac"}, body=b"")

    result = delivery.call(request, timeout_seconds=2)

    assert result.status is None and result.retryable
    assert result.error == "request failed"
    assert target.calls("/raw") == []


def test_a_run_whose_outcome_the_store_refuses_costs_that_run_only(
    service: Any, other_service: Any, target: LoopbackTarget
) -> None:
    refused = queued_run(service.user, target.url("/refused"))
    fine_a = queued_run(service.user, target.url("/fine-a"))
    fine_b = queued_run(other_service.user, target.url("/fine-b"))
    with connection.cursor() as cursor:  # a row the store refuses to finish (dropped with the test's tables)
        cursor.execute(
            """
            CREATE OR REPLACE FUNCTION refuse_one_outcome() RETURNS trigger AS $$
            BEGIN
              IF NEW.id = %s AND NEW.status = 'succeeded' THEN RAISE EXCEPTION 'this outcome cannot be written'; END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER refuse_one_outcome BEFORE UPDATE ON runs FOR EACH ROW EXECUTE FUNCTION refuse_one_outcome();
            """.replace("%s", str(refused.pk))
        )
    try:
        outcomes = run_execute_many(run_ids=[refused.pk, fine_a.pk, fine_b.pk], worker="w1")
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TRIGGER refuse_one_outcome ON runs; DROP FUNCTION refuse_one_outcome();")

    assert outcomes == {refused.pk: "outcome_not_recorded", fine_a.pk: "succeeded", fine_b.pk: "succeeded"}
    for run in (refused, fine_a, fine_b):
        run.refresh_from_db()
    # The neighbours, of both services, have their outcome, their timeline and their next run.
    for run in (fine_a, fine_b):
        assert run.status == S.SUCCEEDED
        assert [t for t, _ in events_of(run)] == ["claimed", "target_answered", "succeeded"]
        assert Run.objects.filter(job_id=run.job_id, status=S.SCHEDULED).count() == 1
    # The refused one is still running under its lease: it comes back like a dead worker's run.
    assert refused.status == S.RUNNING and refused.lease_expires_at is not None
    assert [t for t, _ in events_of(refused)] == ["claimed"]
