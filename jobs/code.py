"""Schedules in code: jobs an app defines in its `schedules.py`, made and kept in
step by `python manage.py sync_jobs` (docs/schedules-in-code.md).

    # billing/schedules.py
    from jobs.code import job

    SCHEDULES = [
        job("nightly-invoices", owner="billing", schedule="0 2 * * *", timezone="Europe/Paris",
            target="https://billing.internal/invoices", payload={"run": "nightly"}, window="5m"),
    ]

A definition is the API's job body (any field `POST /api/jobs/` takes, in its
words: "5m", {"max": 5}...) plus the service that owns it. It is checked by the
API's own JobSerializer, so a field the API learns is a field code may use. The
key is (owner, name): the same key next time is the same job.

What code may not say: `paused` (an operator's switch in an incident, kept across
syncs), `delay` (relative to when the sync runs, so every sync would move it) and
`name` among the fields (it is the key).

A code-owned job (`Job.code_source`, the defining module) is read-only elsewhere:
the API refuses PATCH and DELETE with a 409 (`code_owned_refusal`), except a PATCH
of `paused` alone; run-now and retries work as for any job; the admin shows it
read-only.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from importlib import import_module
from types import SimpleNamespace
from typing import Any

from django.apps import apps
from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import module_has_submodule

from jobs import services
from jobs.audit import audit_entry
from jobs.models import AuditEntry, Job
from jobs.secrets import decrypt_headers
from jobs.serializers import JobSerializer
from jobs.validators import escape_controls, first_control_character

MODULE = "schedules"
ATTRIBUTE = "SCHEDULES"
# Fields a definition may not give (see the module's docstring), with the reason.
NOT_IN_CODE = {
    "name": "is the definition's key: give it as job(name, ...), not among the fields",
    "paused": "is an operator's switch (PATCH {\"paused\": true} or the admin), not part of a definition",
    "delay": "is relative to when sync_jobs runs, so every sync would move it; use at (a time) or schedule",
    "owner": "is the definition's owner=..., not a field",
}
SECRET_VALUES = "secret header values"  # a diff entry that never shows the values


@dataclass(frozen=True)
class Schedule:
    """One code-defined job: its key (owner, name) and its API body."""

    name: str
    owner: str
    fields: Mapping[str, Any] = field(default_factory=dict)


def job(name: str, *, owner: str, **fields: Any) -> Schedule:
    """`job("nightly-report", owner="reports", schedule="0 2 * * *", target=...)`."""
    return Schedule(name=name, owner=owner, fields=fields)


class DefinitionError(ValueError):
    """A definition that cannot be synced, in one line naming it and the field."""


def code_owned_refusal(job: Job, changing: Iterable[str] = ("delete",)) -> str | None:
    """Why an API or admin write of `changing` (field names, or "delete") is refused
    on this job, or None. A code-owned job may only be paused or resumed."""
    if not job.is_code_owned or set(changing) <= {"paused"}:
        return None
    return f"{job.public_id} is defined in code by {job.code_source}; change it there and run sync_jobs"


# --------------------------------------------------------------------------- discovery


@dataclass(frozen=True)
class Definition:
    source: str  # the module, like billing.schedules
    schedule: Schedule

    @property
    def key(self) -> tuple[str, str]:
        return (self.schedule.owner, self.schedule.name)

    def where(self) -> str:
        return f"{self.source}: job {self.schedule.name!r} (owner {self.schedule.owner!r})"


def discover() -> list[Definition]:
    """Every installed app's `schedules.SCHEDULES`, in INSTALLED_APPS order."""
    found: list[Definition] = []
    for app in apps.get_app_configs():
        if not module_has_submodule(app.module, MODULE):
            continue
        name = f"{app.name}.{MODULE}"
        try:
            module = import_module(name)
        except Exception as exc:  # a broken module: say which, in one line
            raise DefinitionError(f"{name} cannot be imported: {type(exc).__name__}: {exc}") from exc
        entries = getattr(module, ATTRIBUTE, None)
        if entries is None:
            raise DefinitionError(f"{name} has no {ATTRIBUTE} list (SCHEDULES = [job(...), ...])")
        if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Iterable):
            raise DefinitionError(f"{name}.{ATTRIBUTE} must be a list of jobs.code.job(...), not {type(entries).__name__}")
        found.extend(Definition(name, _as_schedule(name, i, entry)) for i, entry in enumerate(entries))
    return found


def _as_schedule(source: str, index: int, entry: Any) -> Schedule:
    if isinstance(entry, Mapping):  # a plain dict: {"name": ..., "owner": ..., **fields}
        rest = dict(entry)
        entry = Schedule(name=rest.pop("name", ""), owner=rest.pop("owner", ""), fields=rest)
    if not isinstance(entry, Schedule):
        raise DefinitionError(f"{source}.{ATTRIBUTE}[{index}] is a {type(entry).__name__}, not jobs.code.job(...)")
    for attr in ("name", "owner"):
        value = getattr(entry, attr)
        if not isinstance(value, str) or not value.strip():
            raise DefinitionError(f"{source}.{ATTRIBUTE}[{index}]: {attr} must be a non-empty string")
        # The key is matched as written: the API trims a name, so " nightly" would be
        # stored as "nightly" and never found again (each later sync failed on the key's
        # constraint); NUL and control characters cannot be a stored key at all.
        if value != value.strip():
            raise DefinitionError(f"{source}.{ATTRIBUTE}[{index}]: {attr} {escape_controls(repr(value))} has "
                                  f"spaces around it; write {escape_controls(repr(value.strip()))}")
        bad = first_control_character(value)
        if bad is not None:
            raise DefinitionError(f"{source}.{ATTRIBUTE}[{index}]: {attr} {escape_controls(repr(value))} holds a "
                                  f"control character (U+{ord(bad):04X})")
    return entry


# --------------------------------------------------------------------------- the plan


@dataclass
class Change:
    job: Job
    definition: Definition
    diff: dict[str, tuple[Any, Any]]  # API field -> (old, new)
    body: dict[str, Any]  # the PATCH body that makes the change


@dataclass
class SyncPlan:
    create: list[tuple[Definition, Job]] = field(default_factory=list)  # with the unsaved job
    change: list[Change] = field(default_factory=list)
    unchanged: int = 0
    gone: list[Job] = field(default_factory=list)  # code-owned, no longer defined

    @property
    def changes_anything(self) -> bool:
        return bool(self.create or self.change or self.gone)


def _context(owner: Any) -> dict[str, Any]:
    # What the API's serializer sees of a request: the caller (checks that depend on
    # the owner, like the task prefixes a service may name, read request.user).
    return {"request": SimpleNamespace(user=owner), "owner": owner}


def _errors(errors: Any, prefix: str = "") -> list[str]:
    """A serializer's errors as "field: message" lines (`retry.cap: ...`)."""
    if isinstance(errors, Mapping):
        return [line for key, value in errors.items() for line in _errors(value, f"{prefix}{key}.")]
    if isinstance(errors, list):
        return [line for value in errors for line in _errors(value, prefix)]
    name = prefix.rstrip(".")
    name = "" if name == "non_field_errors" else name
    return [f"{name}: {errors}" if name else str(errors)]


def view(job: Job, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The job as its definition would say it: the API's writable fields in the
    API's words (the same representation GET /api/jobs/{id}/ gives), without
    `paused` (the operators') and `name` (the key). `fields`: a JobSerializer's
    fields, to reuse (DRF copies every field for each new serializer)."""
    out: dict[str, Any] = {}
    for name, fld in (fields if fields is not None else JobSerializer().fields).items():
        if fld.read_only or fld.write_only or name in ("paused", "name"):
            continue
        value = fld.get_attribute(job)
        out[name] = None if value is None else fld.to_representation(value)
    return out


def _secret_values(job: Job) -> dict[str, str]:
    return decrypt_headers(job.secret_headers) if job.secret_headers else {}


def _refuse_fields_not_in_code(definition: Definition) -> None:
    for key in definition.schedule.fields:
        if key in NOT_IN_CODE:
            raise DefinitionError(f"{definition.where()}: {key} {NOT_IN_CODE[key]}")


def validate(definitions: list[Definition], owner: Any) -> list[Job]:
    """One owner's definitions through the API's serializer, as POSTs would be (one
    serializer, many=True, for speed): the unsaved jobs, or why the first bad one is bad."""
    for d in definitions:
        _refuse_fields_not_in_code(d)
    bodies = [{"name": d.schedule.name, **d.schedule.fields} for d in definitions]
    serializer = JobSerializer(data=bodies, many=True, context=_context(owner))
    if not serializer.is_valid():
        errors: Any = serializer.errors
        # Per item: a list aligned with the items, or (newer DRF) a dict keyed by index.
        per_item = dict(enumerate(errors)) if isinstance(errors, list) else dict(errors)
        for index, d in enumerate(definitions):
            problem = per_item.get(index) or per_item.get(str(index))
            if problem:
                raise DefinitionError(f"{d.where()}: {'; '.join(_errors(problem))}")
        raise DefinitionError(f"{definitions[0].source}: {'; '.join(_errors(errors))}")
    return [
        services.job_build(owner=owner, fields={**JobSerializer.service_fields_of(attrs), "code_source": d.source})
        for d, attrs in zip(definitions, serializer.validated_data, strict=True)
    ]


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON the store keeps: numbers by value as written (PostgreSQL's jsonb
    gives 1e300 back as the integer 10**300, which a float 1e300 is not exactly, and
    every sync then saw a change), containers item by item, the rest by ==."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        try:
            return Decimal(repr(a)) == Decimal(repr(b))
        except InvalidOperation:  # nan or infinity: not JSON the API takes anyway
            return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return a == b


def _diff(stored: Job, wanted: Job, definition: Definition, fields: Mapping[str, Any]) -> Change | None:
    old, new = view(stored, fields), view(wanted, fields)
    diff = {k: (old.get(k), v) for k, v in new.items() if not same_json(old.get(k), v)}
    if _secret_values(stored) != _secret_values(wanted):
        diff[SECRET_VALUES] = ("***", "***")
    if stored.code_source != definition.source:
        diff["defined in"] = (stored.code_source, definition.source)
    if not diff:
        return None
    body: dict[str, Any] = {k: new[k] for k in diff if k in new and k not in ("headers", "secret_headers")}
    if {"headers", "secret_headers", SECRET_VALUES} & set(diff):
        # Headers from the definition itself: the stored view shows secret values as "***".
        body["headers"] = dict(definition.schedule.fields.get("headers") or {})
        body["secret_headers"] = list(definition.schedule.fields.get("secret_headers") or [])
    return Change(job=stored, definition=definition, diff=diff, body=body)


def plan(definitions: list[Definition]) -> SyncPlan:
    """What sync_jobs would do, reading only (three queries, whatever the count)."""
    seen: dict[tuple[str, str], Definition] = {}
    for d in definitions:
        if d.key in seen:
            raise DefinitionError(f"{d.where()}: defined twice (also in {seen[d.key].source}); names are unique per owner")
        seen[d.key] = d
    owner_names = sorted({d.schedule.owner for d in definitions})
    owners = {u.get_username(): u for u in get_user_model().objects.filter(username__in=owner_names, service__isnull=False)}
    result = SyncPlan()
    stored = _stored_jobs(owners, {d.schedule.name for d in definitions})
    by_owner: dict[str, list[Definition]] = {}
    for d in definitions:
        if d.schedule.owner not in owners:
            raise DefinitionError(
                f"{d.where()}: owner {d.schedule.owner!r} is not a service account "
                f"(python manage.py create_service_token {d.schedule.owner})"
            )
        by_owner.setdefault(d.schedule.owner, []).append(d)
    wanted_jobs = {d.key: w for name, ds in by_owner.items() for d, w in zip(ds, validate(ds, owners[name]), strict=True)}
    fields = JobSerializer().fields
    for d in definitions:
        owner, wanted = owners[d.schedule.owner], wanted_jobs[d.key]
        existing = stored.get((owner.pk, d.schedule.name))
        if existing is None:
            result.create.append((d, wanted))
        elif not existing.is_code_owned:
            raise DefinitionError(
                f"{d.where()}: {existing.public_id} already has this name and was made by hand (API or admin), "
                f"not by sync_jobs; rename the definition, or rename or delete {existing.public_id}"
            )
        else:
            change = _diff(existing, wanted, d, fields)
            if change is None:
                result.unchanged += 1
            else:
                result.change.append(change)
    defined = {(owners[o].pk, n) for o, n in seen if o in owners}
    live_code_owned = Job.objects.exclude(code_source="").exclude(state=Job.State.DELETED).select_related("owner")
    result.gone = [j for j in live_code_owned.order_by("id") if (j.owner_id, j.name) not in defined]
    return result


def _stored_jobs(owners: dict[str, Any], names: set[str]) -> dict[tuple[int, str], Job]:
    """Live jobs with a defined key; a code-owned one wins over hand-made namesakes."""
    found: dict[tuple[int, str], Job] = {}
    query = Job.objects.exclude(state=Job.State.DELETED).filter(
        owner_id__in=[u.pk for u in owners.values()], name__in=sorted(names)
    )
    for stored in query.order_by("id"):
        key = (stored.owner_id, stored.name)
        if key not in found or (stored.is_code_owned and not found[key].is_code_owned):
            found[key] = stored
    return found


# --------------------------------------------------------------------------- applying it


def _audit(action: str, job: Job, now: datetime, **detail: Any) -> AuditEntry:
    return audit_entry(actor=None, via="command", action=action, obj=job, at=now, detail=detail)


def apply(result: SyncPlan, *, prune: bool, now: datetime | None = None) -> None:
    """Write the plan; the caller's transaction makes it all-or-nothing."""
    now = now or timezone.now()
    entries: list[AuditEntry] = []
    if result.create:
        created = services.jobs_create_many(jobs=[wanted for _, wanted in result.create], now=now)
        for (d, _), made in zip(result.create, created, strict=True):
            entries.append(_audit("created", made, now, source=d.source, fields=sorted({"name", *d.schedule.fields})))
    for change in result.change:
        _apply_change(change, now)
        entries.append(_audit("changed", change.job, now, source=change.definition.source, fields=sorted(change.diff)))
    if prune:
        for gone in result.gone:
            services.job_delete(job=gone, now=now)
            entries.append(_audit("deleted", gone, now, source=gone.code_source, reason="no longer defined in code"))
    AuditEntry.objects.bulk_create(entries, batch_size=500)


def _apply_change(change: Change, now: datetime) -> None:
    """The change as a PATCH of the changed fields through the API's serializer and
    job_update: a changed schedule replaces the waiting run by the one next-run rule."""
    stored = change.job
    if change.body:
        serializer = JobSerializer(stored, data=change.body, partial=True, context=_context(stored.owner))
        if not serializer.is_valid():
            raise DefinitionError(f"{change.definition.where()}: {'; '.join(_errors(serializer.errors))}")
        services.job_update(job=stored, fields=serializer.service_fields(), now=now)
    if stored.code_source != change.definition.source:
        Job.objects.filter(pk=stored.pk).update(code_source=change.definition.source)


def lock_owners(definitions: list[Definition]) -> None:
    """Two syncs at once (two deploys) take turns: each locks the owners it names,
    then plans from what the other committed."""
    names = sorted({d.schedule.owner for d in definitions})
    list(get_user_model().objects.select_for_update().filter(username__in=names).order_by("pk").values_list("pk"))


def sync(*, dry_run: bool = False, prune: bool = False, now: datetime | None = None) -> SyncPlan:
    """Discover, check every definition, then (unless dry_run) write it all in one
    transaction: a bad definition anywhere writes nothing."""
    definitions = discover()
    if prune and not definitions:
        # Most likely the wrong settings (the apps missing), not "delete every code-owned job".
        raise DefinitionError(
            "no installed app defines any job in a schedules.py; refusing to --prune every code-owned job "
            "(check INSTALLED_APPS, or delete them by hand)"
        )
    if dry_run:
        return plan(definitions)
    with transaction.atomic():
        lock_owners(definitions)
        result = plan(definitions)
        apply(result, prune=prune, now=now)
    return result
