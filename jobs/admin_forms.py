"""The admin's forms: a job's edit form in the API's words (validated by
jobs.serializers.JobSerializer, so a bad value is the API's error, never a 500) and a
service account's grants and notify address. jobs.admin uses them.
"""

from __future__ import annotations

import json
from typing import Any

from django import forms
from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from jobs.models import Job, ServiceAccount
from jobs.serializers import JobSerializer
from jobs.validators import METHODS, validate_task_prefix

# API names of the form's fields (nested `retry` keys as "retry.<key>").
FORM_TO_API = {
    "name": "name",
    "schedule": "schedule",
    "every": "every",
    "at": "at",
    "starts_at": "starts_at",
    "ends_at": "ends_at",
    "exclude": "exclude",
    "timezone": "timezone",
    "window": "window",
    "misfire": "misfire",
    "overlap": "overlap",
    "target": "target",
    "task": "task",
    "args": "args",
    "kwargs": "kwargs",
    "queue": "queue",
    "method": "method",
    "headers": "headers",
    "secret_headers": "secret_headers",
    "payload": "payload",
    "retry_max": "retry.max",
    "retry_backoff": "retry.backoff",
    "retry_base": "retry.base",
    "retry_cap": "retry.cap",
    "timeout": "timeout",
    "notify": "notify",
    "notify_on": "notify_on",
    "pause_after_failures": "pause_after_failures",
    "paused": "paused",
    "paused_until": "paused_until",
}
API_TO_FORM = {api: name for name, api in FORM_TO_API.items()}



def _service_users() -> QuerySet[Any]:
    return get_user_model().objects.filter(service__isnull=False).order_by("username")


class SafeJSONField(forms.JSONField):
    """Django's form JSONField, for hostile text: nesting deeper than Python's stack is a
    form error, not a 500 (RecursionError), and a value holding a lone surrogate
    (`"\\ud800"`) is shown again escaped, since the page cannot be encoded with it."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except RecursionError:
            raise forms.ValidationError("is nested too deeply", code="invalid") from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except RecursionError:
            return forms.fields.InvalidJSONInput(data)

    def prepare_value(self, value: Any) -> Any:
        if isinstance(value, forms.fields.InvalidJSONInput):
            return value
        try:
            text = json.dumps(value, ensure_ascii=False, cls=self.encoder)
            text.encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(value, ensure_ascii=True, cls=self.encoder)
        except (TypeError, ValueError, RecursionError):
            return super().prepare_value(value)
        return text


class JobAdminForm(forms.ModelForm):
    """The API's fields; `clean` hands them to JobSerializer (create, or PATCH of the
    changed ones) and keeps its `service_fields()` for the save."""

    owner = forms.ModelChoiceField(queryset=_service_users(), help_text="The service account that owns the job.")
    name = forms.CharField(required=False, max_length=200)
    schedule = forms.CharField(
        required=False,
        max_length=2200,
        widget=forms.Textarea(attrs={"rows": 2}),
        help_text="5-field cron, in the time zone below, like 0 2 * * *; several, one a line, for the union "
        "of their times. Empty for a one-off or an every job.",
    )
    every = forms.CharField(
        required=False,
        help_text='An interval instead of a schedule, like "90m" (1s to 366d), counted in UTC from starts_at '
        "or the job's creation.",
    )
    at = forms.CharField(
        required=False,
        label="At (one-off)",
        help_text="ISO 8601, like 2026-10-28T20:30:00Z; with no offset, a wall-clock time in the time zone.",
    )
    starts_at = forms.CharField(
        required=False, help_text="Recurring jobs: no run before this time (ISO 8601, like the one-off time)."
    )
    ends_at = forms.CharField(
        required=False, help_text="Recurring jobs: no run after this time; past it the job is completed."
    )
    exclude = forms.CharField(
        required=False,
        help_text="Recurring jobs: comma-separated dates (YYYY-MM-DD, in the time zone below) with no run.",
    )
    timezone = forms.CharField(initial="UTC", max_length=64, help_text="An IANA name, like Asia/Kolkata.")
    window = forms.CharField(initial="0s", help_text='The run may start up to this long after its time ("5m").')
    misfire = forms.ChoiceField(choices=Job.Misfire.choices, initial=Job.Misfire.RUN_ONCE)
    overlap = forms.ChoiceField(
        required=False,
        choices=Job.Overlap.choices,
        initial=Job.Overlap.SKIP,
        help_text="A time that passes while the job's run is in flight: skip it (a skipped run, reason overlap), "
        "buffer_one (the latest such time runs as soon as the run ends), or allow (runs may overlap: the next "
        "run is made when a run starts).",
    )
    target = forms.CharField(
        required=False, max_length=2000, strip=False,
        help_text="An http(s) URL, checked as typed. Exactly one of target and task.",
    )
    task = forms.CharField(
        required=False, max_length=200, strip=False,
        help_text="Or a Celery task name, like billing.tasks.sync, under a prefix granted to the owner "
        "(grant_tasks). Method, headers and payload are for URL targets only.",
    )
    args = SafeJSONField(required=False, help_text="A task's positional arguments: a JSON list.")
    kwargs = SafeJSONField(required=False, help_text="A task's keyword arguments: a JSON object.")
    queue = forms.CharField(
        required=False, max_length=100, help_text='A task\'s queue (default "celery"); its pause key is celery:<queue>.'
    )
    method = forms.ChoiceField(choices=[(m, m) for m in METHODS], initial="POST")
    headers = SafeJSONField(
        required=False,
        initial=dict,
        help_text='A JSON object of header names to values (visible ASCII, space and tab); Host, Content-Length, '
        "Transfer-Encoding, Connection, Keep-Alive, TE, Trailer, Upgrade and Proxy-* are refused. Secret values "
        'show as "***" and are kept when sent back so; to make a secret header plain, type its value again.',
    )
    secret_headers = forms.CharField(
        required=False, help_text="Comma-separated names of further headers to keep encrypted."
    )
    payload = SafeJSONField(required=False, help_text="Any JSON, sent as the body.")
    retry_max = forms.IntegerField(initial=3, label="Retries", help_text="Tries after the first, 0 to 100.")
    retry_backoff = forms.ChoiceField(choices=Job.Backoff.choices, initial=Job.Backoff.EXPONENTIAL, label="Backoff")
    retry_base = forms.CharField(initial="10s", label="First delay")
    retry_cap = forms.CharField(initial="1h", label="Longest delay")
    timeout = forms.CharField(initial="30s", help_text="How long one call may take.")
    notify = forms.CharField(
        required=False,
        max_length=2000,
        help_text="An e-mail address, or an https URL that gets a signed JSON notice, told when a run goes dead "
        "(default: the owner's e-mail).",
    )
    notify_on = forms.MultipleChoiceField(
        required=False,
        choices=[("dead", "dead runs"), ("skipped", "skipped runs")],
        initial=["dead"],
        widget=forms.CheckboxSelectMultiple,
        label="Notify on",
        help_text="Which runs the notify address is told about (in one digest per few minutes).",
    )
    pause_after_failures = forms.IntegerField(
        required=False,
        initial=0,
        min_value=0,
        label="Pause after failures",
        help_text="After this many runs in a row end dead, the job pauses itself and its owner is told (0: never).",
    )
    paused = forms.BooleanField(required=False)
    paused_until = forms.CharField(
        required=False,
        label="Paused until",
        help_text="A paused job resumes by itself at this time (ISO 8601, like 2026-10-28T20:30:00Z). "
        "Empty: until resumed by hand.",
    )

    class Meta:
        model = Job
        fields = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.service_fields: dict[str, Any] = {}
        if self.instance.pk:
            self.fields.pop("owner", None)  # fixed once made; shown read-only
            self.initial.update(self._api_initial(self.instance))

    @staticmethod
    def _api_initial(job: Job) -> dict[str, Any]:
        data = JobSerializer(job).data
        retry = data.get("retry") or {}
        return {
            "name": data["name"],
            "schedule": "\n".join(data["schedule"]) if isinstance(data["schedule"], list) else data["schedule"] or "",
            "every": data["every"] or "",
            "at": data["at"] or "",
            "starts_at": data["starts_at"] or "",
            "ends_at": data["ends_at"] or "",
            "exclude": ", ".join(data["exclude"] or []),
            "timezone": data["timezone"],
            "window": data["window"],
            "misfire": data["misfire"],
            "overlap": data["overlap"],
            "target": data["target"] or "",
            "task": data["task"] or "",
            "args": data["args"] if data["args"] is not None else [],
            "kwargs": data["kwargs"] if data["kwargs"] is not None else {},
            "queue": data["queue"] or "",
            "method": data["method"] or "POST",
            "headers": data["headers"],
            "secret_headers": ", ".join(data["secret_headers"] or []),
            "payload": data["payload"],
            "retry_max": retry.get("max"),
            "retry_backoff": retry.get("backoff"),
            "retry_base": retry.get("base"),
            "retry_cap": retry.get("cap"),
            "timeout": data["timeout"],
            "notify": data["notify"] or "",
            "notify_on": data["notify_on"],
            "pause_after_failures": data["pause_after_failures"],
            "paused": data["paused"],
            "paused_until": data["paused_until"] or "",
        }

    def _api_body(self, cleaned: dict[str, Any]) -> dict[str, Any]:
        editing = bool(self.instance.pk)
        names = [n for n in FORM_TO_API if n in self.fields and n in cleaned]
        if editing:
            names = [n for n in names if n in self.changed_data]
        body: dict[str, Any] = {}
        is_task = bool(cleaned.get("task")) if "task" in names or not editing else bool(self.instance.task)
        for name in names:
            value = cleaned[name]
            if name in ("target", "task", "queue") and value == "":
                continue  # not given: exactly one of target and task is
            if name in ("args", "kwargs") and value is None:
                continue
            if is_task and name in ("method", "headers", "secret_headers", "payload") and not editing:
                if not value or (name == "method" and value == "POST"):
                    continue  # the form's HTTP defaults, not given for a task
            if not is_task and name in ("args", "kwargs", "queue") and not value:
                continue
            if name in ("secret_headers", "exclude"):
                value = [part.strip() for part in (value or "").split(",") if part.strip()]
            elif name == "schedule" and "\n" in value.strip():
                value = [line.strip() for line in value.splitlines() if line.strip()]
            elif name in ("schedule", "every", "at", "starts_at", "ends_at", "notify", "name", "paused_until") and value == "":
                if not editing and name in ("schedule", "every", "at", "starts_at", "ends_at", "paused_until"):
                    continue  # exactly one timing is given on create
                value = None if name != "name" else ""
            elif name == "notify_on":
                value = list(value or [])
            elif name in ("headers", "payload") and value is None and not editing:
                continue
            elif name in ("overlap", "pause_after_failures") and value in ("", None):
                continue  # left empty: the default (create), or unchanged (edit)
            api = FORM_TO_API[name]
            if api.startswith("retry."):
                body.setdefault("retry", {})[api.split(".", 1)[1]] = value
            else:
                body[api] = value
        return body

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean()
        if self.errors:
            return cleaned
        editing = bool(self.instance.pk)
        serializer = JobSerializer(
            instance=self.instance if editing else None, data=self._api_body(cleaned), partial=editing,
            context={"owner": cleaned.get("owner")} if not editing else {},
        )
        if serializer.is_valid():
            self.service_fields = serializer.service_fields()
        else:
            self._add_api_errors(serializer.errors)
        return cleaned

    def _add_api_errors(self, errors: Any, prefix: str = "") -> None:
        for key, value in errors.items():
            api = f"{prefix}{key}"
            if isinstance(value, dict):
                self._add_api_errors(value, prefix=f"{api}.")
                continue
            field = API_TO_FORM.get(api)
            for message in value if isinstance(value, list) else [value]:
                if field in self.fields:
                    self.add_error(field, str(message))
                else:
                    label = "" if api == "non_field_errors" else f"{api}: "
                    self.add_error(None, f"{label}{message}")

    def _post_clean(self) -> None:
        # No model validation: the serializer has checked everything (its checks are
        # the API's; Django's URLField would refuse hosts the API accepts), and the
        # services, not this form, write the job.
        pass


class TaskPrefixesField(forms.CharField):
    """ServiceAccount.task_prefixes as comma- or space-separated text (grant_tasks' words)."""

    def prepare_value(self, value: Any) -> Any:
        return ", ".join(value) if isinstance(value, list) else value

    def to_python(self, value: Any) -> list[str]:
        if isinstance(value, list):
            return value
        parts = [p for p in (value or "").replace(",", " ").split() if p]
        problems = []
        for prefix in parts:
            try:
                validate_task_prefix(prefix)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise forms.ValidationError(problems)
        return list(dict.fromkeys(parts))


class ServiceAccountForm(forms.ModelForm):
    task_prefixes = TaskPrefixesField(
        required=False,
        help_text="Celery task prefixes the service may name as a job's task, comma-separated: "
        "billing. grants billing.tasks.sync (not billingx.run); billing grants billing and billing.* "
        "(grant_tasks NAME PREFIX... does the same).",
    )
    notify = forms.CharField(
        required=False,
        max_length=2000,
        strip=False,
        help_text="Told about dead runs of this service's jobs that have no notify of their own: an e-mail "
        "address, or an https URL that gets a signed JSON notice. Empty: the account's e-mail.",
    )

    class Meta:
        model = ServiceAccount
        fields = ("task_prefixes", "notify")

    def clean_notify(self) -> str:
        from jobs.validators import validate_notify

        value = self.cleaned_data["notify"]
        if not value:
            return ""
        try:
            return validate_notify(value)
        except ValueError as exc:
            raise forms.ValidationError(f"notify {exc}") from exc
