"""The way in from django-celery-beat: one job per periodic task (`import_beat`).

Planning is separate from writing. `plan_import` reads django-celery-beat's rows and
decides, for each periodic task, the job it becomes (the same API body a service would
POST, validated by the API's own JobSerializer) or why it cannot be carried over
*exactly*; it writes nothing, so `--dry-run` is the plan printed. `beat_import` then
creates the planned jobs through `jobs.services.job_create`, the API's service.

The rules (docs/from-celery-beat.md says the same for users):

- Keyed by the periodic task's name: the job gets that name, and a job of the owner
  with that name (not deleted) means "already imported": running twice creates nothing.
- CrontabSchedule -> `schedule` in the crontab's own `timezone`, written from the sets
  celery itself expands the five fields to (so any spelling celery accepts and 5-field
  cron reads differently still carries over exactly); a field celery reads as "every
  value" is written `*`. Restricting both day of month and day of week is refused
  (celery ANDs the two, cron ORs them).
- IntervalSchedule -> `every`, anchored (`starts_at`) at beat's `last_run_at`, else
  `start_time`, else now; a `start_time` after `last_run_at` wins (beat waits for it).
  Below one second, or not whole seconds, is refused.
- ClockedSchedule -> a one-off `at`. A one_off interval or crontab -> a one-off `at` at
  its next time by our rule (beat runs a one_off once, then turns it off). A one-off
  that has run already (it has a `last_run_at`) has nothing left to run: refused.
- `enabled=False` -> imported paused. `start_time` -> `starts_at`, `expires` ->
  `ends_at`; an `expires` already past is refused (beat no longer runs it).
- `args`, `kwargs`, `queue` -> the task target's. Message `headers`, `exchange`,
  `routing_key`, `priority` and `expire_seconds` have no equal on a task job: a task
  that sets any of them is refused, never imported without them.
- A SolarSchedule is refused. So is anything the API refuses (a task name outside the
  owner's granted prefixes, an interval under SCHEDULER_MIN_INTERVAL...), with the
  API's own words.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any, Iterable

from django.db import DatabaseError, connections, transaction
from django.db.utils import load_backend
from django.utils import timezone

from jobs import schedule
from jobs.audit import audit_record
from jobs.models import Job
from jobs.validators import DEFAULT_QUEUE
from runs.delivery import iso_z

UTC = dt_timezone.utc
SOURCE_ALIAS = "beat_source"  # the Django DB alias `--database URL` becomes
SHOWN = 3  # next times shown per side in the table
FULL = {
    "minute": set(range(60)),
    "hour": set(range(24)),
    "day_of_month": set(range(1, 32)),
    "month_of_year": set(range(1, 13)),
    "day_of_week": set(range(7)),
}
UNSUPPORTED_OPTIONS = ("exchange", "routing_key", "priority", "expire_seconds")


@dataclass
class Plan:
    """What one periodic task becomes: status `create`, `exists` or `skip` (with `reason`)."""

    task_id: int
    name: str
    source: str
    job_schedule: str = ""
    status: str = "skip"
    reason: str = ""
    body: dict[str, Any] = field(default_factory=dict)  # the API body (contract names)
    fields: dict[str, Any] = field(default_factory=dict)  # the serializer's service_fields
    beat_next: list[datetime] = field(default_factory=list)
    ours_next: list[datetime] = field(default_factory=list)
    job_id: str = ""


class Refused(ValueError):
    """A periodic task that cannot be carried over exactly; the message says why."""


# --------------------------------------------------------------------------- the source


def source_alias(url: str | None) -> str:
    """The Django alias to read django-celery-beat's tables from: `default`, or one
    made now from `--database URL` (dj-database-url). ValueError on a bad URL."""
    if not url:
        return "default"
    import dj_database_url

    try:
        config = dj_database_url.parse(url)
    except Exception as exc:  # dj-database-url raises several kinds for a bad URL
        raise ValueError(f"--database {url!r} is not a database URL ({exc})") from exc
    if not config.get("ENGINE"):
        raise ValueError(f"--database {url!r} is not a database URL")
    # A connection made at run time, for this thread, not added to settings.DATABASES:
    # Django fills in the defaults the way it does for configured databases.
    config = connections.configure_settings({"default": {}, SOURCE_ALIAS: config})[SOURCE_ALIAS]
    connection = load_backend(config["ENGINE"]).DatabaseWrapper(config, SOURCE_ALIAS)
    try:
        connection.ensure_connection()
    except Exception as exc:
        raise ValueError(f"cannot connect to --database: {str(exc).splitlines()[0]}") from exc
    connections[SOURCE_ALIAS] = connection
    return SOURCE_ALIAS


def source_close(alias: str) -> None:
    """End the run-time connection `source_alias` made (no-op for `default`)."""
    if alias == SOURCE_ALIAS and hasattr(connections._connections, alias):
        connections[alias].close()
        delattr(connections._connections, alias)


def read_periodic_tasks(alias: str) -> list[Any]:
    from django_celery_beat.models import PeriodicTask

    try:
        return list(
            PeriodicTask.objects.using(alias)
            .select_related("crontab", "interval", "clocked", "solar")
            .order_by("name")
        )
    except Exception as exc:  # no such table: not a django-celery-beat database
        raise ValueError(f"cannot read django-celery-beat's periodic tasks: {str(exc).splitlines()[0]}") from exc


def read_crontabs_in(tasks: Iterable[Any], zone: str) -> None:
    """Every crontab read in `zone`, whatever its own `timezone` says, in memory only (the
    source is not written): a project that ran beat with DJANGO_CELERY_BEAT_TZ_AWARE=False
    had its crontabs run in Celery's time zone, and their `timezone` field was never
    read. ValueError for a zone that is not an IANA name."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        found = ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"--crontab-timezone: {zone!r} is not a known IANA time zone") from exc
    for task in tasks:
        if task.crontab_id:
            task.crontab.timezone = found


# --------------------------------------------------------------------------- celery's side


def celery_next_after(sched: Any, last: datetime) -> datetime:
    """The fire time celery's own schedule class gives after a run at `last` (UTC).

    Celery decides with `remaining_estimate(last_run_at)`, "now" being whatever its
    clock says: the fire time is now + remaining, worked out from the same `now` the
    class used (`remaining_delta` returns it), so the result does not depend on it."""
    from celery.schedules import crontab
    from celery.utils.time import remaining

    if isinstance(sched, crontab):
        start, delta, now = sched.remaining_delta(last)
        return (now.astimezone(UTC) + remaining(start, delta, now)).astimezone(UTC)
    now = sched.maybe_make_aware(sched.now())
    return (now.astimezone(UTC) + remaining(sched.maybe_make_aware(last), sched.run_every, now, sched.relative)).astimezone(UTC)


def celery_times(sched: Any, after: datetime, count: int) -> list[datetime]:
    times, last = [], after
    for _ in range(count):
        last = celery_next_after(sched, last)
        times.append(last)
    return times


# --------------------------------------------------------------------------- planning


def plan_import(tasks: Iterable[Any], *, owner: Any, now: datetime) -> list[Plan]:
    """One Plan per periodic task, nothing written."""
    existing = imported_names(owner)
    return [plan_task(task, owner=owner, now=now, exists=job_name(task.name) in existing) for task in tasks]


def imported_names(owner: Any) -> set[str]:
    return set(Job.objects.filter(owner=owner).exclude(state=Job.State.DELETED).values_list("name", flat=True))


def job_name(name: str) -> str:
    """The job name a periodic task's name becomes: the API trims it, so " nightly"
    is the job "nightly" (compared untrimmed, every later import made another)."""
    return name.strip()


def plan_task(task: Any, *, owner: Any, now: datetime, exists: bool = False) -> Plan:
    plan = Plan(task_id=task.pk, name=task.name, source=describe_source(task))
    try:
        if task.name != task.name.strip() or not task.name.strip():
            # A job's name is trimmed: " nightly" would become "nightly" (another task's
            # name, perhaps) and all-space names the same empty one.
            raise Refused("its name has spaces around it (or is all spaces); rename the periodic task")
        plan.body = job_body(task, now=now)
        plan.fields = _validated(plan.body, owner)
        plan.ours_next = our_times(plan.fields, now, SHOWN)
        plan.beat_next = beat_times(task, now, SHOWN)
        if task.one_off and not task.clocked_id:
            # beat runs a one_off once, at its next time: the job is a one-off then.
            if not plan.ours_next:
                raise Refused("a one_off with no time left before its expires")
            plan.body = _one_off_body(plan.body, plan.ours_next[0])
            plan.fields = _validated(plan.body, owner)
            plan.ours_next, plan.beat_next = plan.ours_next[:1], plan.beat_next[:1]
    except Refused as exc:
        plan.reason = str(exc)
        return plan
    plan.job_schedule = describe_job(plan.body)
    plan.status = "exists" if exists else "create"
    return plan


def job_body(task: Any, *, now: datetime) -> dict[str, Any]:
    """The API body for `task`, or Refused: what it cannot carry over exactly."""
    _refuse_unsupported(task, now)
    body: dict[str, Any] = {"name": task.name, **_target(task), **_timing(task, now)}
    # Scheduled times are whole seconds: t >= start_time is t >= start_time rounded up,
    # and t <= expires is t <= expires rounded down, so both carry over exactly.
    if task.start_time is not None and "every" not in body and not body.get("at"):
        body["starts_at"] = iso_z(schedule.round_up_to_second(task.start_time))
    if task.expires is not None and not body.get("at"):
        body["ends_at"] = iso_z(task.expires)
    if not task.enabled:
        body["paused"] = True
    return body


def _refuse_unsupported(task: Any, now: datetime) -> None:
    if task.solar_id:
        raise Refused(f"a solar schedule ({task.solar}) has no cron or interval equal")
    if not (task.crontab_id or task.interval_id or task.clocked_id):
        raise Refused("it has no schedule")
    headers = _json(task.headers, "headers", dict)
    if headers:
        raise Refused(f"message headers {sorted(headers)} are not sent by a task job")
    for option in UNSUPPORTED_OPTIONS:
        if getattr(task, option, None) not in (None, ""):
            raise Refused(f"{option}={getattr(task, option)!r} has no equal on a task job")
    if task.expires is not None and task.expires <= now:
        raise Refused(f"it expired at {iso_z(task.expires)}: beat no longer runs it")
    if (task.one_off or task.clocked_id) and not task.enabled and (task.last_run_at or task.total_run_count):
        # beat switches a one_off off once it has run: nothing is left to run.
        ran = f" at {iso_z(task.last_run_at)}" if task.last_run_at else ""
        raise Refused(f"a one-off that already ran{ran}: nothing is left to run")


def _target(task: Any) -> dict[str, Any]:
    target: dict[str, Any] = {"task": task.task}
    args = _json(task.args, "args", list)
    kwargs = _json(task.kwargs, "kwargs", dict)
    if args:
        target["args"] = args
    if kwargs:
        target["kwargs"] = kwargs
    # "celery" is Celery's default queue, the one a job without `queue` publishes to;
    # beat tables name it often, and a job may not name it (jobs.validators.queue_refusal).
    if task.queue and task.queue != DEFAULT_QUEUE:
        target["queue"] = task.queue
    return target


def _json(text: str | None, name: str, kind: type) -> Any:
    if text in (None, ""):
        return kind()
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise Refused(f"its {name} are not JSON ({exc})") from exc
    except RecursionError as exc:
        raise Refused(f"its {name} are nested too deeply") from exc
    if not isinstance(value, kind):
        raise Refused(f"its {name} are not a JSON {'list' if kind is list else 'object'}")
    return value


def _timing(task: Any, now: datetime) -> dict[str, Any]:
    if task.clocked_id:
        # With its fraction: the API rounds it up to the next whole second.
        return {"at": task.clocked.clocked_time.astimezone(UTC).isoformat().replace("+00:00", "Z")}
    if task.interval_id:
        return _interval_timing(task, now)
    return {"schedule": crontab_expression(task.crontab), "timezone": str(task.crontab.timezone)}


def _interval_timing(task: Any, now: datetime) -> dict[str, Any]:
    interval = task.interval
    try:
        every = timedelta(**{interval.period: interval.every})
    except (TypeError, ValueError, OverflowError) as exc:  # a period beat does not know, or a span too long
        raise Refused(f"an interval of {interval.every} {interval.period!r} is not one Python can hold "
                      f"({type(exc).__name__})") from exc
    if every < timedelta(seconds=1):
        raise Refused(f"an interval of {every.total_seconds():g}s is below one second")
    if every.microseconds:
        raise Refused(f"an interval of {every.total_seconds():g}s is not whole seconds")
    return {"every": schedule.format_duration(every), "starts_at": iso_z(interval_anchor(task, now))}


def interval_anchor(task: Any, now: datetime) -> datetime:
    """Where an imported interval's cadence is counted from: beat's `last_run_at` (so it
    carries on), but `start_time` when that is later (beat waits for it), else now.
    Whole seconds (scheduled times are whole seconds): a fraction is dropped."""
    marks = [t for t in (task.last_run_at, task.start_time) if t is not None]
    anchor = max(marks) if marks else now
    return anchor.astimezone(UTC).replace(microsecond=0)


def crontab_expression(crontab: Any) -> str:
    """Five cron fields with exactly the times celery gives this CrontabSchedule."""
    try:
        sched = crontab.schedule
    except Exception as exc:  # celery's parser: ValueError / ParseException
        raise Refused(f"celery cannot read the crontab ({exc})") from exc
    sets = {name: set(getattr(sched, name)) for name in FULL}
    if sets["day_of_month"] != FULL["day_of_month"] and sets["day_of_week"] != FULL["day_of_week"]:
        raise Refused(
            "it restricts both day of month and day of week: celery runs on days matching both, "
            "cron on days matching either"
        )
    order = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
    texts = [_field_text(getattr(crontab, name), sets[name], FULL[name]) for name in order]
    if _cronsim_sets(" ".join(texts)) != [sets[name] for name in order]:
        texts = [_compact(sets[name], FULL[name]) for name in order]
    return " ".join(texts)


def _field_text(text: str, values: set[int], full: set[int]) -> str:
    text = " ".join(str(text).split())
    return "*" if values == full else (text if text and " " not in text else _compact(values, full))


def _cronsim_sets(expr: str) -> list[set[int]] | None:
    from cronsim import CronSim

    try:
        sim = CronSim(expr, datetime(2000, 1, 1))
    except Exception:
        return None
    weekdays = {d % 7 for d in sim.weekdays if isinstance(d, int) and 0 <= d <= 7}
    found = [sim.minutes, sim.hours, sim.days, sim.months, weekdays]
    if any(not all(isinstance(v, int) and v >= 0 for v in values) for values in found):
        return None  # L, W, # forms: not what celery meant
    return [set(values) for values in found]


def _compact(values: set[int], full: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"; every value -> "*"."""
    if values == full:
        return "*"
    ordered, runs = sorted(values), []
    start = prev = ordered[0]
    for value in ordered[1:] + [None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if value is not None:
            start = prev = value
    return ",".join(runs)


def _one_off_body(body: dict[str, Any], when: datetime) -> dict[str, Any]:
    one_off = {k: v for k, v in body.items() if k not in ("schedule", "every", "starts_at", "ends_at")}
    one_off["at"] = iso_z(when)
    return one_off


def _validated(body: dict[str, Any], owner: Any) -> dict[str, Any]:
    """The API's own validation of the body: its 400 words become the reason."""
    from jobs.serializers import JobSerializer

    serializer = JobSerializer(data=body, context={"owner": owner})
    if not serializer.is_valid():
        raise Refused(_first_error(serializer.errors))
    return serializer.service_fields()


def _first_error(errors: Any, prefix: str = "") -> str:
    if isinstance(errors, dict):
        parts = [_first_error(v, f"{k}: ") for k, v in errors.items()]
        return "; ".join(prefix + p for p in parts)
    if isinstance(errors, list):
        return " ".join(_first_error(e) for e in errors)
    return str(errors)


# --------------------------------------------------------------------------- next times


def our_times(fields: dict[str, Any], now: datetime, count: int) -> list[datetime]:
    """The job's next times by the one decider (runs.nextrun.job_next_run_time),
    asked about the job as it would be created at `now`."""
    from runs.nextrun import job_next_run_time

    job = unsaved_job(fields)
    times: list[datetime] = []
    latest = None
    for _ in range(count if job.is_recurring else 1):
        when = job_next_run_time(job, latest=latest, since=now if latest is None else None, now=now)
        if when is None or (times and when <= times[-1]):
            break  # past ends_at
        times.append(when)
        latest = when
    return times


def unsaved_job(fields: dict[str, Any]) -> Job:
    columns = {k: v for k, v in fields.items() if k not in ("headers", "secret_headers", "paused")}
    return Job(**columns)


def beat_times(task: Any, now: datetime, count: int) -> list[datetime]:
    """The next times celery's own classes give this periodic task, as beat would
    step it (each from the one before), from `now` (an interval: from its anchor);
    none before its start_time or after its expires (beat's ModelEntry.is_due)."""
    if task.clocked_id:
        return [task.clocked.clocked_time.astimezone(UTC)]
    times = _celery_times(task, now, count * 4)
    times = [t for t in times if (task.start_time is None or t >= task.start_time)]
    return [t for t in times if (task.expires is None or t <= task.expires)][:count]


def _celery_times(task: Any, now: datetime, count: int) -> list[datetime]:
    sched = task.schedule
    if task.interval_id:
        anchor, every = interval_anchor(task, now), sched.run_every
        # Start from the last beat of the cadence at or before now (celery's interval
        # is "last run + every", so stepping from there is stepping from the anchor).
        last = anchor + max(0, (now - anchor) // every) * every
        # A start_time still ahead: beat runs the task at start_time itself, then on.
        times: list[datetime] = [anchor] if anchor > now else []
        while len(times) < count:
            last = celery_next_after(sched, last)
            if last > now:
                times.append(last)
        return times
    return celery_times(sched, now, count)


# --------------------------------------------------------------------------- descriptions


def describe_source(task: Any) -> str:
    if task.crontab_id:
        c = task.crontab
        text = f"crontab {c.minute} {c.hour} {c.day_of_month} {c.month_of_year} {c.day_of_week} {c.timezone}"
    elif task.interval_id:
        text = f"every {task.interval.every} {task.interval.period}"
    elif task.clocked_id:
        text = f"clocked {iso_z(task.clocked.clocked_time)}"
    elif task.solar_id:
        text = f"solar {task.solar}"
    else:
        text = "no schedule"
    flags = [f for f, on in (("one_off", task.one_off), ("disabled", not task.enabled)) if on]
    return text + (f" ({', '.join(flags)})" if flags else "")


def describe_job(body: dict[str, Any]) -> str:
    if "schedule" in body:
        text = f"cron {body['schedule']} {body.get('timezone', 'UTC')}"
    elif "every" in body:
        text = f"every {body['every']} from {body['starts_at']}"
    else:
        text = f"at {body['at']}"
    if body.get("starts_at") and "every" not in body:
        text += f" from {body['starts_at']}"
    if body.get("ends_at"):
        text += f" until {body['ends_at']}"
    return text + (" (paused)" if body.get("paused") else "")


# --------------------------------------------------------------------------- writing


@dataclass
class ImportResult:
    plans: list[Plan]
    disabled: int = 0

    def count(self, status: str) -> int:
        return sum(1 for p in self.plans if p.status == status)


def beat_import(
    *, owner: Any, plans: list[Plan], now: datetime | None = None, disable_alias: str | None = None
) -> ImportResult:
    """Create the planned jobs (`create`), one savepoint each: one task's error costs
    only that task (it becomes `skip` with the reason). With `disable_alias`
    "default", the imported periodic tasks (created now or before) are switched off
    in the same transaction; any other alias is the caller's to disable after the
    commit (disable_periodic_tasks), since it is another database."""
    now = now or timezone.now()
    with transaction.atomic():
        _lock_owner(owner)
        existing = imported_names(owner)  # read under the lock: a concurrent import cannot double up
        plans = [replace(p, status="exists") if p.status == "create" and job_name(p.name) in existing else p for p in plans]
        for plan in plans:
            if plan.status == "create":
                _create_one(owner, plan, now)
        result = ImportResult(plans=plans)
        if disable_alias == "default":
            result.disabled = disable_periodic_tasks("default", imported_task_ids(plans))
    return result


def _lock_owner(owner: Any) -> None:
    from django.contrib.auth import get_user_model

    list(get_user_model().objects.select_for_update().filter(pk=owner.pk).values_list("pk"))


def _create_one(owner: Any, plan: Plan, now: datetime) -> None:
    from jobs.services import job_create

    try:
        with transaction.atomic():
            job = job_create(owner=owner, fields=plan.fields, now=now)
            audit_record(
                actor=None, via="command", action="created", obj=job,
                detail={"source": "import_beat", "periodic_task": plan.name, "fields": sorted(plan.body)},
                at=now,
            )
    except (ValueError, DatabaseError) as exc:
        # One task's row the store refuses (a clash, a value it cannot hold): that task is
        # skipped with the reason, its savepoint undone; the rest are imported.
        plan.status, plan.reason = "skip", f"not created: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        return
    plan.status, plan.job_id = "created", job.public_id


def imported_task_ids(plans: list[Plan]) -> list[int]:
    return [p.task_id for p in plans if p.status in ("created", "exists")]


def disable_periodic_tasks(alias: str, ids: list[int]) -> int:
    """Switch those periodic tasks off, and tell beat its schedule changed (the
    PeriodicTasks row DatabaseScheduler polls; a queryset update sends no signal)."""
    from django_celery_beat.models import PeriodicTask, PeriodicTasks

    with transaction.atomic(using=alias):
        count = PeriodicTask.objects.using(alias).filter(pk__in=ids, enabled=True).update(enabled=False)
        if count:
            PeriodicTasks.objects.using(alias).update_or_create(ident=1, defaults={"last_update": timezone.now()})
    return count
