"""`import_beat`: django-celery-beat's periodic tasks become jobs, exactly or not at all.

The big test holds 1,000 periodic tasks of every kind in this project's database,
imports them at a frozen instant a week before the American spring-forward, and
checks, for every imported crontab and interval, that our next 50 times are the ones
celery's own schedule classes give (stepped with their `remaining_estimate`), except
on DST-change days, where the differences are listed below as data
(docs/from-celery-beat.md explains them).
"""
from __future__ import annotations

import io
import json
from collections import Counter
from datetime import datetime, timedelta, timezone as dt_timezone
from typing import Any
from zoneinfo import ZoneInfo

import psycopg
import pytest
import time_machine
from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django_celery_beat.models import (
    ClockedSchedule,
    CrontabSchedule,
    IntervalSchedule,
    PeriodicTask,
    PeriodicTasks,
    SolarSchedule,
)

from jobs import beat_import
from jobs.models import Job
from jobs.services import service_tasks_grant
from runs.models import Run
from runs.nextrun import job_next_run_time

UTC = dt_timezone.utc
NOW = datetime(2026, 3, 1, 0, 0, 0, tzinfo=UTC)
ZONES = ["UTC", "America/New_York", "Asia/Kolkata", "Europe/London", "Australia/Sydney"]
STEPS = 50


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


# Each archetype: (key, how to build its periodic task, the expected outcome:
# "create", "paused" or a phrase of the skip reason). A crontab archetype is made in
# every zone in turn.
CRONTABS = {
    "daily-0230": ("30", "2", "*", "*", "*"),
    "sunday-0130": ("30", "1", "*", "*", "sun"),
    "sunday-0230": ("30", "2", "*", "*", "0"),
    "hourly-15": ("15", "*", "*", "*", "*"),
    "office-hours": ("*/15", "9-17", "*", "*", "mon-fri"),
    "monthly": ("0", "0", "1", "*", "*"),
    "quarterly": ("0", "3", "15", "1,4,7,10", "*"),
    "weekend-wrap": ("0", "6", "*", "*", "fri-mon"),  # celery reads a wrapping range; cron does not
    "every-minute": ("*", "*", "*", "*", "*"),
    "full-dom-named": ("0", "4", "1-31", "*", "tue"),  # 1-31 is every day: written `*`, so cron ANDs too
}
REFUSED_CRONTABS = {
    "friday-13th": (("0", "0", "13", "*", "5"), "both day of month and day of week"),
    "bad-minute": (("61", "*", "*", "*", "*"), "celery cannot read the crontab"),
}


def _archetypes() -> list[tuple[str, dict[str, Any], str]]:
    arch: list[tuple[str, dict[str, Any], str]] = []
    for key, fields in CRONTABS.items():
        arch.append((f"cron-{key}", {"crontab": fields}, "create"))
    for key, (fields, reason) in REFUSED_CRONTABS.items():
        arch.append((f"cron-{key}", {"crontab": fields}, reason))
    arch += [
        ("interval-90m-last-run", {"interval": (90, "minutes"), "last_run_at": NOW - timedelta(minutes=200)}, "create"),
        ("interval-1h-new", {"interval": (1, "hours")}, "create"),
        ("interval-1d-later-start", {"interval": (1, "days"), "start_time": NOW + timedelta(days=3, seconds=7)}, "create"),
        (
            "interval-5m-start-before-last",
            {"interval": (5, "minutes"), "start_time": NOW - timedelta(days=9), "last_run_at": NOW - timedelta(seconds=71)},
            "create",
        ),
        ("interval-45s", {"interval": (45, "seconds"), "last_run_at": NOW - timedelta(seconds=13)}, "SCHEDULER_MIN_INTERVAL"),
        ("interval-7m", {"interval": (420, "seconds"), "last_run_at": NOW - timedelta(seconds=13, microseconds=250)}, "create"),
        ("interval-half-second", {"interval": (500_000, "microseconds")}, "below one second"),
        ("interval-1.5s", {"interval": (1_500_000, "microseconds")}, "not whole seconds"),
        ("clocked-future", {"clocked": NOW + timedelta(days=4, hours=5), "one_off": True}, "create"),
        (
            "clocked-ran",
            {"clocked": NOW - timedelta(days=1), "one_off": True, "enabled": False, "last_run_at": NOW - timedelta(days=1)},
            "already ran",
        ),
        ("one-off-cron", {"crontab": ("0", "9", "*", "*", "*"), "one_off": True}, "create"),
        ("one-off-interval", {"interval": (2, "hours"), "one_off": True, "last_run_at": NOW - timedelta(minutes=30)}, "create"),
        ("disabled-cron", {"crontab": ("0", "5", "*", "*", "*"), "enabled": False}, "paused"),
        ("disabled-interval", {"interval": (10, "minutes"), "enabled": False}, "paused"),
        ("solar", {"solar": ("sunset", "51.5", "-0.12")}, "a solar schedule"),
        ("unknown-task", {"crontab": ("0", "1", "*", "*", "*"), "task": "other.tasks.cleanup"}, "not under a task prefix"),
        ("with-headers", {"crontab": ("0", "2", "*", "*", "*"), "headers": '{"x-team": "a"}'}, "message headers"),
        ("with-routing-key", {"crontab": ("0", "2", "*", "*", "*"), "routing_key": "rk"}, "routing_key"),
        ("expired", {"crontab": ("0", "2", "*", "*", "*"), "expires": NOW - timedelta(days=1)}, "expired at"),
        (
            "expires-later",
            {"crontab": ("0", "7", "*", "*", "*"), "expires": NOW + timedelta(days=20), "start_time": NOW + timedelta(days=1)},
            "create",
        ),
        (
            "task-arguments",
            {"crontab": ("0", "8", "*", "*", "*"), "args": "[1, 2]", "kwargs": '{"mode": "full"}', "queue": "reports"},
            "create",
        ),
        # Beat tables name Celery's default queue often; a job gets it by leaving queue out.
        ("queue-celery", {"crontab": ("0", "9", "*", "*", "*"), "queue": "celery"}, "create"),
        # A broker key of the scheduler's own (its worker's WRONGTYPE when published to).
        ("queue-broker-key", {"crontab": ("0", "9", "*", "*", "*"), "queue": "unacked_index"}, "broker transport's own names"),
    ]
    return arch


ARCHETYPES = _archetypes()


def make_beat_database(count: int, *, using: str = "default") -> dict[str, tuple[str, str]]:
    """`count` periodic tasks cycling through the archetypes (crontabs in every zone);
    returns name -> (archetype, expected outcome)."""
    crontabs: dict[tuple[Any, ...], CrontabSchedule] = {}
    intervals: dict[tuple[Any, ...], IntervalSchedule] = {}
    tasks, expected = [], {}
    for i in range(count):
        key, spec, outcome = ARCHETYPES[i % len(ARCHETYPES)]
        zone = ZONES[(i // len(ARCHETYPES)) % len(ZONES)]
        name = f"{key}-{i:04d}"
        task = PeriodicTask(
            name=name, task=spec.get("task", "app.tasks." + key.replace("-", "_").replace(".", "_")), enabled=spec.get("enabled", True),
            one_off=spec.get("one_off", False), last_run_at=spec.get("last_run_at"),
            start_time=spec.get("start_time"), expires=spec.get("expires"),
            args=spec.get("args", "[]"), kwargs=spec.get("kwargs", "{}"), queue=spec.get("queue"),
            headers=spec.get("headers", "{}"), routing_key=spec.get("routing_key"),
        )
        if "crontab" in spec:
            fields = (*spec["crontab"], zone)
            if fields not in crontabs:
                m, h, dom, moy, dow, tz = fields
                crontabs[fields] = CrontabSchedule.objects.using(using).create(
                    minute=m, hour=h, day_of_month=dom, month_of_year=moy, day_of_week=dow, timezone=tz
                )
            task.crontab = crontabs[fields]
        elif "interval" in spec:
            if spec["interval"] not in intervals:
                every, period = spec["interval"]
                intervals[spec["interval"]] = IntervalSchedule.objects.using(using).create(every=every, period=period)
            task.interval = intervals[spec["interval"]]
        elif "clocked" in spec:
            task.clocked = ClockedSchedule.objects.using(using).create(clocked_time=spec["clocked"])
        else:
            event, lat, lon = spec["solar"]
            task.solar, _ = SolarSchedule.objects.using(using).get_or_create(event=event, latitude=lat, longitude=lon)
        tasks.append(task)
        expected[name] = (key, outcome)
    PeriodicTask.objects.using(using).bulk_create(tasks, batch_size=500)
    return expected


@pytest.fixture
def owner(service: Any) -> Any:
    service_tasks_grant(name="reports", prefixes=["app."])
    return service.user


def run_command(*args: str) -> str:
    out = io.StringIO()
    call_command("import_beat", "--owner", "reports", *args, stdout=out)
    return out.getvalue()


# --------------------------------------------------------------------------- celery's side, stepped by itself


def beat_schedule(task: PeriodicTask) -> Any:
    """The schedule object django-celery-beat's DatabaseScheduler would use for the task."""
    return task.schedule


def beat_next(sched: Any, last: datetime) -> datetime:
    """Celery's next fire time after a run at `last`: now + remaining_estimate(last),
    the clock frozen, which is how beat's is_due decides."""
    now = datetime.now(UTC)
    return (now + sched.remaining_estimate(last)).astimezone(UTC)


def beat_steps(sched: Any, last: datetime, until: datetime) -> list[datetime]:
    times: list[datetime] = []
    for _ in range(STEPS * 3):
        last = beat_next(sched, last)
        if last > until:
            break
        times.append(last)
    return times


def our_steps(job: Job, first: datetime, now: datetime) -> list[datetime]:
    times = [first]
    while len(times) < STEPS:
        when = job_next_run_time(job, latest=times[-1], since=None, now=now)
        if when is None:
            break  # past ends_at
        times.append(when)
    return times


def within_bounds(task: PeriodicTask, times: list[datetime]) -> list[datetime]:
    """Beat runs nothing before start_time or after expires (ModelEntry.is_due)."""
    return [t for t in times if (task.start_time is None or t >= task.start_time) and (task.expires is None or t <= task.expires)]


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# The differences between our next 50 times and celery's, per crontab and zone, as
# (side that has the time, UTC time). Every one is on a DST-change day in that zone:
# EXPECTED_DST_DIFFERENCES is the data docs/from-celery-beat.md quotes.
#
# In a spring-forward gap we run a wall time that does not exist at the first moment
# after the gap (03:00 in New York); celery reads it with the offset from before the
# gap, which lands half an hour later (03:30). In the repeated hour of a fall-back
# both run once, at the first pass (no difference: Sydney's 2026-04-05, New York's
# 2026-11-01 are in the 50 weeks of the Sunday crontabs and agree).
EXPECTED_DST_DIFFERENCES: dict[tuple[str, str], list[tuple[str, str]]] = {
    ("30 1 * * sun", "Europe/London"): [("ours", "2026-03-29T01:00:00Z"), ("beat", "2026-03-29T01:30:00Z")],
    ("30 2 * * *", "America/New_York"): [("ours", "2026-03-08T07:00:00Z"), ("beat", "2026-03-08T07:30:00Z")],
    ("30 2 * * 0", "America/New_York"): [("ours", "2026-03-08T07:00:00Z"), ("beat", "2026-03-08T07:30:00Z")],
    ("30 2 * * 0", "Australia/Sydney"): [("ours", "2026-10-03T16:00:00Z"), ("beat", "2026-10-03T16:30:00Z")],
}


def is_dst_change_day(zone: str, t: datetime) -> bool:
    tz = ZoneInfo(zone)
    day = t.astimezone(tz).date()
    start = datetime(day.year, day.month, day.day, tzinfo=tz)
    end = start + timedelta(days=1)
    return start.utcoffset() != (end + timedelta(hours=1)).astimezone(tz).utcoffset() or start.utcoffset() != end.utcoffset()


@time_machine.travel(NOW, tick=False)
def test_a_thousand_periodic_tasks_are_planned_imported_once_and_keep_celery_times(owner: Any) -> None:
    expected = make_beat_database(1000)
    assert PeriodicTask.objects.count() == 1000

    table = run_command("--dry-run")
    assert Job.objects.count() == 0, "a dry run creates nothing"
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["name", "source", "schedule"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == set(expected)
    solar = next(name for name in rows if name.startswith("solar-"))
    assert "skipped: a solar schedule" in rows[solar]
    want_created = sum(1 for _, outcome in expected.values() if outcome in ("create", "paused"))
    for name, (_key, outcome) in expected.items():
        if outcome in ("create", "paused"):
            assert rows[name].rstrip().endswith("would create"), rows[name]
        else:
            assert "skipped: " in rows[name] and outcome in rows[name], rows[name]
    assert lines[-1] == (
        f"1000 periodic tasks: would create {want_created} jobs; 0 already imported; "
        f"{1000 - want_created} skipped (reasons above)"
    )

    first = run_command()
    assert first.splitlines()[-1].startswith(f"1000 periodic tasks: created {want_created} jobs; 0 already")
    jobs = {job.name: job for job in Job.objects.filter(owner=owner)}
    assert set(jobs) == {n for n, (_, o) in expected.items() if o in ("create", "paused")}
    assert Run.objects.filter(job__in=jobs.values()).count() == want_created, "each job has its first run"

    second = run_command()
    assert Job.objects.count() == want_created, "the second run creates nothing"
    assert second.splitlines()[-1].startswith(f"1000 periodic tasks: created 0 jobs; {want_created} already imported")

    _check_fields(jobs, expected)
    checked, differences = _compare_with_celery(jobs, NOW)
    assert differences == EXPECTED_DST_DIFFERENCES, _shown(differences)
    assert checked["crontab"] > 300 and checked["interval"] > 100 and checked["one-off"] > 40, checked


def _check_fields(jobs: dict[str, Job], expected: dict[str, tuple[str, str]]) -> None:
    tasks = {t.name: t for t in PeriodicTask.objects.select_related("crontab", "interval", "clocked")}
    for name, job in jobs.items():
        key, outcome = expected[name]
        task = tasks[name]
        assert job.task == task.task
        assert job.paused is (outcome == "paused")
        if task.crontab_id and not task.one_off:
            assert job.timezone == str(task.crontab.timezone)
    arguments = next(job for name, job in jobs.items() if name.startswith("task-arguments"))
    assert (arguments.args, arguments.kwargs, arguments.queue) == ([1, 2], {"mode": "full"}, "reports")
    default_queue = next(job for name, job in jobs.items() if name.startswith("queue-celery"))
    assert default_queue.queue == "celery"
    assert not any(name.startswith("queue-broker-key") for name in jobs)
    wrap = next(job for name, job in jobs.items() if name.startswith("cron-weekend-wrap"))
    assert wrap.schedule == "0 6 * * 0-1,5-6"
    full_dom = next(job for name, job in jobs.items() if name.startswith("cron-full-dom-named"))
    assert full_dom.schedule == "0 4 * * tue"
    clocked = next(job for name, job in jobs.items() if name.startswith("clocked-future"))
    assert clocked.run_at == NOW + timedelta(days=4, hours=5) and not clocked.is_recurring
    later = next(job for name, job in jobs.items() if name.startswith("expires-later"))
    assert (later.starts_at, later.ends_at) == (NOW + timedelta(days=1), NOW + timedelta(days=20))


def _shown(differences: dict[tuple[str, str], list[tuple[str, str]]]) -> str:
    return json.dumps({f"{k[0]} | {k[1]}": v for k, v in sorted(differences.items())}, indent=1)


def _compare_with_celery(jobs: dict[str, Job], now: datetime) -> tuple[Counter[str], dict[tuple[str, str], list[tuple[str, str]]]]:
    """For every job: our next STEPS times against celery's for its periodic task.
    Intervals and one-offs must agree exactly (asserted here); a crontab's differences
    must all be on DST-change days in its zone, and are returned per (cron, zone)."""
    tasks = {t.name: t for t in PeriodicTask.objects.select_related("crontab", "interval", "clocked")}
    firsts = dict(Run.objects.filter(job__in=jobs.values()).values_list("job__name", "scheduled_for"))
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    checked: Counter[str] = Counter()
    for name, job in sorted(jobs.items()):
        task = tasks[name]
        sched = beat_schedule(task)
        if task.one_off:
            # A one_off becomes a one-off at the time beat would run it first.
            assert job.run_at == beat_next(sched, beat_import.interval_anchor(task, now) if task.interval_id else now)
            checked["one-off"] += 1
            continue
        if task.clocked_id:
            continue
        first = firsts[name]
        ours = our_steps(job, first, now)
        if task.interval_id:
            anchor = beat_import.interval_anchor(task, now)
            assert job.starts_at == anchor
            start = anchor + max(0, (now - anchor) // sched.run_every) * sched.run_every
            # Beat runs a task whose start_time is ahead at start_time itself (django-celery-beat
            # puts its last_run_at far back), then every interval from there.
            beats = ([anchor] if anchor > now else []) + beat_steps(sched, start, ours[-1])
            beats = [t for t in beats if t > now]
            assert ours == beats[:STEPS], name  # UTC cadence: no DST difference at all
            checked["interval"] += 1
            continue
        until = ours[-1] if len(ours) == STEPS else task.expires
        beats = within_bounds(task, beat_steps(sched, now, until))
        difference = sorted(
            [("ours", iso(t)) for t in set(ours) - set(beats)] + [("beat", iso(t)) for t in set(beats) - set(ours)],
            key=lambda d: (d[1], d[0]),
        )
        zone = job.timezone
        for _side, when in difference:
            assert is_dst_change_day(zone, at(when)), (name, when)
        definition = (job.schedule, zone)
        if definition in found:
            assert found[definition] == difference, name
        found[definition] = difference
        checked["crontab"] += 1
    return checked, {k: v for k, v in found.items() if v}


# On the DST-change days themselves, crontabs that fire every hour or minute through
# the change, in New York, imported just before each change.
DST_DAY_CRONTABS = {
    "hourly-15": ("15", "*", "*", "*", "*"),
    "half-hourly": ("0,30", "*", "*", "*", "*"),
    "every-minute": ("*", "*", "*", "*", "*"),
    "at-0230": ("30", "2", "*", "*", "*"),
    "at-0130": ("30", "1", "*", "*", "*"),
}
EXPECTED_ON_DST_DAYS: dict[str, dict[tuple[str, str], list[tuple[str, str]]]] = {
    # Spring forward, 02:00 EST -> 03:00 EDT. `15 * * * *`: 02:15 does not exist; we run
    # it at 03:00 EDT, then 03:15 as usual; celery's 02:15 is read as 03:15 EDT, the same
    # instant as its 03:15, so beat runs once there and has nothing at 03:00.
    # `0,30 * * * *` and `* * * * *` agree: every gap time lands on a time both run.
    "2026-03-08T05:30:00Z": {
        ("15 * * * *", "America/New_York"): [("ours", "2026-03-08T07:00:00Z")],
        ("30 2 * * *", "America/New_York"): [("ours", "2026-03-08T07:00:00Z"), ("beat", "2026-03-08T07:30:00Z")],
    },
    # Fall back, 02:00 EDT -> 01:00 EST: the repeated hour runs once, at its first pass,
    # on both sides, for every one of these crontabs.
    "2026-11-01T04:30:00Z": {},
}


@pytest.mark.parametrize("frozen", sorted(EXPECTED_ON_DST_DAYS))
def test_on_dst_change_days_our_times_differ_from_celery_only_as_listed(owner: Any, frozen: str) -> None:
    with time_machine.travel(at(frozen), tick=False):
        for key, (m, h, dom, moy, dow) in DST_DAY_CRONTABS.items():
            crontab = CrontabSchedule.objects.create(
                minute=m, hour=h, day_of_month=dom, month_of_year=moy, day_of_week=dow, timezone="America/New_York"
            )
            PeriodicTask.objects.create(name=key, task="app.tasks.x", crontab=crontab)
        run_command()
        jobs = {job.name: job for job in Job.objects.filter(owner=owner)}
        assert len(jobs) == len(DST_DAY_CRONTABS)
        _checked, differences = _compare_with_celery(jobs, at(frozen))
    assert differences == EXPECTED_ON_DST_DAYS[frozen], _shown(differences)


# --------------------------------------------------------------------------- --disable-source, --database, bad input


def _few_tasks(using: str = "default") -> None:
    every_day = CrontabSchedule.objects.using(using).create(minute="0", hour="2", timezone="Asia/Kolkata")
    PeriodicTask.objects.using(using).create(name="nightly", task="app.tasks.nightly", crontab=every_day)
    PeriodicTask.objects.using(using).create(name="foreign", task="other.tasks.x", crontab=every_day)


@pytest.mark.embedded
def test_disable_source_switches_the_imported_tasks_off_in_the_same_transaction(owner: Any) -> None:
    _few_tasks()
    before = PeriodicTasks.last_change()
    out = run_command("--disable-source")
    assert "disabled 1 periodic tasks in this database, in the import's transaction" in out
    enabled = dict(PeriodicTask.objects.values_list("name", "enabled"))
    assert enabled == {"nightly": False, "foreign": True}, "only what was imported is switched off"
    assert Job.objects.get(name="nightly").schedule == "0 2 * * *"
    assert PeriodicTasks.last_change() != before, "beat is told its schedule changed"


def test_a_failing_disable_rolls_the_import_back_with_it(owner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _few_tasks()

    def refuse(alias: str, ids: list[int]) -> int:
        raise RuntimeError("the disable failed")

    monkeypatch.setattr(beat_import, "disable_periodic_tasks", refuse)
    with pytest.raises(RuntimeError):
        run_command("--disable-source")
    assert Job.objects.count() == 0, "one transaction: no job without the source switched off"
    assert PeriodicTask.objects.filter(enabled=True).count() == 2


@pytest.mark.embedded
def test_without_disable_source_beat_keeps_its_tasks_on(owner: Any) -> None:
    _few_tasks()
    run_command()
    assert PeriodicTask.objects.filter(enabled=True).count() == 2
    assert Job.objects.filter(name="nightly").count() == 1


@pytest.fixture
def second_database() -> Any:
    """A django-celery-beat database of its own on the same PostgreSQL, dropped after."""
    base = settings.DATABASES["default"]
    name = f"{base['NAME']}_beat_source"
    server = f"postgres://{base['USER']}@{base['HOST']}:{base['PORT'] or 5432}"
    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{server}/{name}"
    alias = beat_import.source_alias(url)
    call_command("migrate", "django_celery_beat", database=alias, verbosity=0)
    yield url, alias
    beat_import.source_close(alias)
    with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.mark.django_db(transaction=True)
def test_database_url_imports_from_another_database_and_disables_there_after_the_commit(
    owner: Any, second_database: Any
) -> None:
    url, alias = second_database
    _few_tasks(using=alias)
    assert not PeriodicTask.objects.exists(), "this project's own beat tables stay empty"
    out = run_command("--database", url, "--disable-source")
    assert "disabled 1 periodic tasks in --database after the import committed (a separate transaction)" in out
    assert Job.objects.get(name="nightly").timezone == "Asia/Kolkata"
    alias = beat_import.source_alias(url)  # the command closed its own connection
    assert dict(PeriodicTask.objects.using(alias).values_list("name", "enabled")) == {"nightly": False, "foreign": True}
    again = run_command("--database", url)
    assert again.splitlines()[-1].startswith("2 periodic tasks: created 0 jobs; 1 already imported; 1 skipped")


def test_an_unknown_owner_is_a_one_line_error(db: None) -> None:
    with pytest.raises(CommandError, match="no service account 'nobody'"):
        call_command("import_beat", "--owner", "nobody")


def test_a_bad_database_url_is_a_one_line_error(owner: Any) -> None:
    with pytest.raises(CommandError, match="--database"):
        run_command("--database", "nonsense://")
    with pytest.raises(CommandError, match="cannot connect to --database"):
        run_command("--database", "postgres://postgres@127.0.0.1:1/nothing")


@pytest.mark.embedded
def test_crontab_timezone_reads_every_crontab_in_celerys_zone_for_a_project_without_tz_aware_beat(
    owner: Any,
) -> None:
    """With DJANGO_CELERY_BEAT_TZ_AWARE=False beat ran crontabs in Celery's zone, never
    reading their `timezone` field (stored as UTC by default): `--crontab-timezone`
    says which zone that was, for every crontab."""
    utc_field = CrontabSchedule.objects.create(minute="30", hour="9", timezone="UTC")
    PeriodicTask.objects.create(name="morning", task="app.tasks.morning", crontab=utc_field)

    out = run_command("--crontab-timezone", "Asia/Kolkata", "--dry-run")
    assert "cron 30 9 * * * Asia/Kolkata" in out and "crontab 30 9 * * * Asia/Kolkata" in out, out
    assert "T04:00:00Z, " in out  # beat next and job next: 09:30 in Kolkata
    run_command("--crontab-timezone", "Asia/Kolkata")
    job = Job.objects.get(name="morning")
    assert (job.schedule, job.timezone) == ("30 9 * * *", "Asia/Kolkata")
    assert CrontabSchedule.objects.get(pk=utc_field.pk).timezone.key == "UTC"  # the source is not written


def test_crontab_timezone_refuses_an_unknown_zone_in_one_line(owner: Any) -> None:
    with pytest.raises(CommandError, match="--crontab-timezone: 'Mars/Olympus' is not a known IANA time zone"):
        run_command("--crontab-timezone", "Mars/Olympus")


def test_hostile_periodic_tasks_are_skipped_with_a_reason_and_the_rest_imported(owner: Any) -> None:
    """A lone surrogate in args (a DataError in PostgreSQL: the whole import rolled back
    with a traceback), args nested past Python's stack (a RecursionError, --dry-run too),
    and a name with a terminal's escape sequence (printed raw): each task is skipped or
    shown escaped, and the others are imported."""
    every_day = CrontabSchedule.objects.create(minute="0", hour="2", timezone="UTC")
    PeriodicTask.objects.create(name="good", task="app.tasks.good", crontab=every_day)
    PeriodicTask.objects.create(name="surrogate", task="app.tasks.x", crontab=every_day, args='["\\ud800"]')
    PeriodicTask.objects.create(name="deep", task="app.tasks.y", crontab=every_day, args="[" * 100_000 + "]" * 100_000)
    PeriodicTask.objects.create(name="evil\x1b[2J\x1b]0;owned\x07", task="app.tasks.z", crontab=every_day)

    dry = run_command("--dry-run")
    assert "\x1b" not in dry and "\\x1b[2J" in dry, dry
    assert "nested too deeply" in dry
    out = run_command()
    assert "\x1b" not in out
    assert set(Job.objects.values_list("name", flat=True)) == {"good"}
    assert "lone surrogates" in out and "nested too deeply" in out and "control characters" in out, out
