"""One run that cannot be prepared or sent costs that run only, never its batch."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

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
