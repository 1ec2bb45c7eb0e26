"""Notices: a dead run tells its job's owner through the outbox, by a signed https
webhook (called like a target) or by e-mail, one digest per job per window, and a
failing webhook is tried again later with backoff, never by the worker."""
from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.core import mail
from django.test import override_settings
from django.utils import timezone

from jobs.models import ServiceAccount
from receiver.views import verify_signature
from runs import notices
from runs.models import Notice, Run
from runs.services import run_execute
from runs.signing import live_secrets
from scheduler_project.settings import email_settings
from tests.factories import make_job, make_run, entry
from tests.runs.calls import queued_run
from tests.target import LoopbackTarget
from tests.webhook import HttpsWebhook

pytestmark = pytest.mark.django_db
NS = Notice.Status


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[HttpsWebhook]:
    server = HttpsWebhook(tmp_path).start()
    with override_settings(SCHEDULER_TLS_CA_FILE=server.cert, SCHEDULER_NOTIFY_RETRY_BASE="30s"):
        yield server
    server.stop()


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def dead_runs(job: Any, count: int) -> list[Run]:
    earliest = job.runs.order_by("scheduled_for").first()
    start = earliest.scheduled_for if earliest else timezone.now().replace(microsecond=0)
    runs = [make_run(job, start - timedelta(minutes=i + 1), status=Run.Status.DEAD, attempt=4) for i in range(count)]
    for run in runs:
        notices.notice_add(job=job, kind="dead", run=run, reason="HTTP 503")
    return runs


def secret_of(service: Any) -> list[str]:
    return live_secrets(ServiceAccount.objects.get(user=service.user), timezone.now())


@pytest.mark.embedded
def test_a_burst_of_dead_runs_becomes_one_signed_notice_listing_them(service: Any, webhook: HttpsWebhook) -> None:
    job = make_job(service.user, notify=webhook.url("/hook"))
    runs = dead_runs(job, 5)

    result = notices.notices_send()

    assert result.sent == [job.pk]
    [call] = webhook.calls("/hook")
    assert verify_signature(call.headers["X-Signature"], call.body, secret_of(service), tolerance=300) is None
    body = json.loads(call.body)
    assert body["job"]["id"] == job.public_id and body["count"] == 5 and body["kinds"] == ["dead"]
    assert {n["run"] for n in body["notices"]} == {r.public_id for r in runs}
    assert all(n["reason"] == "HTTP 503" for n in body["notices"])
    assert set(Notice.objects.values_list("status", flat=True)) == {NS.SENT}


def test_dead_runs_inside_the_digest_window_wait_for_one_later_notice(service: Any, webhook: HttpsWebhook) -> None:
    job = make_job(service.user, notify=webhook.url("/hook"))
    dead_runs(job, 1)
    notices.notices_send()
    later = dead_runs(job, 3)
    now = timezone.now()

    assert notices.notices_send(now=now).deferred == [job.pk]
    assert len(webhook.calls("/hook")) == 1  # the window of the first notice is still open
    assert not notices.notices_due(now)  # and the scanner's check agrees: nothing due until it ends

    assert notices.notices_send(now=now + timedelta(minutes=5, seconds=1)).sent == [job.pk]
    calls = webhook.calls("/hook")
    assert len(calls) == 2
    assert {n["run"] for n in json.loads(calls[1].body)["notices"]} == {r.public_id for r in later}


@pytest.mark.embedded
def test_a_failing_webhook_is_tried_again_with_backoff_then_delivered(service: Any, webhook: HttpsWebhook) -> None:
    webhook.script("/hook", [503, 503, 200])
    job = make_job(service.user, notify=webhook.url("/hook"))
    dead_runs(job, 2)
    now = timezone.now()

    assert notices.notices_send(now=now).retrying == [job.pk]
    first = Notice.objects.filter(job=job).first()
    assert first.tries == 1 and first.status == NS.PENDING and "HTTP 503" in first.last_error
    assert now + timedelta(seconds=15) <= first.due_at <= now + timedelta(seconds=30)  # 30s, jittered down by half

    assert notices.notices_send(now=now + timedelta(seconds=1)).sent == []  # not before its retry time
    assert len(webhook.calls("/hook")) == 1

    assert notices.notices_send(now=first.due_at).retrying == [job.pk]
    second = Notice.objects.filter(job=job).first()
    assert second.tries == 2 and second.due_at - first.due_at >= timedelta(seconds=30)  # the delay doubled

    assert notices.notices_send(now=second.due_at).sent == [job.pk]
    assert len(webhook.calls("/hook")) == 3
    assert set(Notice.objects.filter(job=job).values_list("status", "tries")) == {(NS.SENT, 3)}


def test_a_dead_run_during_a_backoff_joins_the_retry_instead_of_going_alone(service: Any, webhook: HttpsWebhook) -> None:
    webhook.script("/hook", [503, 200])
    job = make_job(service.user, notify=webhook.url("/hook"))
    dead_runs(job, 1)
    now = timezone.now()
    notices.notices_send(now=now)
    retry_at = Notice.objects.get(job=job).due_at
    dead_runs(job, 1)  # due at once on its own, but the job's notice is waiting out its backoff

    assert notices.notices_send(now=now + timedelta(seconds=1)).deferred == [job.pk]
    assert len(webhook.calls("/hook")) == 1
    assert notices.notices_send(now=retry_at).sent == [job.pk]
    assert json.loads(webhook.calls("/hook")[1].body)["count"] == 2
    assert set(Notice.objects.filter(job=job).values_list("status", "tries")) == {(NS.SENT, 2)}


def test_a_webhook_answering_a_final_4xx_is_not_tried_again(service: Any, webhook: HttpsWebhook) -> None:
    webhook.script("/hook", [410])
    job = make_job(service.user, notify=webhook.url("/hook"))
    dead_runs(job, 1)
    assert notices.notices_send().failed == [job.pk]
    notice = Notice.objects.get(job=job)
    assert notice.status == NS.FAILED and "HTTP 410" in notice.last_error


def test_a_webhook_off_the_allow_list_at_send_time_is_refused_without_a_call(
    service: Any, webhook: HttpsWebhook
) -> None:
    job = make_job(service.user, notify=webhook.url("/hook"))
    dead_runs(job, 1)
    with override_settings(SCHEDULER_TARGET_ALLOWLIST=["*.internal"]):
        assert notices.notices_send().failed == [job.pk]
    assert webhook.calls() == []
    assert "SCHEDULER_TARGET_ALLOWLIST" in Notice.objects.get(job=job).last_error


@pytest.mark.embedded
def test_a_dead_run_in_the_worker_only_writes_an_outbox_row(
    service: Any, webhook: HttpsWebhook, target: LoopbackTarget
) -> None:
    target.script("/bad", [400])
    run = queued_run(service.user, target.url("/bad"), notify=webhook.url("/hook"))

    assert run_execute(run_id=run.pk) == "dead"

    notice = Notice.objects.get(run=run)
    assert (notice.kind, notice.status, notice.tries) == ("dead", NS.PENDING, 0)
    assert "HTTP 400" in notice.reason
    assert webhook.calls() == []  # the worker did not call the webhook: the sender will
    assert entry(run, "dead").detail["notified"] == webhook.url("/hook")
    notices.notices_send()
    assert len(webhook.calls("/hook")) == 1


def test_the_services_default_notify_is_used_and_the_jobs_own_wins(service: Any) -> None:
    ServiceAccount.objects.filter(user=service.user).update(notify="https://hooks.example.test/dead")
    default = make_job(service.user)
    own = make_job(service.user, notify="oncall@example.test")
    assert notices.recipients([default, own]) == {default.pk: "https://hooks.example.test/dead",
                                                  own.pk: "oncall@example.test"}
    ServiceAccount.objects.filter(user=service.user).update(notify="")
    assert notices.recipient(default) == "reports@example.test"  # the account's e-mail, as before


def test_skipped_runs_are_told_only_when_notify_on_asks() -> None:
    quiet = make_job(notify="a@example.test")
    told = make_job(notify="a@example.test", notify_on=["dead", "skipped"])
    run = make_run(told, timezone.now(), status=Run.Status.SKIPPED)
    assert not notices.notice_add(job=quiet, kind="skipped", run=run, reason="misfire policy skip")
    assert notices.notice_add(job=told, kind="skipped", run=run, reason="misfire policy skip")
    assert notices.notice_add(job=make_job(notify_on=[]), kind="paused", reason="5 dead runs in a row")
    assert sorted(Notice.objects.values_list("kind", flat=True)) == ["paused", "skipped"]


@override_settings(EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend", SCHEDULER_EMAIL_ENABLED=True)
def test_an_email_notice_lists_the_burst_in_one_message() -> None:
    job = make_job(notify="oncall@example.test", name="nightly")
    runs = dead_runs(job, 3)
    assert notices.notices_send().sent == [job.pk]
    [message] = mail.outbox
    assert message.to == ["oncall@example.test"] and "nightly: 3 dead run(s)" in message.subject
    assert all(r.public_id in message.body for r in runs)


@override_settings(SCHEDULER_EMAIL_ENABLED=False)
def test_with_email_off_an_email_notice_fails_saying_so() -> None:
    job = make_job(notify="oncall@example.test")
    dead_runs(job, 1)
    assert notices.notices_send().failed == [job.pk]
    assert Notice.objects.get(job=job).last_error == "e-mail is off: set EMAIL_URL"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("smtp://user:p%40ss@mail.internal:587",
         {"EMAIL_HOST": "mail.internal", "EMAIL_PORT": 587, "EMAIL_HOST_USER": "user", "EMAIL_HOST_PASSWORD": "p@ss",
          "EMAIL_USE_TLS": False, "EMAIL_USE_SSL": False}),
        ("smtp://mail.internal:587?tls=1", {"EMAIL_PORT": 587, "EMAIL_USE_TLS": True, "EMAIL_USE_SSL": False}),
        ("smtps://u:p@mail.internal", {"EMAIL_PORT": 465, "EMAIL_USE_SSL": True, "EMAIL_USE_TLS": False}),
        ("smtp://127.0.0.1?timeout=3", {"EMAIL_PORT": 25, "EMAIL_TIMEOUT": 3, "EMAIL_HOST_USER": ""}),
    ],
)
def test_email_url_sets_djangos_email_settings(url: str, expected: dict[str, Any]) -> None:
    parsed = email_settings(url)
    assert parsed["EMAIL_BACKEND"] == "django.core.mail.backends.smtp.EmailBackend"
    assert {key: parsed[key] for key in expected} == expected


@pytest.mark.parametrize(
    ("url", "words"),
    [("http://mail.internal", "smtp:// or smtps://"), ("smtp://", "names no host"),
     ("smtp://h:99999", "port"), ("smtp://h?starttls=1", "unknown option 'starttls'")],
)
def test_a_bad_email_url_is_refused_in_words(url: str, words: str) -> None:
    from django.core.exceptions import ImproperlyConfigured

    with pytest.raises(ImproperlyConfigured, match=words):
        email_settings(url)


def test_notify_on_is_taken_and_refused_by_the_api(service: Any) -> None:
    body = {"delay": "1h", "target": "https://reports.internal/x"}
    made = service.post("/api/jobs/", {**body, "notify_on": ["skipped", "dead"]})
    assert made.status_code == 201, made.json()
    assert made.json()["notify_on"] == ["dead", "skipped"]
    assert service.post("/api/jobs/", body).json()["notify_on"] == ["dead"]
    bad = service.post("/api/jobs/", {**body, "notify_on": ["dead", "late"]})
    assert bad.status_code == 400 and "late" in bad.json()["notify_on"][0]


@override_settings(SCHEDULER_MISFIRE_GRACE=60, SCHEDULER_MISFIRE_MAX_SKIPPED=5)
def test_a_misfires_skipped_runs_are_told_in_one_digest_when_the_job_asks(service: Any, webhook: HttpsWebhook) -> None:
    from jobs.services import job_create
    from scanners.scan import scan_once
    from tests.factories import utc

    fields = {"name": "m", "schedule": "* * * * *", "target": "http://127.0.0.1:9/h", "misfire": "skip"}
    quiet = job_create(owner=service.user, fields=fields, now=utc("2026-10-28T20:29:30Z"))
    told = job_create(owner=service.user, now=utc("2026-10-28T20:29:30Z"),
                      fields={**fields, "notify": webhook.url("/skips"), "notify_on": ["dead", "skipped"]})

    scan_once(partitions=frozenset(range(16)), now=utc("2026-10-28T20:40:30Z"), publish=False)

    skipped = set(Run.objects.filter(job=told, status=Run.Status.SKIPPED).values_list("pk", flat=True))
    assert len(skipped) == 6  # the late run and the 5 latest missed times (SCHEDULER_MISFIRE_MAX_SKIPPED)
    assert set(Notice.objects.filter(job=told, kind="skipped").values_list("run_id", flat=True)) == skipped
    assert not Notice.objects.filter(job=quiet).exists()  # notify_on is ["dead"] by default
    notices.notices_send()
    [call] = webhook.calls("/skips")
    body = json.loads(call.body)
    assert body["count"] == 6 and body["kinds"] == ["skipped"]
    assert all(n["reason"] == "misfire policy skip" for n in body["notices"])


def test_metrics_show_the_notices_waiting_and_given_up_on(service: Any, webhook: HttpsWebhook) -> None:
    from runs.metrics import render_metrics

    webhook.script("/gone", [410])
    dead_runs(make_job(service.user, notify=webhook.url("/hook")), 2)
    dead_runs(make_job(service.user, notify=webhook.url("/gone")), 1)
    assert "scheduler_notices_pending 3" in render_metrics()
    notices.notices_send()
    text = render_metrics()
    assert "scheduler_notices_pending 0" in text and "scheduler_notices_failed 1" in text


@pytest.mark.embedded
def test_an_upper_case_https_notify_url_is_called_as_a_webhook(service: Any, webhook: HttpsWebhook) -> None:
    """`HTTPS://...` passed the API's check (schemes are case-insensitive) but was then
    sent as an e-mail address, tried ten times, and the owner never told."""
    url = webhook.url("/shout")
    job = make_job(service.user, notify="HTTPS://" + url[len("https://"):])
    dead_runs(job, 1)

    result = notices.notices_send()

    assert result.sent == [job.pk]
    assert len(webhook.calls("/shout")) == 1
    assert set(Notice.objects.values_list("status", flat=True)) == {NS.SENT}


@pytest.mark.embedded
@override_settings(SCHEDULER_NOTIFY_PER_HOUR=2)
def test_a_service_past_its_notices_for_the_hour_waits_counted_and_another_service_is_told(
    service: Any, other_service: Any, webhook: HttpsWebhook
) -> None:
    """25 jobs with an unverified notify and a phishing name sent 16 e-mails in 30 s from
    the scheduler's own sender: a cap per service per hour holds always."""
    from tests.factories import scrape_metrics

    mine = [make_job(service.user, name=f"URGENT {i}", notify=webhook.url(f"/m{i}")) for i in range(3)]
    theirs = make_job(other_service.user, notify=webhook.url("/theirs"))
    for job in [*mine, theirs]:
        dead_runs(job, 1)

    result = notices.notices_send()

    assert sorted(result.sent) == sorted([mine[0].pk, mine[1].pk, theirs.pk])
    assert result.held == [mine[2].pk]
    held = Notice.objects.get(job=mine[2])
    assert held.status == NS.PENDING and held.due_at >= timezone.now() + timedelta(minutes=59)
    assert not webhook.calls("/m2")
    assert "scheduler_notices_held_total 1" in scrape_metrics().content.decode().splitlines()


@override_settings(SCHEDULER_NOTIFY_ALLOWLIST=["example.test", "*.hooks.example.test"])
def test_a_notify_off_the_allow_list_is_a_400_and_one_stored_before_is_refused_when_sent(service: Any) -> None:
    base = {"name": "n", "schedule": "0 2 * * *", "target": "https://a.example/x"}
    for notify in ["ops@attacker.test", "https://evil.test/hook"]:
        response = service.client.post("/api/jobs/", {**base, "notify": notify}, format="json")
        assert response.status_code == 400 and "SCHEDULER_NOTIFY_ALLOWLIST" in response.json()["notify"][0]
    for notify in ["ops@example.test", "https://a.hooks.example.test/x"]:
        assert service.client.post("/api/jobs/", {**base, "name": notify, "notify": notify},
                                   format="json").status_code == 201

    job = make_job(service.user, notify="ops@attacker.test")  # stored before the list was set
    dead_runs(job, 1)
    result = notices.notices_send()
    assert result.failed == [job.pk]
    assert "not in SCHEDULER_NOTIFY_ALLOWLIST" in Notice.objects.get(job=job).last_error
