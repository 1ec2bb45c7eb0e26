"""The API's shapes: job input is checked here, field by field, in words.

Every check a user can fail says what is wrong and names the field, using the
sentences from `jobs.schedule` and `jobs.validators` so the API and the admin
say the same thing. Nothing here writes: `JobSerializer.service_fields()` hands
the checked values to `jobs.services`.

Bounds chosen here and in jobs.fields, beyond the field rules in docs/reference.md (they are in the
error texts too):
window 0s..1d; delay 0s..365d; timeout 1s..1h; retry.max 0..100;
retry.base 1s..1d; retry.cap 1s..7d and at least base; every 1s..366d;
starts_at / ends_at from 1970 to 100 years ahead; a schedule list at most 10
expressions; exclude at most 1000 dates; headers at most 16 KiB
in all; payload at most settings.MAX_PAYLOAD_BYTES as sent, nested at most 64
deep; an `at` no more than a year in the past nor 100 years ahead.
"""
from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

from jobs import schedule, selectors
from jobs.fields import (
    AT_FUTURE_LIMIT, AT_PAST_LIMIT, AtField, BOUND_EARLIEST, DurationField, ExcludeField, HeadersField,
    MAX_PAUSE_AFTER_FAILURES, MAX_SECRET_HEADER_NAMES, NotifyField, NotifyOnField, PayloadField,
    RECURRING_ONLY, ScheduleField, TARGET_INPUTS, TASK_ONLY, TIMING_INPUTS, TaskArgsField, TaskKwargsField,
    URL_ONLY, UtcTimeField, iso_z, _text_problem,
)
from jobs.models import AuditEntry, Job
from jobs.public_ids import format_id
from jobs.secrets import REDACTED, decrypt_headers, is_secret
from jobs.validators import (
    first_control_character,
    queue_refusal,
    validate_header_name,
    validate_method,
    validate_queue,
    validate_target,
    validate_task_name,
)
from runs.models import Run, RunEvent

# --------------------------------------------------------------------------- input checks


class StrictFieldsMixin:
    """Unknown fields are refused, not ignored: a typo ("shedule") must not pass silently."""

    def _unknown_field_errors(self, data: Any) -> dict[str, list[str]]:
        if not isinstance(data, Mapping):
            return {}
        fields = self.fields  # type: ignore[attr-defined]
        writable = {name for name, field in fields.items() if not field.read_only}
        known = ", ".join(sorted(writable))
        errors = {}
        for key in data:
            if key in writable:
                continue
            if key == "":  # an error keyed "" would name nothing
                errors.setdefault("non_field_errors", []).append(f"a field with an empty name; the fields are {known}")
            elif key in fields:
                errors[str(key)] = ["is read-only and cannot be set"]
            else:
                errors[str(key)] = [f"unknown field; the fields are {known}"]
        return errors

    def to_internal_value(self, data: Any) -> Any:
        unknown = self._unknown_field_errors(data)
        try:
            value = super().to_internal_value(data)  # type: ignore[misc]
        except ValidationError as exc:
            detail = exc.detail if isinstance(exc.detail, dict) else {}
            raise ValidationError({**unknown, **detail} if detail else exc.detail) from exc
        if unknown:
            raise ValidationError(unknown)
        return value


class RetrySerializer(StrictFieldsMixin, serializers.Serializer):
    """How a failed call is tried again: up to `max` more tries, waiting `base` first and
    growing by `backoff` up to `cap`, with jitter."""

    # Flattened onto the job's retry_* columns (source="*" on the job serializer's field).

    max = serializers.IntegerField(
        source="retry_max",
        required=False,
        min_value=0,
        max_value=100,
        help_text="Tries after the first, 0 to 100 (default 3).",
        error_messages={"min_value": "must be between 0 and 100", "max_value": "must be between 0 and 100"},
    )
    backoff = serializers.ChoiceField(
        source="retry_backoff",
        required=False,
        choices=Job.Backoff.choices,
        help_text="exponential (default), linear or fixed; always with jitter.",
        error_messages={"invalid_choice": 'unknown backoff "{input}": use exponential, linear or fixed'},
    )
    base = DurationField(
        source="retry_base_seconds",
        required=False,
        low=timedelta(seconds=1),
        high=timedelta(days=1),
        help_text='The first delay, 1s to 1d (default "10s").',
    )
    cap = DurationField(
        source="retry_cap_seconds",
        required=False,
        low=timedelta(seconds=1),
        high=timedelta(days=7),
        help_text='The longest delay, 1s to 7d, at least base (default "1h").',
    )


class NextRunSerializer(serializers.Serializer):
    id = serializers.CharField(source="public_id", read_only=True)
    scheduled_for = UtcTimeField(read_only=True)
    due_at = UtcTimeField(read_only=True)
    status = serializers.ChoiceField(choices=Run.Status.choices, read_only=True)


def _seconds_text(seconds: int) -> str:
    return schedule.format_duration(timedelta(seconds=seconds))


def _model_default(name: str) -> Any:
    return Job._meta.get_field(name).get_default()


class JobSerializer(StrictFieldsMixin, serializers.Serializer):
    """A job: what to call (`target`), with what (`method`, `headers`, `payload`),
    and when (exactly one of `schedule`, `at` or `delay`)."""

    # The docstring above is the schema's description of Job and PatchedJob, for API
    # users. For us: input names are the contract's; `source` maps them onto the model's
    # columns, and `validate` turns schedule/at/delay into schedule/run_at.

    id = serializers.CharField(source="public_id", read_only=True, help_text="Like job_88213.")
    name = serializers.CharField(required=False, allow_blank=True, max_length=200)
    schedule = ScheduleField(required=False, allow_null=True)
    every = DurationField(
        source="every_seconds",
        required=False,
        allow_null=True,
        low=timedelta(seconds=1),  # jobs.schedule.EVERY_SHORTEST / EVERY_LONGEST (the name
        high=timedelta(days=366),  # `schedule` is the field here, not the module)
        help_text="An interval, 1s to 366d and no shorter than SCHEDULER_MIN_INTERVAL: runs at starts_at + k * "
        "every (or, with no starts_at, one interval after the job's creation and on from there), counted in "
        "UTC, so a DST change does not move them.",
    )
    at = AtField(
        source="run_at",
        required=False,
        allow_null=True,
        help_text="One time, ISO 8601; with no offset it is a wall-clock time in `timezone`. "
        "A fraction is rounded up to the next whole second.",
    )
    delay = DurationField(
        write_only=True,
        required=False,
        allow_null=True,
        low=timedelta(0),
        high=timedelta(days=365),
        help_text="A duration from now (rounded up to the next whole second).",
    )
    starts_at = AtField(
        required=False,
        allow_null=True,
        help_text="Recurring jobs only: no run before this time (ISO 8601; with no offset, a wall-clock time in "
        "`timezone`). An `every` job counts its intervals from it.",
    )
    ends_at = AtField(
        required=False,
        allow_null=True,
        help_text="Recurring jobs only: no run after this time; past it the job is `completed`. After starts_at.",
    )
    exclude = ExcludeField(required=False)
    timezone = serializers.CharField(required=False, max_length=64, help_text='An IANA name (default "UTC").')
    # Not trimmed: a target is checked exactly as it will be called (a space or a line
    # break anywhere is refused, not quietly removed).
    target = serializers.CharField(
        trim_whitespace=False,
        required=False,
        allow_null=True,
        help_text="An http(s) URL. Exactly one of target and task; null on a task job.",
    )
    task = serializers.CharField(
        trim_whitespace=False,
        required=False,
        allow_null=True,
        error_messages={"blank": "must be a Celery task name like billing.tasks.sync, not empty"},
        help_text="A Celery task name (dotted Python identifiers, at most 200 characters), under a prefix "
        "granted to the owning service (grant_tasks). Exactly one of target and task. Its run publishes the "
        "task to SCHEDULER_TASK_BROKER_URL with message headers idempotency_key, fence_token, run_id, attempt "
        "and scheduled_for, and succeeds when the broker has accepted it. Null on a URL job.",
    )
    args = TaskArgsField(
        required=False, allow_null=True,
        help_text="A task job's positional arguments (a list, default []); null on a URL job.",
    )
    kwargs = TaskKwargsField(
        required=False, allow_null=True,
        help_text="A task job's keyword arguments (an object, default {}); null on a URL job.",
    )
    queue = serializers.CharField(
        required=False, allow_null=True, trim_whitespace=False,
        error_messages={"blank": 'must not be empty (the default is "celery")'},
        help_text='A task job\'s queue (left out: Celery\'s default queue, "celery"): letters, digits, _, . and -, '
        "at most 100 characters; not the scheduler's own queue nor a broker key (runs, celery, celeryev*, "
        "unacked*, _kombu.*, *.pidbox). pause_target celery:<queue> holds its runs. Null on a URL job.",
    )
    method = serializers.CharField(
        required=False, max_length=10, allow_null=True,
        help_text="GET, POST (default), PUT, PATCH or DELETE. URL jobs only (null on a task job).",
    )
    headers = HeadersField(required=False)
    secret_headers = serializers.ListField(
        source="secret_header_names",
        child=serializers.CharField(max_length=200),
        required=False,
        max_length=MAX_SECRET_HEADER_NAMES,
        error_messages={"not_a_list": 'must be a list of header names, not {input_type}'},
        help_text="Names of further headers to store encrypted and show as \"***\".",
    )
    payload = PayloadField(
        required=False, allow_null=True, help_text="Any JSON, sent as the body. URL jobs only."
    )
    window = DurationField(
        source="window_seconds", required=False, low=timedelta(0), high=timedelta(days=1),
        help_text='The run may start any time up to this long after its time, 0s to 1d (default "0s").',
    )
    misfire = serializers.ChoiceField(
        required=False,
        choices=Job.Misfire.choices,
        error_messages={"invalid_choice": 'unknown misfire policy "{input}": use run_once, skip or run_all'},
        help_text="run_once (default), skip or run_all.",
    )
    overlap = serializers.ChoiceField(
        required=False,
        choices=Job.Overlap.choices,
        error_messages={"invalid_choice": 'unknown overlap policy "{input}": use skip, buffer_one or allow'},
        help_text="What happens to a time that passes while the job's run is in flight (from its claim to its "
        "outcome): skip (default: a `skipped` run with reason `overlap`; the next run is the next future "
        "time), buffer_one (the latest such time runs as soon as the run in flight ends, the others are "
        "skipped) or allow (runs may overlap: the next run is made when a run is claimed, so every time runs, "
        "beside the runs still in flight; the job still has exactly one waiting run, its `next_run`). Those "
        "times are the overlap policy's, not the misfire policy's.",
    )
    pause_after_failures = serializers.IntegerField(
        required=False,
        min_value=0,
        max_value=MAX_PAUSE_AFTER_FAILURES,
        help_text="After this many of its runs in a row end dead, the job pauses itself and its owner is told "
        f"(0 to {MAX_PAUSE_AFTER_FAILURES}; default 0: never).",
    )
    retry = RetrySerializer(
        source="*",
        required=False,
        error_messages={"invalid": 'must be an object like {{"max": 5, "backoff": "exponential"}}, not {datatype}'},
    )
    timeout = DurationField(
        source="timeout_seconds", required=False, low=timedelta(seconds=1), high=timedelta(hours=1),
        help_text='How long one call may take, 1s to 1h (default "30s").',
    )
    notify = NotifyField(
        required=False,
        trim_whitespace=False,
        allow_null=True,
        allow_blank=True,
        max_length=2000,
        help_text="An e-mail address, or an https URL that receives a signed JSON notice.",
    )
    notify_on = NotifyOnField(
        required=False,
        help_text='Which runs `notify` is told about: ["dead"] (the default), or ["dead", "skipped"].',
    )
    paused = serializers.BooleanField(required=False)
    paused_until = UtcTimeField(
        required=False,
        allow_null=True,
        help_text="A paused job resumes by itself at this time (ISO 8601, UTC when it has no offset; rounded up "
        'to a whole second), under its misfire policy. Only with "paused": true (in the same request, or on '
        "a job already paused) and only in the future; null clears it; resuming clears it.",
    )
    state = serializers.ChoiceField(choices=Job.State.choices, read_only=True)
    defined_in = serializers.SerializerMethodField(
        help_text="The module whose SCHEDULES define this job (sync_jobs), like billing.schedules; "
        "null for a job made through the API or the admin. A job defined in code changes there."
    )
    next_run = serializers.SerializerMethodField()
    created_at = UtcTimeField(read_only=True)
    updated_at = UtcTimeField(read_only=True)

    # ---- output

    def to_representation(self, instance: Job) -> dict[str, Any]:
        data = super().to_representation(instance)
        if getattr(instance, "task", ""):
            # A task job: no URL, and no HTTP-only fields (null or empty, so a job read
            # back can be sent again).
            data.update(target=None, method=None, headers={}, secret_headers=[], payload=None)
        else:
            data.update(task=None, args=None, kwargs=None, queue=None)
        return data

    @extend_schema_field(serializers.CharField(allow_null=True))
    def get_defined_in(self, job: Job) -> str | None:
        return job.code_source or None

    @extend_schema_field(NextRunSerializer(allow_null=True))
    def get_next_run(self, job: Job) -> dict[str, Any] | None:
        run = selectors.open_run_of(job)
        return NextRunSerializer(run).data if run is not None else None

    # ---- one field at a time

    def validate_every(self, value: int | None) -> int | None:
        if value is None:
            return None
        floor = schedule.parse_duration(settings.SCHEDULER_MIN_INTERVAL)
        if timedelta(seconds=value) < floor:
            raise ValidationError(
                f"{_seconds_text(value)} is shorter than the shortest interval allowed here, "
                f"{schedule.format_duration(floor)} (SCHEDULER_MIN_INTERVAL)"
            )
        return value

    def validate_timezone(self, value: str) -> str:
        try:
            schedule.get_zone(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        return value

    def validate_target(self, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            validate_target(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        return value

    def validate_task(self, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return validate_task_name(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc

    def validate_name(self, value: str) -> str:
        """A name is shown on pages, in lists and on operators' terminals: no control
        characters (a terminal's escape sequences among them), nothing PostgreSQL cannot store."""
        bad = first_control_character(value)
        if bad is not None:
            raise ValidationError(f"must not contain control characters (found U+{ord(bad):04X})")
        problem = _text_problem(value)
        if problem:
            raise ValidationError(problem)
        return value

    def validate_queue(self, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            validate_queue(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        # The value a job already holds round-trips (a PUT of what a GET gave: the
        # default queue reads back as "celery"); a new name is checked.
        if self.instance is None or getattr(self.instance, "queue", None) != value:
            refusal = queue_refusal(value)
            if refusal:
                raise ValidationError(refusal)
        return value

    def validate_method(self, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return validate_method(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc

    def validate_secret_headers(self, names: list[str]) -> list[str]:
        problems = []
        for name in names:
            try:
                validate_header_name(name)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValidationError(problems)
        return names

    # ---- across fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs = dict(attrs)
        self._resolve_timing(attrs)
        self._resolve_bounds(attrs)
        self._check_paused_until(attrs)
        self._check_retry_cap(attrs)
        if self._resolve_target(attrs) == "task":
            self._check_task_grant(attrs)
        else:
            self._keep_stored_secrets(attrs)
        return attrs

    def _resolve_target(self, attrs: dict[str, Any]) -> str:
        """Exactly one of target/task on create, at most one on PATCH (it switches the
        kind, and clears what belongs to the other kind). A null counts as not given.
        What applies to the other kind only is a 400 naming it. Returns "url" or "task"."""
        for name in ("target", "task", "method", "args", "kwargs", "queue"):
            if name in attrs and attrs[name] is None:
                attrs.pop(name)
        given = [name for name in TARGET_INPUTS if name in attrs]
        if len(given) > 1:
            message = "give only one of target (an http(s) URL) or task (a Celery task name); this request gives both"
            raise ValidationError({name: [message] for name in TARGET_INPUTS})
        if not given and self.instance is None:
            message = "one of target (an http(s) URL) or task (a Celery task name) is required"
            raise ValidationError({name: [message] for name in TARGET_INPUTS})
        if given:
            kind = "task" if given[0] == "task" else "url"
        else:
            kind = "task" if getattr(self.instance, "task", "") else "url"
        self._refuse_other_kind(attrs, kind)
        was = "task" if getattr(self.instance, "task", "") else "url"
        switching = self.instance is not None and bool(given) and kind != was
        if switching and kind == "task":  # a URL job becomes a task job: its HTTP fields go
            attrs.update(target="", method=_model_default("method"), payload=None, headers={},
                         secret_header_names=[])
        elif switching:  # a task job becomes a URL job: its task fields go
            attrs.update(task="", args=[], kwargs={}, queue=_model_default("queue"))
        return kind

    @staticmethod
    def _refuse_other_kind(attrs: dict[str, Any], kind: str) -> None:
        errors = {}
        if kind == "task":
            given = {
                "method": "method" in attrs,
                "headers": bool(attrs.get("headers")),
                "secret_headers": bool(attrs.get("secret_header_names")),
                "payload": attrs.get("payload") is not None,
            }
            for name in (n for n in URL_ONLY if given[n]):
                errors[name] = ["applies to a URL target only; a task job gets args, kwargs and queue"]
        else:
            for name in (n for n in TASK_ONLY if n in attrs):
                errors[name] = ["applies to a task target only; a URL job gets method, headers and payload"]
        if errors:
            raise ValidationError(errors)

    def _owner(self) -> Any:
        if self.instance is not None:
            return self.instance.owner
        if "owner" in self.context:
            return self.context["owner"]
        request = self.context.get("request")
        return getattr(request, "user", None)

    def _check_task_grant(self, attrs: dict[str, Any]) -> None:
        """A service names only tasks under its granted prefixes (checked again at call
        time: runs.publishing)."""
        if "task" not in attrs:
            return
        refusal = selectors.task_refusal(self._owner(), attrs["task"])
        if refusal:
            raise ValidationError({"task": [refusal]})

    def _zone(self, attrs: dict[str, Any]) -> str:
        if "timezone" in attrs:
            return attrs["timezone"]
        return self.instance.timezone if self.instance is not None else _model_default("timezone")

    def _resolve_timing(self, attrs: dict[str, Any]) -> None:
        """Exactly one of schedule/every/at/delay on create, at most one on PATCH (it
        switches the kind, and the other kinds' columns are cleared). A null counts as
        not given, so a job read back can be sent again."""
        raw = {
            "schedule": attrs.pop("schedule", None),
            "every": attrs.pop("every_seconds", None),
            "at": attrs.pop("run_at", None),
            "delay": attrs.pop("delay", None),
        }
        given = {name: value for name, value in raw.items() if value is not None}
        if len(given) > 1:
            both = " and ".join(given)
            message = f"give only one of schedule, every, at or delay; this request gives {both}"
            raise ValidationError({name: [message] for name in given})
        if not given and self.instance is None:
            message = (
                "one of schedule (a cron expression), every (an interval), at (a time) or delay "
                "(a duration from now) is required"
            )
            raise ValidationError({name: [message] for name in TIMING_INPUTS})
        if not given:
            return
        cleared = {"schedule": "", "schedule_list": [], "every_seconds": None, "run_at": None}
        attrs.update(cleared)
        if "schedule" in given and isinstance(given["schedule"], list):
            attrs["schedule_list"] = given["schedule"]
        elif "schedule" in given:
            attrs["schedule"] = given["schedule"]
        elif "every" in given:
            attrs["every_seconds"] = given["every"]
        elif "at" in given:
            attrs["run_at"] = self._resolve_at(given["at"], self._zone(attrs))
        else:
            attrs["run_at"] = schedule.round_up_to_second(timezone.now() + timedelta(seconds=given["delay"]))

    def _resolve_bounds(self, attrs: dict[str, Any]) -> None:
        """starts_at, ends_at (resolved in the job's zone) and exclude: recurring jobs
        only (a 400 on a one-off; a PATCH that makes a job a one-off drops them), and
        ends_at after starts_at."""
        zone = self._zone(attrs)
        for name in ("starts_at", "ends_at"):
            if attrs.get(name) is not None:
                attrs[name] = self._resolve_bound(name, attrs[name], zone)
        recurring = any(self._current(attrs, name) for name in ("schedule", "schedule_list", "every_seconds"))
        if not recurring:
            given = [name for name in RECURRING_ONLY if attrs.get(name)]
            if given:
                message = "only a recurring job (schedule or every) can have {}; this one runs once (at or delay)"
                raise ValidationError({name: [message.format(name)] for name in given})
            if self.instance is not None:
                attrs.update(starts_at=None, ends_at=None, exclude=[])
            return
        starts, ends = self._current(attrs, "starts_at"), self._current(attrs, "ends_at")
        if starts is not None and ends is not None and ends <= starts:
            raise ValidationError({"ends_at": [f"must be after starts_at ({iso_z(starts)}), not {iso_z(ends)}"]})

    @staticmethod
    def _resolve_bound(name: str, text: str, zone: str) -> datetime:
        """starts_at / ends_at: any time from 1970 on, at most 100 years ahead."""
        try:
            when = schedule.resolve_at(text, zone)
        except ValueError as exc:
            raise ValidationError({name: [str(exc)]}) from exc
        if when < BOUND_EARLIEST:
            raise ValidationError({name: [f"{text!r} is before 1970-01-01T00:00:00Z"]})
        if when > timezone.now() + AT_FUTURE_LIMIT:
            raise ValidationError({name: [f"{text!r} is more than 100 years ahead"]})
        return when

    def _resolve_at(self, text: str, zone: str) -> datetime:
        try:
            when = schedule.resolve_at(text, zone)
        except (ValueError, OverflowError) as exc:
            # OverflowError: a time at the very end of year 9999 cannot be rounded up.
            message = str(exc) if isinstance(exc, ValueError) else f"{text!r} is out of range"
            raise ValidationError({"at": [message]}) from exc
        now = timezone.now()
        if when < now - AT_PAST_LIMIT:
            raise ValidationError({"at": [f"{text!r} is more than a year in the past"]})
        if when > now + AT_FUTURE_LIMIT:
            raise ValidationError({"at": [f"{text!r} is more than 100 years ahead"]})
        return when

    def _current(self, attrs: dict[str, Any], name: str) -> Any:
        if name in attrs:
            return attrs[name]
        return getattr(self.instance, name) if self.instance is not None else _model_default(name)

    def _check_paused_until(self, attrs: dict[str, Any]) -> None:
        """A resume time needs a paused job (a job not paused has nothing to resume:
        400, not a pause the caller did not ask for) and must be ahead (a time that
        has passed would resume at once: 400, "paused": false says that plainly)."""
        until = attrs.get("paused_until")
        if until is None:
            return
        until = schedule.round_up_to_second(until)
        attrs["paused_until"] = until
        if not self._current(attrs, "paused"):
            raise ValidationError({"paused_until": [
                'only a paused job resumes by itself: send "paused": true with it (the job is not paused)'
            ]})
        if until <= timezone.now():
            raise ValidationError({"paused_until": [
                f"{iso_z(until)} is not in the future; to resume the job now, send \"paused\": false"
            ]})
        if until > timezone.now() + AT_FUTURE_LIMIT:
            raise ValidationError({"paused_until": [f"{iso_z(until)} is more than 100 years ahead"]})

    def _check_retry_cap(self, attrs: dict[str, Any]) -> None:
        base = self._current(attrs, "retry_base_seconds")
        cap = self._current(attrs, "retry_cap_seconds")
        if cap < base:
            message = f"must be at least base ({_seconds_text(base)}), not {_seconds_text(cap)}"
            raise ValidationError({"retry": {"cap": [message]}})

    def _keep_stored_secrets(self, attrs: dict[str, Any]) -> None:
        """On PATCH, a secret header sent back as "***" keeps its stored value (a job
        read and sent back must not overwrite its credentials with the placeholder);
        new secret_headers with no headers re-split the stored ones under the new names."""
        job = self.instance
        if job is None or ("headers" not in attrs and "secret_header_names" not in attrs):
            return
        stored = decrypt_headers(job.secret_headers)
        names = attrs.get("secret_header_names", job.secret_header_names)
        self._refuse_unmarking_without_a_value(stored, names, attrs.get("headers"))
        if "headers" not in attrs:
            attrs["headers"] = {**(job.headers or {}), **stored}
            return
        attrs["headers"] = {
            key: stored[key] if value == REDACTED and key in stored and is_secret(key, names) else value
            for key, value in attrs["headers"].items()
        }

    @staticmethod
    def _refuse_unmarking_without_a_value(
        stored: dict[str, str], names: list[str], headers: dict[str, str] | None
    ) -> None:
        """A stored secret may stop being secret only with its value sent again: the
        caller then already knows it. Otherwise un-marking it would hand the stored
        value back in clear (issue 13, finding 10)."""
        given = {key.lower(): value for key, value in (headers or {}).items()}
        for key in sorted(stored):
            if is_secret(key, names):
                continue
            if headers is None or given.get(key.lower()) == REDACTED:
                message = (
                    f"{key!r} holds a stored secret value; to stop keeping it secret, send its value again "
                    "in headers (or leave it out of headers to remove it)"
                )
                errors = {"secret_headers": [message]}
                if headers is not None:
                    errors["headers"] = [message]
                raise ValidationError(errors)

    # ---- to the service

    def service_fields(self) -> dict[str, Any]:
        """validated_data under the names jobs.services takes (model columns, plus
        `headers` and `secret_headers`, which the service splits and encrypts)."""
        return self.service_fields_of(self.validated_data)

    @staticmethod
    def service_fields_of(validated: dict[str, Any]) -> dict[str, Any]:
        """service_fields() for one item of a `many=True` validation (sync_jobs checks
        a thousand definitions with one serializer)."""
        fields = dict(validated)
        if "secret_header_names" in fields:
            fields["secret_headers"] = fields.pop("secret_header_names")
        if "notify" in fields and fields["notify"] is None:
            fields["notify"] = ""
        return fields


# --------------------------------------------------------------------------- runs


class RunSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True, help_text="Like run_5521.")
    job = serializers.SerializerMethodField()
    scheduled_for = UtcTimeField(read_only=True, help_text="The nominal time.")
    due_at = UtcTimeField(read_only=True, help_text="When it may start: inside the window, or the retry time.")
    idempotency_key = serializers.CharField(read_only=True, help_text="<job id>@<scheduled_for>")
    started_at = UtcTimeField(read_only=True, allow_null=True)
    finished_at = UtcTimeField(read_only=True, allow_null=True)

    class Meta:
        model = Run
        fields = (
            "id", "job", "scheduled_for", "due_at", "status", "attempt", "fence",
            "idempotency_key", "started_at", "finished_at", "last_error",
        )
        read_only_fields = fields

    def get_job(self, run: Run) -> str:
        return format_id("job", run.job_id)


@extend_schema_field({"type": "object", "additionalProperties": {}, "example": {"fence": 41, "worker": "w1"}})
class EventDetailField(serializers.JSONField):
    """An event's detail: an object whose keys depend on the event's type."""


class RunEventSerializer(serializers.ModelSerializer):
    at = UtcTimeField(read_only=True)
    detail = EventDetailField(read_only=True)

    class Meta:
        model = RunEvent
        fields = ("at", "type", "detail")
        read_only_fields = fields


class RunDetailSerializer(RunSerializer):
    # The event rows and the entries on the run's row (runs.timeline), as selectors.run_get reads them.
    events = RunEventSerializer(many=True, read_only=True, source="timeline", help_text="The run's timeline, oldest first.")

    class Meta(RunSerializer.Meta):
        fields = (*RunSerializer.Meta.fields, "events")
        read_only_fields = fields


# --------------------------------------------------------------------------- audit


@extend_schema_field({"type": "object", "additionalProperties": {}, "example": {"fields": ["schedule"]}})
class AuditDetailField(serializers.JSONField):
    """What changed: field names and small facts, never a value that could be secret."""


class AuditEntrySerializer(serializers.ModelSerializer):
    at = UtcTimeField(read_only=True)
    actor = serializers.CharField(read_only=True, help_text="A service or user name, or the OS user of a command.")
    via = serializers.ChoiceField(choices=AuditEntry.Via.choices, read_only=True)
    action = serializers.CharField(read_only=True, help_text="created, changed, paused, resumed, deleted, ...")
    object_type = serializers.CharField(read_only=True, help_text="job, run, service or target.")
    object_id = serializers.CharField(read_only=True, help_text="Like job_12, run_5, a service name or a host.")
    remote_addr = serializers.CharField(read_only=True, help_text="The caller's address, or a command's host.")
    detail = AuditDetailField(read_only=True)

    class Meta:
        model = AuditEntry
        fields = ("at", "actor", "via", "action", "object_type", "object_id", "remote_addr", "detail")
        read_only_fields = fields
