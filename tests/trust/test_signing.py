"""Signed calls: every call carries X-Signature under the owning service's secret,
and a target built on the receiver helper accepts exactly the calls that are signed,
unchanged and recent, during a rotation too."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import time_machine
from django.core.management import CommandError, call_command
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.test import RequestFactory, override_settings
from django.urls import path
from django.utils import timezone

from jobs.models import AuditEntry, Job, SigningSecret
from jobs.services import job_create, service_account_ensure
from receiver.models import Delivery
from receiver.views import idempotent_run, verify_signature
from runs import delivery, signing
from runs.models import Run
from runs.services import run_execute
from tests.target import LoopbackTarget
from tests.trust.conftest import production_env

SIGNATURE = re.compile(r"t=(\d+)((?:,v1=[0-9a-f]{64})+)")
KEY = "job_7@2026-10-28T20:30:00Z"


@pytest.fixture
def target() -> Iterator[LoopbackTarget]:
    server = LoopbackTarget().start()
    yield server
    server.stop()


def queue_now(job: Job) -> Run:
    run = Run.objects.get(job=job, status=Run.Status.SCHEDULED, is_backfill=False)
    Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED, queued_at=timezone.now(), due_at=timezone.now())
    return run


def make_job(owner: Any, url: str, **fields: Any) -> Job:
    values: dict[str, Any] = {"name": "signed", "schedule": "*/5 * * * *", "target": url, "payload": {"report": "daily"}}
    values.update(fields)
    return job_create(owner=owner, fields=values)


def macs(header: str) -> list[str]:
    match = SIGNATURE.fullmatch(header)
    assert match, header
    return match.group(2).split(",v1=")[1:]


# --------------------------------------------------------------------------- the scheduler's side


@pytest.mark.django_db(transaction=True)
def test_every_call_carries_a_signature_of_the_exact_body_under_the_services_secret(target: LoopbackTarget) -> None:
    user, _ = service_account_ensure(name="reports")
    [row] = SigningSecret.objects.filter(service__user=user)
    secret = signing.live_secrets(user.service, timezone.now())[0]
    run = queue_now(make_job(user, target.url("/hook")))

    before = int(time.time())
    assert run_execute(run_id=run.pk) == "succeeded"

    [call] = target.calls("/hook")
    header = call.headers["X-Signature"]
    assert len(macs(header)) == 1 and before <= int(header[2:12]) <= time.time()
    assert call.body == b'{"report":"daily"}'
    assert verify_signature(header, call.body, [secret], tolerance=300) is None
    assert secret.startswith("whsec_") and secret not in row.secret  # stored encrypted


@pytest.mark.django_db(transaction=True)
def test_a_get_without_a_body_is_signed_over_the_empty_body(target: LoopbackTarget) -> None:
    user, _ = service_account_ensure(name="reports")
    secret = signing.live_secrets(user.service, timezone.now())[0]
    run = queue_now(make_job(user, target.url("/get"), method="GET", payload=None))

    run_execute(run_id=run.pk)

    [call] = target.calls("/get")
    assert call.body == b"" and verify_signature(call.headers["X-Signature"], b"", [secret], tolerance=300) is None


@pytest.mark.django_db
def test_after_a_rotation_the_old_secret_signs_too_until_the_overlap_ends() -> None:
    user, _ = service_account_ensure(name="reports")
    old = signing.live_secrets(user.service, timezone.now())[0]
    with time_machine.travel("2026-10-28T10:00:00Z", tick=False):
        new = signing.signing_secret_rotate(service=user.service)
        header = signing.signer_for_owner(user.pk)(b"{}")  # type: ignore[misc]
    assert [m for m in macs(header)] == [
        signing.signature(b"{}", [new], int(header[2:12]))[-64:],
        signing.signature(b"{}", [old], int(header[2:12]))[-64:],
    ]
    retiring = SigningSecret.objects.get(service__user=user, retires_at__isnull=False)
    assert retiring.retires_at == timezone.now().replace(year=2026, month=10, day=29, hour=10, minute=0, second=0,
                                                         microsecond=0)

    signing.forget(user.pk)
    with time_machine.travel("2026-10-29T10:00:01Z", tick=False):
        header = signing.signer_for_owner(user.pk)(b"{}")  # type: ignore[misc]
    assert len(macs(header)) == 1 and verify_signature(header, b"{}", [new], tolerance=300, now=int(header[2:12])) is None


@pytest.mark.django_db
@override_settings(SCHEDULER_SIGNING_OVERLAP="0s")
def test_with_no_overlap_the_old_secret_stops_signing_at_once() -> None:
    user, _ = service_account_ensure(name="reports")
    new = signing.signing_secret_rotate(service=user.service)

    assert signing.live_secrets(user.service, timezone.now()) == [new]


@pytest.mark.django_db
def test_a_service_without_a_secret_gets_one_at_its_first_call() -> None:
    user, _ = service_account_ensure(name="reports")
    SigningSecret.objects.all().delete()  # a service made before signing existed

    signer = signing.signer_for_owner(user.pk)

    assert signer is not None and SigningSecret.objects.filter(service__user=user, retires_at=None).count() == 1


@pytest.mark.django_db
def test_the_signer_is_cached_so_the_hot_path_does_not_query_every_call(django_assert_num_queries: Any) -> None:
    user, _ = service_account_ensure(name="reports")
    signing.signer_for_owner(user.pk)

    with django_assert_num_queries(0):
        signing.signer_for_owner(user.pk)(b"x")  # type: ignore[misc]


@pytest.mark.django_db
def test_a_persons_job_is_not_signed_there_is_no_service_secret() -> None:
    from django.contrib.auth import get_user_model

    person = get_user_model().objects.create_user("ops-person", is_staff=True)

    assert signing.signer_for_owner(person.pk) is None


@pytest.mark.django_db
def test_the_signer_never_shows_its_secrets() -> None:
    user, _ = service_account_ensure(name="reports")
    secret = signing.live_secrets(user.service, timezone.now())[0]

    assert secret not in repr(signing.signer_for_owner(user.pk))


# --------------------------------------------------------------------------- rotate_signing_secret


@pytest.mark.django_db
def test_rotate_signing_secret_prints_only_the_new_secret_and_audits_it(capsys: pytest.CaptureFixture[str]) -> None:
    user, _ = service_account_ensure(name="reports")

    call_command("rotate_signing_secret", "reports")

    out = capsys.readouterr().out
    assert re.fullmatch(r"whsec_[A-Za-z0-9_-]{43}\n", out)
    assert signing.live_secrets(user.service, timezone.now())[0] == out.strip()
    entry = AuditEntry.objects.get(action="signing_secret_rotated")
    assert entry.object_id == "reports" and entry.via == "command" and out.strip() not in json.dumps(entry.detail)


@pytest.mark.django_db
def test_rotate_signing_secret_for_an_unknown_service_refuses_in_one_line() -> None:
    with pytest.raises(CommandError, match=r"^no service account 'nobody'"):
        call_command("rotate_signing_secret", "nobody")


@pytest.mark.django_db(transaction=True)
def test_rotate_signing_secret_exits_non_zero_with_one_line_and_no_traceback() -> None:
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    if connection.vendor != "postgresql":
        pytest.skip("the subprocess needs the test database by URL")
    result = subprocess.run(
        [sys.executable, "manage.py", "rotate_signing_secret", "nobody"],
        capture_output=True, text=True, env=production_env(DATABASE_URL=url), timeout=60,
    )
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ["CommandError: no service account 'nobody' (create it with "
                                                  "create_service_token nobody)"]


# --------------------------------------------------------------------------- the target's side (receiver helper)


@idempotent_run
def hook(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"applied": True}, status=201)


urlpatterns = [path("hook/", hook)]


def signed_call(body: bytes, header: str | None, key: str = KEY) -> HttpResponse:
    extra = {"HTTP_X_SIGNATURE": header} if header is not None else {}
    request = RequestFactory().post(
        "/hook/", data=body, content_type="application/json",
        HTTP_IDEMPOTENCY_KEY=key, HTTP_X_FENCE_TOKEN="1", **extra,
    )
    return hook(request)


BODY = b'{"report":"daily"}'


@pytest.mark.django_db
@override_settings(RECEIVER_SIGNING_SECRETS=["whsec_current"])
def test_the_receiver_accepts_a_signed_call() -> None:
    response = signed_call(BODY, signing.signature(BODY, ["whsec_current"], int(time.time())))

    assert response.status_code == 201


REFUSED = {
    # case: (X-Signature made at unix time `now`, or None for no header; words in the refusal)
    "unsigned": (lambda now: None, "missing"),
    "malformed": (lambda now: "v1=abc", "malformed"),
    "tampered body": (lambda now: signing.signature(b'{"report":"weekly"}', ["whsec_current"], now), "does not match"),
    "wrong secret": (lambda now: signing.signature(BODY, ["whsec_other"], now), "does not match"),
    "replay older than the tolerance": (lambda now: signing.signature(BODY, ["whsec_current"], now - 301), "replay"),
    "from too far in the future": (lambda now: signing.signature(BODY, ["whsec_current"], now + 301), "replay"),
}


@pytest.mark.django_db
@override_settings(RECEIVER_SIGNING_SECRETS=["whsec_current"], RECEIVER_SIGNATURE_TOLERANCE=300)
@pytest.mark.parametrize("case", list(REFUSED))
def test_the_receiver_refuses_with_401_and_leaves_no_trace(case: str) -> None:
    make_header, words = REFUSED[case]

    response = signed_call(BODY, make_header(int(time.time())))

    assert response.status_code == 401
    assert words in json.loads(response.content)["detail"] and response["WWW-Authenticate"]
    assert not Delivery.objects.exists()


@pytest.mark.django_db
@override_settings(RECEIVER_SIGNING_SECRETS=["whsec_new", "whsec_old"])
def test_during_a_rotation_a_target_with_both_secrets_accepts_either() -> None:
    now = int(time.time())

    assert signed_call(BODY, signing.signature(BODY, ["whsec_old"], now), key="k1").status_code == 201
    assert signed_call(BODY, signing.signature(BODY, ["whsec_new"], now), key="k2").status_code == 201
    assert signed_call(BODY, signing.signature(BODY, ["whsec_gone"], now), key="k3").status_code == 401


@pytest.mark.django_db
@override_settings(RECEIVER_SIGNING_SECRETS=["whsec_new"])
def test_a_target_that_already_switched_accepts_the_schedulers_two_signatures() -> None:
    header = signing.signature(BODY, ["whsec_new", "whsec_old"], int(time.time()))

    assert signed_call(BODY, header).status_code == 201


@pytest.mark.django_db
def test_with_no_secrets_configured_the_receiver_accepts_unsigned_calls() -> None:
    assert signed_call(BODY, None).status_code == 201


@pytest.mark.django_db(transaction=True)
@pytest.mark.urls("tests.trust.test_signing")
def test_a_real_call_from_the_scheduler_passes_a_receiver_that_verifies(live_server: Any) -> None:
    user, _ = service_account_ensure(name="reports")
    secret = signing.live_secrets(user.service, timezone.now())[0]
    good = queue_now(make_job(user, f"{live_server.url}/hook/"))

    with override_settings(RECEIVER_SIGNING_SECRETS=[secret]):
        assert run_execute(run_id=good.pk) == "succeeded"
    with override_settings(RECEIVER_SIGNING_SECRETS=["whsec_not_this_service"]):
        bad = queue_now(Job.objects.get(pk=good.job_id))
        assert run_execute(run_id=bad.pk) == "dead"  # a 401 is final, like any other 4xx
    bad.refresh_from_db()
    assert "HTTP 401" in bad.last_error and "does not match" in bad.last_error
    # The worker's pooled connection keeps the live server's request thread, and its
    # database connection, open: close it so the test database can be dropped.
    delivery.close_connections()


def test_a_timestamp_far_from_now_is_refused_even_with_the_right_secret() -> None:
    t = int(time.time()) - int(timedelta(minutes=6).total_seconds())
    header = signing.signature(BODY, ["s"], t)

    assert "replay" in (verify_signature(header, BODY, ["s"], tolerance=300) or "")


def test_the_plain_python_verifier_in_the_target_docs_agrees_with_the_scheduler() -> None:
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "targets.md").read_text()
    snippet = docs.split("### Without Django (plain Python)")[1].split("```python")[1].split("```")[0]
    namespace: dict[str, Any] = {}
    exec(compile(snippet, "docs/targets.md", "exec"), namespace)  # noqa: S102 - our own docs
    verify = namespace["verify_x_signature"]
    now = int(time.time())

    assert verify(signing.signature(BODY, ["whsec_new", "whsec_old"], now), BODY, ["whsec_old"])
    assert not verify(signing.signature(BODY, ["whsec_new"], now), BODY + b" ", ["whsec_new"])
    assert not verify(signing.signature(BODY, ["whsec_new"], now - 301), BODY, ["whsec_new"])
    assert not verify("", BODY, ["whsec_new"])
