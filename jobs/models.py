"""The job: what to call, with what, and when."""
from __future__ import annotations

from datetime import date, timedelta

from django.conf import settings
from django.db import models

from jobs.public_ids import format_id
from jobs.schedule import Timetable


class ServiceAccount(models.Model):
    """A service that owns jobs. Its user has no usable password: it cannot log in."""

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="service")
    created_at = models.DateTimeField(auto_now_add=True)
    # Celery task-name prefixes this service may name as a job's `task` (grant_tasks):
    # "billing." grants billing.tasks.sync; "billing" grants billing and billing.*
    # (jobs.validators.task_name_granted). Empty: no task at all.
    task_prefixes = models.JSONField(default=list, blank=True)
    # Who is told about its jobs' dead (and skipped) runs when a job has no `notify`
    # of its own: an e-mail address or an https URL (jobs.validators.validate_notify).
    # Blank: the account's e-mail (runs.notices.recipients).
    notify = models.CharField(max_length=2000, blank=True)

    def __str__(self) -> str:
        return self.user.username


NOTIFY_ON_CHOICES = ("dead", "skipped")


def default_notify_on() -> list[str]:
    return ["dead"]


class Job(models.Model):
    class Misfire(models.TextChoices):
        RUN_ONCE = "run_once"
        SKIP = "skip"
        RUN_ALL = "run_all"

    class Overlap(models.TextChoices):
        # What happens to a time that passes while the job's run is in flight (from its
        # claim to its outcome): runs.nextrun.job_next_runs. `allow`: runs side by
        # side, the next run made at the claim (runs.services._detach_claimed).
        SKIP = "skip"
        BUFFER_ONE = "buffer_one"
        ALLOW = "allow"

    class Backoff(models.TextChoices):
        EXPONENTIAL = "exponential"
        LINEAR = "linear"
        FIXED = "fixed"

    class State(models.TextChoices):
        ACTIVE = "active"
        PAUSED = "paused"
        COMPLETED = "completed"
        DELETED = "deleted"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs")
    name = models.CharField(max_length=200, blank=True)
    # Exactly one timing: a 5-field cron `schedule`, a list of them (`schedule_list`,
    # the union of their times), an interval (`every_seconds`, counted in UTC from
    # `starts_at` or the job's creation), or a one-off `run_at` (from `at` or `delay`).
    # The one reading of them is `timetable()` (jobs.schedule.Timetable).
    schedule = models.CharField(max_length=200, blank=True)
    schedule_list = models.JSONField(default=list, blank=True)
    every_seconds = models.PositiveIntegerField(null=True, blank=True)
    run_at = models.DateTimeField(null=True, blank=True)
    # Recurring jobs only: no run before starts_at or after ends_at; dates (YYYY-MM-DD,
    # in `timezone`) on which no run happens (each such time gets a `skipped` row).
    starts_at = models.DateTimeField(null=True, blank=True)
    ends_at = models.DateTimeField(null=True, blank=True)
    exclude = models.JSONField(default=list, blank=True)
    timezone = models.CharField(max_length=64, default="UTC")
    # Exactly one of `target` (an http(s) URL) and `task` (a Celery task name, with
    # `args`, `kwargs` and `queue`): jobs.serializers checks it, runs.publishing sends it.
    target = models.URLField(max_length=2000, blank=True)
    task = models.CharField(max_length=200, blank=True)
    args = models.JSONField(default=list, blank=True)
    kwargs = models.JSONField(default=dict, blank=True)
    queue = models.CharField(max_length=200, default="celery", blank=True)
    method = models.CharField(max_length=10, default="POST")
    headers = models.JSONField(default=dict, blank=True)  # the non-secret ones, in clear
    secret_headers = models.TextField(blank=True)  # encrypted JSON (jobs.secrets)
    secret_header_names = models.JSONField(default=list, blank=True)  # names marked secret by the caller
    payload = models.JSONField(null=True, blank=True)
    window_seconds = models.PositiveIntegerField(default=0)
    misfire = models.CharField(max_length=16, choices=Misfire.choices, default=Misfire.RUN_ONCE)
    overlap = models.CharField(max_length=16, choices=Overlap.choices, default=Overlap.SKIP)
    # After this many of its normal runs in a row end dead, the job pauses itself (0: never).
    pause_after_failures = models.PositiveSmallIntegerField(default=0)
    retry_max = models.PositiveSmallIntegerField(default=3)
    retry_backoff = models.CharField(max_length=16, choices=Backoff.choices, default=Backoff.EXPONENTIAL)
    retry_base_seconds = models.PositiveIntegerField(default=10)
    retry_cap_seconds = models.PositiveIntegerField(default=3600)
    timeout_seconds = models.PositiveIntegerField(default=30)
    # An e-mail address (at most 254 characters) or an https URL (at most 2000, like
    # `target`): jobs.validators.validate_notify keeps values inside the column.
    notify = models.CharField(max_length=2000, blank=True)
    # Which runs the owner is told about: "dead" (the default), and "skipped" if asked.
    notify_on = models.JSONField(default=default_notify_on, blank=True)
    paused = models.BooleanField(default=False)
    # A paused job with this set resumes by itself at that time (the scanner: scanners.scan).
    paused_until = models.DateTimeField(null=True, blank=True)
    state = models.CharField(max_length=16, choices=State.choices, default=State.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    deleted_at = models.DateTimeField(null=True, blank=True)
    # When the schedule, zone, one-off time (or every, starts_at, ends_at, exclude) last changed: the timetable goes on from
    # there, never from before (runs.nextrun.job_next_run_time).
    timing_changed_at = models.DateTimeField(null=True, blank=True)
    # Code-owned: the module (`billing.schedules`) whose SCHEDULES define this job;
    # `sync_jobs` writes it, the API and the admin refuse to change it (jobs.code).
    # Empty for a job made through the API or the admin.
    code_source = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        db_table = "jobs"
        indexes = [
            models.Index(fields=["owner", "-id"], name="jobs_owner_idx"),
            # The scanner's "which paused jobs are due to resume?": jobs with a resume time only.
            models.Index(
                fields=["paused_until"], condition=models.Q(paused_until__isnull=False), name="jobs_paused_until_idx"

            ),
        ]
        constraints = [
            # A deleted job never resumes: a resume time it kept would stay in the
            # scanner's resume read (jobs_paused_until_idx) for ever, ahead of live jobs.
            models.CheckConstraint(
                condition=~(models.Q(state="deleted") & models.Q(paused_until__isnull=False)),
                name="jobs_deleted_no_resume",
            ),
            # Exactly one of a URL target and a Celery task.
            models.CheckConstraint(
                condition=(models.Q(target="") & ~models.Q(task="")) | (~models.Q(target="") & models.Q(task="")),
                name="jobs_target_or_task",
            ),
            # sync_jobs keys code-owned jobs by (owner, name): one live job per key.
            models.UniqueConstraint(
                fields=["owner", "name"],
                condition=~models.Q(code_source="") & ~models.Q(state="deleted"),
                name="jobs_code_owned_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.name}".strip()

    @property
    def public_id(self) -> str:
        return format_id("job", self.pk)

    @property
    def is_task(self) -> bool:
        """A Celery task target (published to SCHEDULER_TASK_BROKER_URL), not a URL."""
        return bool(self.task)

    @property
    def is_code_owned(self) -> bool:
        return bool(self.code_source)

    @property
    def is_recurring(self) -> bool:
        return bool(self.schedule or self.schedule_list or self.every_seconds)

    @property
    def cron_expressions(self) -> tuple[str, ...]:
        """The job's cron expressions: its `schedule`, or each of its `schedule_list`."""
        if self.schedule_list:
            return tuple(self.schedule_list)
        return (self.schedule,) if self.schedule else ()

    def timetable(self) -> Timetable:
        """The job's recurring timing as the clock's pure value (jobs.schedule)."""
        every = timedelta(seconds=self.every_seconds) if self.every_seconds else None
        anchor = self.starts_at or self.created_at
        return Timetable(
            zone=self.timezone,
            crons=self.cron_expressions,
            every=every,
            # With no starts_at the first run is one interval after the creation.
            anchor=(anchor.replace(microsecond=0) if anchor is not None else None) if every else None,
            anchor_runs=self.starts_at is not None,
            starts_at=self.starts_at,
            ends_at=self.ends_at,
            exclude=frozenset(date.fromisoformat(d) for d in self.exclude or ()),
        )

    @property
    def partition(self) -> int:
        # Every run of a job lives in the job's partition; fixed per deployment.
        return self.pk % settings.SCHEDULER_PARTITIONS


class SigningSecret(models.Model):
    """A service's key for X-Signature. After a rotation the old one signs too until `retires_at`."""

    service = models.ForeignKey(ServiceAccount, on_delete=models.CASCADE, related_name="signing_secrets")
    secret = models.TextField()  # encrypted at rest (jobs.secrets)
    created_at = models.DateTimeField(auto_now_add=True)
    retires_at = models.DateTimeField(null=True, blank=True)  # null: current

    class Meta:
        db_table = "signing_secrets"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.service} secret {self.pk}"


class AuditEntry(models.Model):
    """Who did what to which job or run, when, and from where."""

    class Via(models.TextChoices):
        API = "api"
        ADMIN = "admin"
        COMMAND = "command"

    at = models.DateTimeField(db_index=True)
    actor = models.CharField(max_length=150)  # a user name, a service name, or the command's OS user
    via = models.CharField(max_length=16, choices=Via.choices)
    action = models.CharField(max_length=40)  # created, changed, paused, resumed, triggered, requeued, deleted...
    object_type = models.CharField(max_length=16)  # job, run, service, target
    object_id = models.CharField(max_length=64)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )  # whose job or run it was: scopes the audit log per service
    remote_addr = models.CharField(max_length=64, blank=True)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        db_table = "audit_log"
        verbose_name_plural = "audit entries"
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"], name="audit_object_idx")]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%dT%H:%M:%SZ} {self.actor} {self.action} {self.object_type} {self.object_id}"


class ServiceToken(models.Model):
    """An API token, stored as its SHA-256 only (jobs.tokens): the token itself is
    shown once, when it is made. `prefix` (its first characters) names it in the
    admin and the audit log; a service may hold several, each revoked on its own."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="service_tokens")
    prefix = models.CharField(max_length=8)
    digest = models.CharField(max_length=64, unique=True)  # hex SHA-256 of the whole token
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "service_tokens"
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.prefix}…"


class CreateKey(models.Model):
    """An `Idempotency-Key` a service sent with `POST /api/jobs/`, and the answer it got:
    the same key from the same service within CREATE_KEY_HOURS replays that answer and
    creates nothing (jobs.api). Written in the job's own transaction, so a create that
    committed has its key, and a retry after a dropped connection finds it."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    key = models.CharField(max_length=255)
    body_sha256 = models.CharField(max_length=64)  # of the request body as parsed, keys sorted
    job = models.ForeignKey(Job, null=True, on_delete=models.SET_NULL, related_name="+")
    answer = models.JSONField()  # the 201's body
    created_at = models.DateTimeField()

    class Meta:
        db_table = "job_create_keys"
        constraints = [models.UniqueConstraint(fields=["owner", "key"], name="job_create_keys_owner_key")]
        indexes = [models.Index(fields=["created_at"], name="job_create_keys_created")]


CREATE_KEY_HOURS = 24
