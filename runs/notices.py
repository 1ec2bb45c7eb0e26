"""Notices: telling a job's owner that runs went dead (or were skipped, or that the
job paused itself), by e-mail or by a signed webhook, without flooding them.

Two halves, so that a worker is never held up by a slow mail server or webhook:

- `notice_add` / `notices_add` insert rows into the outbox (runs.Notice), in the
  transaction that writes the dead or skipped run. That is all a worker does.
- `notices_send` (the Celery task `runs.send_notices`, published by the scanners
  when rows are due) sends them: one notice per job listing every row since the
  last one, at most one per job per SCHEDULER_NOTIFY_DIGEST (the first at once).
  A notice that fails is tried again later with backoff: its rows get a later
  `due_at`, never a `self.retry()`; out of tries, they are `failed`.

Where a notice goes is decided when it is sent, from the job as it is then:
the job's `notify`, else its service account's, else the account's e-mail
(`recipients`). A webhook is called like a target (runs.delivery): checked
against the allow-list and refused addresses when sent, connected to the
checked address only, its answer read up to a bound, cut off at its deadline,
and signed with the owning service's secret (X-Signature).
"""
from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.mail import send_mail
from django.db import transaction
from django.utils import timezone

from jobs.models import Job, ServiceAccount
from jobs.schedule import parse_duration
from jobs.validators import notify_is_webhook, notify_refusal
from runs import delivery, rollups
from runs.models import Notice, Run

logger = logging.getLogger("scheduler.notices")
K, NS = Notice.Kind, Notice.Status
LISTED = 50  # runs listed by name in one notice; the count says how many in all
TAKEN = 5000  # rows one notice covers at most (a bigger burst goes on in the next one)
RETRY_CAP = timedelta(hours=1)
USER_AGENT = f"{delivery.USER_AGENT} notices"


# --------------------------------------------------------------------------- the worker's half


def notice_row(*, job: Job, kind: str, run: Run | None = None, reason: str = "", now: datetime | None = None
               ) -> Notice | None:
    """The outbox row for one event, or None when the job's `notify_on` leaves this
    kind out. `paused` is always told: the owner is told whatever `notify_on` says."""
    if kind in (K.DEAD, K.SKIPPED) and kind not in (job.notify_on or []):
        return None
    now = now or timezone.now()
    return Notice(job=job, run=run, kind=kind, reason=reason[:2000], created_at=now, due_at=now)


def notices_add(rows: Iterable[Notice | None]) -> int:
    """Insert outbox rows (Nones are left out), in the caller's transaction."""
    wanted = [row for row in rows if row is not None]
    if wanted:
        Notice.objects.bulk_create(wanted)
    return len(wanted)


def notice_add(*, job: Job, kind: str, run: Run | None = None, reason: str = "", now: datetime | None = None) -> bool:
    """One event to tell the job's owner about (`dead`, `skipped`, `paused`).
    True when a row was written."""
    return notices_add([notice_row(job=job, kind=kind, run=run, reason=reason, now=now)]) == 1


def recipients(jobs: Iterable[Job]) -> dict[int, str]:
    """Who is told, per job id: the job's `notify`, else its service account's
    `notify`, else the owner's e-mail; "" for no one. One query for the accounts."""
    jobs = list(jobs)
    need = {job.owner_id for job in jobs if not job.notify}
    defaults = dict(ServiceAccount.objects.filter(user_id__in=need).values_list("user_id", "notify")) if need else {}
    return {job.pk: job.notify or defaults.get(job.owner_id) or job.owner.email for job in jobs}


def recipient(job: Job) -> str:
    return recipients([job])[job.pk]


def notices_due(now: datetime | None = None) -> bool:
    """Is any notice due to be sent? (One indexed read: the scanners ask often.)"""
    return Notice.objects.filter(status=NS.PENDING, due_at__lte=now or timezone.now()).exists()


# --------------------------------------------------------------------------- the sender's half


@dataclass
class SendResult:
    sent: list[int] = field(default_factory=list)  # job ids told
    deferred: list[int] = field(default_factory=list)  # inside their digest window or backoff
    retrying: list[int] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)  # their service had its notices for the hour


class NoticeFailed(Exception):
    """A notice that did not go out; `final` when trying again cannot help."""

    def __init__(self, reason: str, *, final: bool = False) -> None:
        super().__init__(reason)
        self.final = final


def notices_send(*, now: datetime | None = None, jobs: int = 50, budget_seconds: float = 20.0) -> SendResult:
    """Send what is due, one job at a time, for at most about `budget_seconds`
    (a task of bounded length; what is left is due on the next one)."""
    now = now or timezone.now()
    result = SendResult()
    started = time.monotonic()
    due = (Notice.objects.filter(status=NS.PENDING, due_at__lte=now).order_by().values_list("job_id", flat=True)
           .distinct()[:jobs])
    for job_id in list(due):
        if time.monotonic() - started > budget_seconds:
            break
        try:
            _send_job(job_id, now, result)
        except Exception:  # one job's trouble (a row the store refuses) costs that job only
            logger.exception("notices of job %s could not be handled", job_id)
    return result


def _send_job(job_id: int, now: datetime, result: SendResult) -> None:
    """One digest for one job, under a lock on its pending rows (another sender skips
    them), which is held while it is sent: a sender that dies leaves them pending."""
    with transaction.atomic():
        rows = list(
            Notice.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("job__owner", "run")
            .filter(job_id=job_id, status=NS.PENDING)
            .order_by("id")[:TAKEN]
        )
        if not rows:
            return
        when = _earliest_send(job_id, rows)
        if when > now:
            Notice.objects.filter(pk__in=[r.pk for r in rows]).update(due_at=when)
            result.deferred.append(job_id)
            return
        job = rows[0].job
        to = recipient(job)
        held_until = _over_hourly_cap(job.owner_id, now)
        if held_until is not None:
            # The service has had its notices for this hour: these wait, counted.
            Notice.objects.filter(pk__in=[r.pk for r in rows]).update(due_at=held_until)
            result.held.append(job_id)
            rollups.add_count(HELD, len(rows))
            logger.warning("notices of %s held until %s: its service had %d notices in the last hour "
                           "(SCHEDULER_NOTIFY_PER_HOUR)", job.public_id, delivery.iso_z(held_until),
                           settings.SCHEDULER_NOTIFY_PER_HOUR)
            return
        try:
            refusal = notify_refusal(to)
            if refusal:
                raise NoticeFailed(f"notify refused: {refusal}", final=True)
            _deliver(job, rows, to, now)
        except NoticeFailed as exc:
            _failed(rows, to, now, str(exc), final=exc.final, result=result)
            return
        Notice.objects.filter(pk__in=[r.pk for r in rows]).update(
            status=NS.SENT, sent_at=now, sent_to=to, tries=_tries(rows) + 1, last_error=""
        )
        result.sent.append(job_id)
        logger.info("told %s about %d run(s) of %s", _where(to), len(rows), job.public_id)


HELD = "notices_held"  # runs.rollups kind: notices held by SCHEDULER_NOTIFY_PER_HOUR


def _over_hourly_cap(owner_id: int | None, now: datetime) -> datetime | None:
    """When a notice of this service may go out, if it has had SCHEDULER_NOTIFY_PER_HOUR
    notices (digests: one job's rows sent together) in the hour before `now`; else None."""
    cap = settings.SCHEDULER_NOTIFY_PER_HOUR
    if cap <= 0 or owner_id is None:
        return None
    hour = timedelta(hours=1)
    sent = sorted(set(Notice.objects.filter(job__owner_id=owner_id, status=NS.SENT, sent_at__gt=now - hour)
                      .values_list("job_id", "sent_at")), key=lambda pair: pair[1])
    if len(sent) < cap:
        return None
    return sent[len(sent) - cap][1] + hour  # when the oldest of the last `cap` leaves the hour


def _earliest_send(job_id: int, rows: list[Notice]) -> datetime:
    """The digest rule: not before the job's last notice plus SCHEDULER_NOTIFY_DIGEST,
    and not before a failed try's retry time."""
    last = (Notice.objects.filter(job_id=job_id, status=NS.SENT).order_by("-sent_at")
            .values_list("sent_at", flat=True).first())
    candidates = [row.due_at for row in rows if row.tries > 0]
    if last is not None:
        candidates.append(last + parse_duration(settings.SCHEDULER_NOTIFY_DIGEST))
    return max(candidates, default=rows[0].due_at)


def retry_delay(tries: int, *, rng: random.Random | None = None) -> timedelta:
    """After `tries` failed tries: SCHEDULER_NOTIFY_RETRY_BASE doubling, up to an hour,
    jittered down by up to half (so many failing hooks do not come back together)."""
    base = parse_duration(settings.SCHEDULER_NOTIFY_RETRY_BASE)
    delay = min(RETRY_CAP, base * (2 ** max(0, tries - 1)))
    return delay * (0.5 + 0.5 * (rng or random).random())


def _tries(rows: list[Notice]) -> int:
    """Tries so far of a digest (rows that came in during a backoff join its count)."""
    return max(row.tries for row in rows)


def _failed(rows: list[Notice], to: str, now: datetime, reason: str, *, final: bool, result: SendResult) -> None:
    tries = _tries(rows) + 1
    ids = [r.pk for r in rows]
    if final or tries >= settings.SCHEDULER_NOTIFY_TRIES:
        Notice.objects.filter(pk__in=ids).update(status=NS.FAILED, tries=tries, sent_to=to, last_error=reason[:2000])
        result.failed.append(rows[0].job_id)
        logger.error("notice of %s to %s failed for good after %d tries: %s", rows[0].job.public_id, _where(to),
                     tries, reason)
        return
    due = now + retry_delay(tries)
    Notice.objects.filter(pk__in=ids).update(tries=tries, due_at=due, sent_to=to, last_error=reason[:2000])
    result.retrying.append(rows[0].job_id)
    logger.warning("notice of %s to %s failed (%s); try %d at %s", rows[0].job.public_id, _where(to), reason,
                   tries + 1, delivery.iso_z(due))


def _where(to: str) -> str:
    """For the log: a webhook by its host only (its path may hold a token)."""
    return f"webhook {delivery.parse_url(to).host}" if notify_is_webhook(to) else (to or "no one")


def _deliver(job: Job, rows: list[Notice], to: str, now: datetime) -> None:
    if not to:
        raise NoticeFailed("no one to tell: the job has no notify, its service none, its owner no e-mail", final=True)
    if notify_is_webhook(to):
        _webhook(job, rows, to, now)
    else:
        _email(job, rows, to, now)


def notice_body(job: Job, rows: list[Notice], now: datetime) -> dict[str, Any]:
    """The JSON a webhook receives (docs/targets.md, "Notices")."""
    return {
        "type": "scheduler.notice",
        "id": f"notice_{rows[0].pk}",
        "job": {"id": job.public_id, "name": job.name},
        "count": len(rows),
        "kinds": sorted({row.kind for row in rows}),
        "notices": [_listed(row) for row in rows[:LISTED]],
        "sent_at": delivery.iso_z(now),
    }


def _listed(row: Notice) -> dict[str, Any]:
    run = row.run
    return {
        "kind": row.kind,
        "at": delivery.iso_z(row.created_at),
        "reason": row.reason,
        "run": run.public_id if run else None,
        "scheduled_for": delivery.iso_z(run.scheduled_for) if run else None,
        "attempt": run.attempt if run else None,
    }


def _webhook(job: Job, rows: list[Notice], url: str, now: datetime) -> None:
    """POST the notice as a target call is made: checked now (allow-list, refused
    addresses), pinned to the checked address, bounded, signed."""
    from jobs.validators import check_resolved_target
    from runs.signing import signer_for_owner

    try:
        addresses = tuple(check_resolved_target(url))
    except ValueError as exc:
        raise NoticeFailed(f"webhook refused: {exc}", final=True) from exc
    except OSError:
        raise NoticeFailed(delivery.DNS_FAILURE) from None
    body = json.dumps(notice_body(job, rows, now), separators=(",", ":")).encode()
    headers = {"User-Agent": USER_AGENT, "Content-Type": "application/json", "X-Notice-Id": f"notice_{rows[0].pk}"}
    signer = signer_for_owner(job.owner_id)
    if signer is not None:
        headers["X-Signature"] = signer(body)
    request = delivery.Request(method="POST", url=url, headers=headers, body=body, addresses=addresses,
                               secrets=tuple(signer.secret_values) if signer is not None else ())
    answer = delivery.call(request, timeout_seconds=settings.SCHEDULER_NOTIFY_TIMEOUT)
    if not answer.ok:
        raise NoticeFailed(f"webhook answered {answer.describe()}", final=not answer.retryable)


def _email(job: Job, rows: list[Notice], address: str, now: datetime) -> None:
    if not settings.SCHEDULER_EMAIL_ENABLED:
        raise NoticeFailed("e-mail is off: set EMAIL_URL", final=True)
    dead = sum(1 for row in rows if row.kind == K.DEAD)
    skipped = sum(1 for row in rows if row.kind == K.SKIPPED)
    parts = [f"{dead} dead run(s)"] if dead else []
    parts += [f"{skipped} skipped run(s)"] if skipped else []
    parts += ["paused itself"] if any(row.kind == K.PAUSED for row in rows) else []
    what = ", ".join(parts)
    calls = f"target {job.target}" if job.target else f"Celery task {job.task} on queue {job.queue}"
    lines = [f"Job {job.public_id} ({job.name or 'no name'}), {calls}:", ""]
    for row in rows[:LISTED]:
        run = row.run
        about = f"run {run.public_id} scheduled for {delivery.iso_z(run.scheduled_for)}" if run else "the job"
        lines.append(f"- {row.kind}: {about}: {row.reason}")
    if len(rows) > LISTED:
        lines.append(f"... and {len(rows) - LISTED} more")
    try:
        send_mail(
            subject=f"[scheduler] {job.name or job.public_id}: {what}",
            message="\n".join(lines) + "\n",
            from_email=None,  # DEFAULT_FROM_EMAIL
            recipient_list=[address],
            fail_silently=False,
        )
    except Exception as exc:  # SMTP refused, down, timed out: tried again later
        raise NoticeFailed(delivery.one_line(f"e-mail not sent: {type(exc).__name__}: {exc}")[:300]) from None
