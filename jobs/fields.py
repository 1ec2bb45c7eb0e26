"""The API's field types (jobs.serializers uses them): each checks its value where it
ends up (a cron expression by the cron library, a header on the wire, a payload
under its size and depth bounds) and says what is wrong, naming the field.
"""
from __future__ import annotations

import json
import math
import re
from datetime import UTC, date, datetime, timedelta
from typing import Any

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.exceptions import ValidationError

from jobs import schedule
from jobs.models import Job
from jobs.secrets import REDACTED, redacted_names
from jobs.validators import (
    validate_header,
    validate_min_interval,
    validate_notify,
    validate_notify_on,
)

TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
MAX_HEADERS_BYTES = 16 * 1024
MAX_HEADERS = 64
MAX_SECRET_HEADER_NAMES = 100
MAX_PAYLOAD_DEPTH = 64
AT_PAST_LIMIT = timedelta(days=366)
AT_FUTURE_LIMIT = timedelta(days=100 * 366)
BOUND_EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)  # starts_at / ends_at
TIMING_INPUTS = ("schedule", "every", "at", "delay")
RECURRING_ONLY = ("starts_at", "ends_at", "exclude")
MAX_SCHEDULES = 10  # expressions in a schedule list
MAX_EXCLUDE = 1000  # dates in exclude
MAX_CRON_LENGTH = 200
_DATE_RE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
TARGET_INPUTS = ("target", "task")
# What applies to one kind of target only (API names): given for the other kind, a 400.
URL_ONLY = ("method", "headers", "secret_headers", "payload")
TASK_ONLY = ("args", "kwargs", "queue")
MAX_PAUSE_AFTER_FAILURES = 1000
_DURATION_PATTERN = r"^[0-9]+[smhd]$"


def iso_z(value: datetime) -> str:
    """ISO 8601 UTC with a Z, whole seconds (the API's one time format)."""
    return value.astimezone(UTC).strftime(TIME_FORMAT)


def json_type_name(value: Any) -> str:
    """The JSON name of a parsed value's type, for messages a JSON user can read."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


# --------------------------------------------------------------------------- fields


class UtcTimeField(serializers.DateTimeField):
    """Output only: `2026-10-28T20:30:00Z` (a stored fraction is dropped)."""

    def to_representation(self, value: datetime) -> str:
        return iso_z(value)


@extend_schema_field({"type": "string", "pattern": _DURATION_PATTERN, "example": "5m"})
class DurationField(serializers.Field):
    """A duration string ("90s", "5m", "2h", "1d") in, whole seconds (int) out to the
    model; and back to the largest whole unit on the way out."""

    def __init__(self, *, low: timedelta, high: timedelta, **kwargs: Any) -> None:
        self.low, self.high = low, high
        super().__init__(**kwargs)

    def _bounds(self) -> str:
        return f"between {schedule.format_duration(self.low)} and {schedule.format_duration(self.high)}"

    def to_internal_value(self, data: Any) -> int:
        if not isinstance(data, str):
            raise ValidationError(f"must be a duration string like '5m' ({self._bounds()}), not {json_type_name(data)}")
        try:
            value = schedule.parse_duration(data, longest=max(self.high, timedelta(days=365)))
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc
        if not self.low <= value <= self.high:
            raise ValidationError(f"must be {self._bounds()}, not {data.strip()!r}")
        return int(value.total_seconds())

    def to_representation(self, value: int) -> str:
        return schedule.format_duration(timedelta(seconds=value))


def _checked_cron(value: Any) -> str:
    """One cron expression, validated (and its gaps checked against
    SCHEDULER_MIN_INTERVAL), fields joined by one space; ValueError in words."""
    if not isinstance(value, str):
        raise ValueError(f"must be a 5-field cron expression (a string), not {json_type_name(value)}")
    if len(value) > MAX_CRON_LENGTH:
        raise ValueError(f"is {len(value)} characters long; a cron expression may have at most {MAX_CRON_LENGTH}")
    schedule.validate_cron(value)
    validate_min_interval(value)
    return " ".join(value.split())


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "example": "0 2 * * *"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": MAX_SCHEDULES,
             "example": ["0 9 * * 1-5", "0 12 * * 6"]},
        ],
        "nullable": True,
        "description": "A 5-field cron expression in `timezone`, or a list of them (the union of their "
        f"times, each instant once; at most {MAX_SCHEDULES}). Read back as given: a string or a list.",
    }
)
class ScheduleField(serializers.Field):
    """A 5-field cron expression, or a list of them; a job with another timing has
    none, shown as null. Read back as it was given (a list stays a list)."""

    def get_attribute(self, instance: Job) -> Job:
        return instance  # the string is `schedule`, a list `schedule_list`

    def to_representation(self, job: Job) -> str | list[str] | None:
        if job.schedule_list:
            return list(job.schedule_list)
        return job.schedule or None

    def to_internal_value(self, data: Any) -> str | list[str]:
        if isinstance(data, str):
            try:
                return _checked_cron(data)
            except ValueError as exc:
                raise ValidationError(str(exc)) from exc
        if not isinstance(data, list):
            raise ValidationError(
                f"must be a 5-field cron expression or a list of them, not {json_type_name(data)}"
            )
        if not data:
            raise ValidationError("the list is empty: give at least one 5-field cron expression")
        if len(data) > MAX_SCHEDULES:
            raise ValidationError(f"the list has {len(data)} expressions; the limit is {MAX_SCHEDULES}")
        problems, exprs = [], []
        for index, item in enumerate(data):
            try:
                exprs.append(_checked_cron(item))
            except ValueError as exc:
                problems.append(f"schedule[{index}]: {exc}")
        if problems:
            raise ValidationError(problems)
        try:
            validate_min_interval(exprs)
        except ValueError as exc:
            raise ValidationError(f"together, the expressions {exc}") from exc
        return exprs


def _checked_date(index: int, item: Any) -> str:
    if not isinstance(item, str) or not _DATE_RE.fullmatch(item):
        shown = repr(item) if isinstance(item, str) else json_type_name(item)
        raise ValueError(f"exclude[{index}]: {shown} is not a date: use YYYY-MM-DD, like '2026-12-25'")
    try:
        date.fromisoformat(item)
    except ValueError:
        raise ValueError(f"exclude[{index}]: {item!r} is not a date of the calendar") from None
    return item


@extend_schema_field(
    {
        "type": "array",
        "items": {"type": "string", "format": "date"},
        "maxItems": MAX_EXCLUDE,
        "example": ["2026-12-25"],
        "description": "Dates (YYYY-MM-DD, in `timezone`) on which a recurring job does not run: each time "
        "on them gets a `skipped` run with reason `excluded`, and the job goes on to its next time.",
    }
)
class ExcludeField(serializers.Field):
    """`exclude`: dates, in; the same dates, sorted and each once, out."""

    def to_internal_value(self, data: Any) -> list[str]:
        if not isinstance(data, list):
            raise ValidationError(f"must be a list of dates (YYYY-MM-DD), not {json_type_name(data)}")
        if len(data) > MAX_EXCLUDE:
            raise ValidationError(f"the list has {len(data)} dates; the limit is {MAX_EXCLUDE}")
        problems, days = [], set()
        for index, item in enumerate(data):
            try:
                days.add(_checked_date(index, item))
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValidationError(problems)
        return sorted(days)

    def to_representation(self, value: list[str]) -> list[str]:
        return list(value or [])


@extend_schema_field(OpenApiTypes.DATETIME)
class AtField(serializers.Field):
    """`at` in: the raw string, resolved in JobSerializer.validate once the time zone
    is known. Out: the one-off time (`Job.run_at`) as ISO Z."""

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            example = "2026-10-28T20:30:00Z"
            raise ValidationError(f"must be an ISO 8601 time string like {example!r}, not {json_type_name(data)}")
        return data

    def to_representation(self, value: datetime) -> str:
        return iso_z(value)


class NotifyField(serializers.CharField):
    """`notify`: an e-mail address or an https URL (jobs.validators.validate_notify);
    null in or out means "none" (the model stores a blank string)."""

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        if value == "":
            return value
        try:
            return validate_notify(value)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc

    def to_representation(self, value: str) -> str | None:
        return value or None


@extend_schema_field({
    "type": "array", "items": {"type": "string", "enum": ["dead", "skipped"]}, "uniqueItems": True,
    "example": ["dead", "skipped"],
})
class NotifyOnField(serializers.Field):
    """`notify_on`: a list of "dead" and "skipped" (jobs.validators.validate_notify_on)."""

    def to_internal_value(self, data: Any) -> list[str]:
        try:
            return validate_notify_on(data)
        except ValueError as exc:
            raise ValidationError(str(exc)) from exc

    def to_representation(self, value: list[str]) -> list[str]:
        return list(value or [])


def _header_problems(name: Any, value: Any) -> list[str]:
    if isinstance(name, str) and not isinstance(value, str):
        return [f"the value of {name!r} must be a string, not {json_type_name(value)}"]
    try:
        validate_header(name, value)
    except ValueError as exc:
        return [str(exc)]
    return []


@extend_schema_field(
    {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": "Sent as given. Names are RFC 9110 tokens, values visible ASCII, space and tab; "
        "Host, Content-Length, Transfer-Encoding, Connection, Keep-Alive, TE, Trailer, Upgrade, Proxy-* "
        "and the scheduler's own headers are refused. Secret ones (Authorization, Cookie and those named "
        "in secret_headers) are stored encrypted and shown as \"***\".",
    }
)
class HeadersField(serializers.Field):
    """Header names to values. Out: the plain ones in clear, the secret ones as "***"."""

    def get_attribute(self, instance: Job) -> Job:
        # The output needs both the plain headers and the names of the encrypted ones.
        return instance

    def to_representation(self, job: Job) -> dict[str, str]:
        merged = dict(job.headers or {})
        merged.update({name: REDACTED for name in redacted_names(job.secret_headers)})
        return merged

    def to_internal_value(self, data: Any) -> dict[str, str]:
        if not isinstance(data, dict):
            raise ValidationError(f"must be an object of header names to string values, not {json_type_name(data)}")
        problems = [p for name, value in data.items() for p in _header_problems(name, value)]
        problems += _duplicate_names(list(data))
        if len(data) > MAX_HEADERS:
            problems.append(f"there are {len(data)} headers; the limit is {MAX_HEADERS}")
        if not problems:
            size = sum(len(k.encode()) + len(v.encode()) for k, v in data.items())
            if size > MAX_HEADERS_BYTES:
                problems.append(f"the headers are {size} bytes in all; the limit is {MAX_HEADERS_BYTES} (16 KiB)")
        if problems:
            raise ValidationError(problems)
        return dict(data)


def _duplicate_names(names: list[str]) -> list[str]:
    # Header names ignore case on the wire: two spellings would send one of them at random.
    seen: set[str] = set()
    problems = []
    for name in names:
        key = str(name).lower()
        if key in seen:
            problems.append(f"{name!r} is given twice (header names ignore case)")
        seen.add(key)
    return problems


def _text_problem(text: str) -> str | None:
    """What PostgreSQL cannot store of a string: NUL, and lone surrogates (UTF-8 cannot
    encode them; a form or a Python caller can hand them over, where the API's JSON
    parser is not in front)."""
    if "\x00" in text:
        return "must not contain NUL characters (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "must not contain lone surrogates (invalid Unicode, like \\ud800)"
    return None


def _payload_problem(data: Any) -> str | None:
    """What PostgreSQL's jsonb or the call to the target would choke on, in words.
    Iterative, so a deeply nested payload cannot exhaust the stack here."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            return f"is nested more than {MAX_PAYLOAD_DEPTH} levels deep"
        if isinstance(value, str):
            problem = _text_problem(value)
            if problem:
                return problem
        if isinstance(value, float) and not math.isfinite(value):
            return "must not contain NaN or infinite numbers"
        if isinstance(value, dict):
            for key in value:
                problem = _text_problem(str(key))
                if problem:
                    return problem
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return None


@extend_schema_field(OpenApiTypes.ANY)
class PayloadField(serializers.JSONField):
    """Any JSON, sent as the body; its size is counted as the bytes actually sent."""

    def to_internal_value(self, data: Any) -> Any:
        problem = _payload_problem(data)
        if problem:
            raise ValidationError(problem)
        # The same encoding the worker sends (runs.delivery.build_request).
        size = len(json.dumps(data, separators=(",", ":")).encode())
        limit = settings.MAX_PAYLOAD_BYTES
        if size > limit:
            raise ValidationError(f"is {size} bytes as JSON; the limit is {limit} bytes ({limit // 1024} KiB)")
        return data


def _json_size_problem(data: Any) -> str | None:
    problem = _payload_problem(data)
    if problem:
        return problem
    size = len(json.dumps(data, separators=(",", ":")).encode())
    limit = settings.MAX_PAYLOAD_BYTES
    if size > limit:
        return f"is {size} bytes as JSON; the limit is {limit} bytes ({limit // 1024} KiB)"
    return None


@extend_schema_field({"type": "array", "items": {}, "nullable": True, "example": [42]})
class TaskArgsField(serializers.JSONField):
    """A task's positional arguments: a JSON list, at most MAX_PAYLOAD_BYTES as JSON."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, list):
            raise ValidationError(f"must be a list of positional arguments, not {json_type_name(data)}")
        problem = _json_size_problem(data)
        if problem:
            raise ValidationError(problem)
        return data


@extend_schema_field({"type": "object", "additionalProperties": {}, "nullable": True, "example": {"full": True}})
class TaskKwargsField(serializers.JSONField):
    """A task's keyword arguments: a JSON object (its keys are strings), at most
    MAX_PAYLOAD_BYTES as JSON."""

    def to_internal_value(self, data: Any) -> Any:
        if not isinstance(data, dict) or not all(isinstance(key, str) for key in data):
            raise ValidationError(f"must be an object of argument names to values, not {json_type_name(data)}")
        problem = _json_size_problem(data)
        if problem:
            raise ValidationError(problem)
        return data
