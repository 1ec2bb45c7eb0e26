"""The clock: pure functions, no ORM. Aware datetimes in, UTC out.

Everything here is a pure function of its arguments (retry_delay's jitter aside,
and that takes an injectable `rng`), so it is tested without a database.

Cron parsing and iteration are cronsim's; the DST rule is ours (see `_wall_to_utc`):
cronsim only applies its own DST handling to some shapes of expression, so it is
always asked about naive wall-clock times and the rule is applied here, the same
way for every schedule.
"""
from __future__ import annotations

import heapq
import math
import random
import re
from collections import deque
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from functools import lru_cache
from typing import Iterator
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

UTC = ZoneInfo("UTC")

# --------------------------------------------------------------------------- durations

_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# Ordered largest first, for format_duration.
_UNITS_LARGEST_FIRST = ("d", "h", "m", "s")
_MAX_DURATION = timedelta(days=365)
# ASCII digits only: `\d` would also accept e.g. Arabic-Indic digits.
_DURATION_RE = re.compile(r"([0-9]+)([smhd])")
_DURATION_HOW = "use a whole number followed by s, m, h or d, like '90s' or '5m'"


def parse_duration(text: str, *, longest: timedelta = _MAX_DURATION) -> timedelta:
    """"90s", "5m", "2h", "1d", "0s" -> timedelta. Raises ValueError with a sentence
    a user can read ("must be a number followed by s, m, h or d, like '5m'")
    for anything else, negatives included. At most `longest` (365d unless told:
    `every` may be 366d)."""
    if not isinstance(text, str):
        raise ValueError(f"{text!r} is not a duration: {_DURATION_HOW}")
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"a duration is needed: {_DURATION_HOW}")
    match = _DURATION_RE.fullmatch(stripped)
    if match is None:
        raise ValueError(f"{text!r} is not a duration: {_DURATION_HOW}")
    digits, unit = match.groups()
    # Check the size on the digits before int(): a 5,000-digit number would
    # otherwise hit Python's int-conversion limit with a less helpful message.
    if len(digits) > 12 or int(digits) * _UNIT_SECONDS[unit] > longest.total_seconds():
        raise ValueError(f"{text!r} is too long: a duration can be at most {format_duration(longest)}")
    return timedelta(seconds=int(digits) * _UNIT_SECONDS[unit])


def format_duration(value: timedelta) -> str:
    """The largest whole unit: 300s -> "5m", 90s -> "90s", 0 -> "0s".

    Only whole, non-negative seconds have a form parse_duration reads back, so
    anything else is a ValueError rather than a silently rounded string."""
    if value < timedelta(0) or value.microseconds:
        raise ValueError(f"{value!r} cannot be written as a duration: it must be whole seconds, not negative")
    seconds = int(value.total_seconds())
    if seconds == 0:
        return "0s"
    for unit in _UNITS_LARGEST_FIRST:
        size = _UNIT_SECONDS[unit]
        if seconds % size == 0:
            return f"{seconds // size}{unit}"
    raise AssertionError("unreachable: every whole number of seconds divides by 1")


# --------------------------------------------------------------------------- zones & instants


def get_zone(name: str) -> ZoneInfo:
    """An IANA zone, or ValueError("unknown time zone 'X'")."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"unknown time zone {name!r}")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        # ZoneInfoNotFoundError for unknown keys, ValueError for keys like '../x',
        # OSError for a key naming a directory ('America').
        raise ValueError(f"unknown time zone {name!r}") from exc


def _as_utc(value: datetime, what: str = "time") -> datetime:
    """An aware datetime, converted to UTC; a naive one is a programming error
    (we would have to guess its zone), reported as ValueError."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"the {what} {value.isoformat()} has no time zone; an aware datetime is needed")
    return value.astimezone(UTC)


def _offset_at(seconds: int, zone: ZoneInfo) -> timedelta | None:
    return datetime.fromtimestamp(seconds, zone).utcoffset()


def _end_of_gap(before: datetime, after: datetime, zone: ZoneInfo) -> datetime:
    """The instant the clocks jumped forward, between two UTC instants that bracket it.

    zoneinfo has no public list of transitions, so find it by bisection over whole
    seconds (tz transitions are at whole seconds; a gap is at most a few hours, so
    this is a dozen steps)."""
    lo = math.floor(before.timestamp())
    hi = math.ceil(after.timestamp())
    offset_before = _offset_at(lo, zone)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _offset_at(mid, zone) == offset_before:
            lo = mid
        else:
            hi = mid
    return datetime.fromtimestamp(hi, UTC)


def _wall_to_utc(wall: datetime, zone: ZoneInfo) -> datetime:
    """A naive wall-clock time in `zone` -> the UTC instant it runs at, by our DST rule.

    PEP 495 gives each wall time two readings, fold=0 and fold=1:
    - they agree for an ordinary time;
    - in a fall-back repeat, fold=0 is the first occurrence (earlier in UTC):
      that is the one we run, once;
    - in a spring-forward gap the wall time never happens. There fold=0 reads it
      with the offset from before the jump, which lands *after* the jump, and fold=1
      with the offset from after, which lands *before* it; so fold=0 > fold=1 in UTC
      marks a gap, and the two bracket the jump. The rule runs a gap time at the
      first moment after the gap, i.e. at the jump itself (02:30 on a New York
      spring-forward night -> 03:00 EDT), not at fold=0's reading (03:30 EDT).

    This mapping never goes backwards as the wall time goes forwards (a whole gap
    maps to one instant; the repeated hour maps to its first pass, which is still
    before the time after it), which is what lets cron_times deduplicate by keeping
    only strictly increasing instants."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=zone, fold=1).astimezone(UTC)
    if first <= second:
        return first
    return _end_of_gap(second, first, zone)


def round_up_to_second(value: datetime) -> datetime:
    """Whole seconds, rounding a fraction up: 20:30:00.2 -> 20:30:01. Aware UTC out."""
    utc = _as_utc(value)
    if utc.microsecond:
        utc = utc.replace(microsecond=0) + timedelta(seconds=1)
    return utc


def resolve_at(value: str, zone: str) -> datetime:
    """An ISO 8601 time -> aware UTC, whole seconds (rounded up). With an offset or Z
    it is that instant; with none it is a wall-clock time in `zone` (the DST rule
    above for gaps and repeats). ValueError on a malformed string."""
    tz = get_zone(zone)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not a time: use ISO 8601, like '2026-10-28T20:30:00Z'")
    try:
        # Python 3.11's fromisoformat reads ISO 8601 with 'Z', offsets and fractions.
        parsed = datetime.fromisoformat(value.strip())
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a time: use ISO 8601, like '2026-10-28T20:30:00Z'") from exc
    try:
        if parsed.tzinfo is None:
            # Map first, round after: a fraction just before a gap rounds up into the
            # instant after it, which is what the rule gives anyway.
            instant = _wall_to_utc(parsed, tz)
        else:
            instant = parsed.astimezone(UTC)
        return round_up_to_second(instant)
    except OverflowError as exc:  # e.g. 9999-12-31T23:59:59.5Z, or year 1 with an offset
        raise ValueError(f"{value!r} is out of the range of dates that can be scheduled") from exc


# --------------------------------------------------------------------------- cron

_FIELDS = (
    # (name in messages, lowest, highest) -- cronsim's own ranges.
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day-of-month", 1, 31),
    ("month", 1, 12),
    ("day-of-week", 0, 7),
)
_CRONSIM_FIELD_NAMES = {"minute": 0, "hour": 1, "day-of-month": 2, "month": 3, "day-of-week": 4}
_NUMBER_RE = re.compile(r"[0-9]+")
# Any start will do to ask "does this ever fire?": cronsim gives up after 50 years.
_PROBE_START = datetime(2000, 1, 1)


def _field_problem(index: int, text: str) -> str:
    """Words for what is wrong with one field cronsim refused ("Bad minute")."""
    name, low, high = _FIELDS[index]
    for term in text.split(","):
        value_part, _, step = term.partition("/")
        if step and (not step.isdigit() or int(step) == 0):
            return f"the step in {name} '{term}' must be a whole number of at least 1"
        # '#n' (nth weekday of the month) is checked separately: n is not a day.
        value_part, _, nth = value_part.partition("#")
        if nth and (not nth.isdigit() or not 1 <= int(nth) <= 5):
            return f"in {name} '{term}' the number after '#' must be 1 to 5"
        for number in _NUMBER_RE.findall(value_part):
            if not low <= int(number) <= high:
                return f"{name} {int(number)} is out of range {low}-{high}"
        bounds = value_part.split("-")
        if len(bounds) == 2 and all(b.isdigit() for b in bounds) and int(bounds[0]) > int(bounds[1]):
            return f"the {name} range '{value_part}' runs backwards"
    return f"the {name} field '{text}' is not understood"


def _checked(expr: str) -> str:
    """validate_cron, returning the normalised form (fields joined by one space)."""
    if not isinstance(expr, str):
        raise ValueError(f"{expr!r} is not a valid cron expression: it must be text")
    return _checked_text(expr)


_SYMBOLS = {
    3: ("JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"),
    4: ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"),
}
_STEPPED_RANGE_RE = re.compile(r"([0-9A-Za-z]+)-([0-9A-Za-z]+)/([0-9]+)")


def _single_value_ranges(index: int, text: str) -> str:
    """Rewrite a stepped range of one value ('5-5/10') as the value ('5').

    cronsim 2.8 reads a stepped term whose range has a single value as "from that
    value to the end of the field": '5-5/10' becomes 5,15,...,55 and '1-1/1' in
    day-of-week becomes every day, where cron means just 5 and just Monday."""

    def value(token: str) -> int | None:
        if token.isdigit():
            return int(token)
        names = _SYMBOLS.get(index, ())
        offset = 1 if index == 3 else 0  # JAN is month 1, SUN is day 0
        return names.index(token.upper()) + offset if token.upper() in names else None

    terms = []
    for term in text.split(","):
        match = _STEPPED_RANGE_RE.fullmatch(term)
        if match and int(match.group(3)) > 0 and value(match.group(1)) is not None and value(match.group(1)) == value(match.group(2)):
            term = match.group(1)
        terms.append(term)
    return ",".join(terms)


def _parses_with_every_month(expr: str) -> bool:
    minute, hour, dom, _month, dow = expr.split()
    try:
        CronSim(f"{minute} {hour} {dom} * {dow}", _PROBE_START)
    except CronSimError:
        return False
    return True


@lru_cache(maxsize=1024)
def _checked_text(expr: str) -> str:
    # Cached: next_cron_time validates on every call, and the same few expressions
    # are asked about over and over. (lru_cache does not cache the ValueErrors.)
    fields = expr.split()
    prefix = f"{expr!r} is not a valid cron expression"
    if not fields:
        raise ValueError(f"{prefix}: it is empty; give 5 fields, minute hour day-of-month month day-of-week, like '0 2 * * *'")
    if fields[0].startswith("@"):
        raise ValueError(
            f"{prefix}: macros like @daily or @reboot are not supported; write the 5 fields instead, like '0 0 * * *' for every day at midnight"
        )
    if len(fields) != 5:
        extra = " (a seconds field is not supported)" if len(fields) == 6 else ""
        raise ValueError(
            f"{prefix}: it has {len(fields)} field{'s' if len(fields) != 1 else ''}{extra}; "
            "give 5: minute hour day-of-month month day-of-week"
        )
    normalised = " ".join(_single_value_ranges(index, text) for index, text in enumerate(fields))
    try:
        sim = CronSim(normalised, _PROBE_START)
    except CronSimError as exc:
        # cronsim says only "Bad <field>"; find the field and say what is wrong with it.
        message = str(exc)
        for name, index in _CRONSIM_FIELD_NAMES.items():
            if message == f"Bad {name}":
                if name == "day-of-month" and _parses_with_every_month(normalised):
                    # The field is fine on its own: cronsim checks up front for days
                    # that none of the expression's months has (30 February).
                    problem = "it can never run: none of its months has that day of the month"
                else:
                    problem = _field_problem(index, fields[index])
                raise ValueError(f"{prefix}: {problem}") from exc
        raise ValueError(f"{prefix}: {message}") from exc
    try:
        next(sim)
    except StopIteration:
        raise ValueError(f"{prefix}: it can never run (no matching time in 50 years)") from None
    return normalised


def validate_cron(expr: str) -> None:
    """A 5-field cron expression, or ValueError saying what is wrong in words.

    Accepted: what cronsim accepts in 5 fields (numbers, names like MON or JAN,
    '*', ranges, lists, '/' steps, and cronsim's L, LW and '#' day forms). Refused:
    a sixth (seconds) field, '@' macros (@daily, @reboot...: cronsim does not read
    them, and spelling out 5 fields is clearer), out-of-range values, and
    expressions that can never fire ('0 0 30 2 *')."""
    _checked(expr)


def _nominal_to_utc(expr: str, zone: ZoneInfo, after: datetime) -> Iterator[datetime]:
    """The run instants strictly after `after` (aware UTC), in order, without end.

    cronsim is asked about *naive* wall-clock times, so it does plain calendar
    arithmetic with no DST handling of its own: its own handling only applies when
    neither the minute nor the hour field starts with '*' (`*/15 2 * * *` loses the
    whole gap; `0 * * * *` runs the repeated 01:00 twice), and asked from inside the
    repeated hour it can return a time already past. Each nominal time is mapped by
    `_wall_to_utc` instead, and only strictly increasing instants after `after` are
    kept: several gap times map to one instant (one run), and nominal times in the
    repeated hour map to its first pass, which may be at or before `after`."""
    # Start from after's wall-clock time, whole seconds down. cronsim yields nominal
    # times strictly later than that; any earlier wall time maps to an instant at or
    # before `after` (the mapping is monotonic and fold=0 is the earliest reading).
    start = after.astimezone(zone).replace(tzinfo=None, fold=0, microsecond=0)
    last = after
    for nominal in CronSim(expr, start):
        instant = _wall_to_utc(nominal, zone)
        # Compare in UTC: two datetimes in the same zone compare by wall clock.
        if instant > last:
            last = instant
            yield instant


def next_cron_time(expr: str, zone: str, after: datetime) -> datetime:
    """The first time strictly after `after` that `expr` names in `zone`, in UTC.

    The DST rule: a wall-clock time that does not exist (spring-forward gap) runs at
    the first moment after the gap; a wall-clock time that happens twice
    (fall-back hour) runs once, at its first occurrence."""
    normalised = _checked(expr)
    tz = get_zone(zone)
    after_utc = _as_utc(after, "start")
    for instant in _nominal_to_utc(normalised, tz, after_utc):
        return instant
    raise ValueError(f"{expr!r} has no time after {after_utc.isoformat()}")


def cron_times(expr: str, zone: str, after: datetime, until: datetime) -> Iterator[datetime]:
    """Every time t with after < t < until, in order, UTC (the same rule as next_cron_time)."""
    # Validate now, not at the first next(): a generator would defer the ValueError.
    normalised = _checked(expr)
    tz = get_zone(zone)
    after_utc = _as_utc(after, "start")
    until_utc = _as_utc(until, "end")
    return _times_before(_nominal_to_utc(normalised, tz, after_utc), until_utc)


def _times_before(times: Iterator[datetime], until: datetime) -> Iterator[datetime]:
    for instant in times:
        if instant >= until:
            return
        yield instant


_DAY_NAMES = ("Sunday", "Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")
_DAY_ABBREVIATIONS = ("SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT")
_WEEKDAYS = {"1-5", "MON-FRI"}


def _day_of_week(text: str) -> int | None:
    """0-6 for a single day-of-week ('1', 'MON', '7' = Sunday), else None."""
    if text.isdigit() and int(text) <= 7:
        return int(text) % 7
    if text in _DAY_ABBREVIATIONS:
        return _DAY_ABBREVIATIONS.index(text)
    return None


def _small_int(text: str, low: int, high: int) -> int | None:
    if text.isdigit() and low <= int(text) <= high:
        return int(text)
    return None


def describe_cron(expr: str, zone: str) -> str:
    """Words for people: "every day at 02:00 Asia/Kolkata". Best effort; falls back
    to the expression itself ("cron '*/7 1-5 * * 1' in Europe/London").

    Display only, so it never raises: an invalid expression gets the fallback form.
    Shapes with words: every minute; every N minutes; every hour at :MM; every day
    at HH:MM; every weekday / every <day> at HH:MM; day N of every month at HH:MM."""
    fallback = f"cron '{expr}' in {zone}"
    try:
        minute, hour, dom, month, dow = _checked(expr).upper().split()
    except ValueError:
        return fallback
    m = _small_int(minute, 0, 59)
    h = _small_int(hour, 0, 23)
    if (dom, month, dow) == ("*", "*", "*"):
        if (minute, hour) == ("*", "*"):
            return f"every minute in {zone}"
        step = re.fullmatch(r"\*/([0-9]+)", minute)
        # Only steps that divide the hour are "every N minutes" (*/7 runs at :56 then :00).
        if step and hour == "*" and 0 < int(step.group(1)) < 60 and 60 % int(step.group(1)) == 0:
            n = int(step.group(1))
            return f"every minute in {zone}" if n == 1 else f"every {n} minutes in {zone}"
        if m is not None and hour == "*":
            return f"every hour at :{m:02d} in {zone}"
    if m is None or h is None or month != "*":
        return fallback
    at = f"at {h:02d}:{m:02d} {zone}"
    if dom == "*" and dow == "*":
        return f"every day {at}"
    if dom == "*" and dow in _WEEKDAYS:
        return f"every weekday {at}"
    day = _day_of_week(dow)
    if dom == "*" and day is not None:
        return f"every {_DAY_NAMES[day]} {at}"
    day_of_month = _small_int(dom, 1, 31)
    if dow == "*" and day_of_month is not None:
        return f"day {day_of_month} of every month {at}"
    return fallback


# --------------------------------------------------------------------------- timetables

EVERY_SHORTEST = timedelta(seconds=1)
EVERY_LONGEST = timedelta(days=366)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Timetable:
    """A recurring job's times, as pure data (runs.nextrun.job_next_run_time reads
    it; jobs.models.Job.timetable builds it).

    - `crons`: 5-field expressions in `zone`; the times are the union of theirs,
      each instant once (two expressions naming one instant give one time), each
      expression under the DST rule (_wall_to_utc).
    - or `every`: anchor + k * every in UTC, whole seconds, so a DST change cannot
      move them. k starts at 0 when the anchor is `starts_at` (`anchor_runs`), at 1
      when it is the job's creation (the first run is one interval later).
    - `starts_at` / `ends_at`: no time before / after them (both included).
    - `exclude`: dates in `zone`; a time on one of them is passed over (it is still
      one of `timetable_times`, for the caller to record as skipped).
    """

    zone: str = "UTC"
    crons: tuple[str, ...] = ()
    every: timedelta | None = None
    anchor: datetime | None = None
    anchor_runs: bool = True
    starts_at: datetime | None = None
    ends_at: datetime | None = None
    exclude: frozenset[date] = frozenset()

    def is_excluded(self, when: datetime) -> bool:
        return bool(self.exclude) and when.astimezone(get_zone(self.zone)).date() in self.exclude


def _seconds(value: datetime) -> int:
    """Whole seconds since the epoch, rounded down (exact: no float)."""
    return (_as_utc(value) - _EPOCH) // timedelta(seconds=1)


def _from_seconds(seconds: int) -> datetime:
    return _EPOCH + timedelta(seconds=seconds)


def _every_parts(tt: Timetable) -> tuple[int, int, int]:
    """(anchor seconds, step seconds, first k) of an `every` timetable."""
    assert tt.every is not None
    step = int(tt.every.total_seconds())
    if step < 1 or tt.every % timedelta(seconds=1):
        raise ValueError(f"every must be whole seconds, at least 1s, not {tt.every}")
    if tt.anchor is None:
        raise ValueError("an every timetable needs its anchor (starts_at or the job's creation)")
    return _seconds(tt.anchor), step, 0 if tt.anchor_runs else 1


def _every_first_k(tt: Timetable, after: datetime) -> int:
    """The first k whose time anchor + k * every is strictly after `after`.
    A whole-second time t is after `after` exactly when t > floor(after)."""
    anchor, step, first = _every_parts(tt)
    return max(first, (_seconds(after) - anchor) // step + 1)


def _every_times(tt: Timetable, after: datetime) -> Iterator[datetime]:
    anchor, step, _ = _every_parts(tt)
    k = _every_first_k(tt, after)
    while True:
        yield _from_seconds(anchor + k * step)
        k += 1


def timetable_times(tt: Timetable, after: datetime) -> Iterator[datetime]:
    """Every time of the timetable strictly after `after`, in order, UTC, each
    instant once, none before starts_at nor after ends_at. Excluded times are
    included (see next_time). Validates at once, not at the first next()."""
    after_utc = _as_utc(after, "start")
    if tt.starts_at is not None:
        # "Strictly after" one microsecond before starts_at: starts_at itself may run.
        after_utc = max(after_utc, _as_utc(tt.starts_at, "starts_at") - timedelta(microseconds=1))
    sources: list[Iterator[datetime]] = []
    if tt.every is not None:
        _every_parts(tt)
        sources.append(_every_times(tt, after_utc))
    if tt.crons:
        zone = get_zone(tt.zone)
        sources += [_nominal_to_utc(_checked(expr), zone, after_utc) for expr in tt.crons]
    if not sources:
        raise ValueError("the timetable has neither a cron schedule nor an every")
    ends_at = _as_utc(tt.ends_at, "ends_at") if tt.ends_at is not None else None
    return _union(heapq.merge(*sources), ends_at)


def _union(times: Iterator[datetime], ends_at: datetime | None) -> Iterator[datetime]:
    last = None
    for instant in times:
        if ends_at is not None and instant > ends_at:
            return
        if instant != last:
            last = instant
            yield instant


def _start_of_next_day(when: datetime, zone: ZoneInfo) -> datetime:
    """The UTC instant the local day after `when`'s begins (its 00:00, by the DST rule)."""
    day = when.astimezone(zone).date() + timedelta(days=1)
    return _wall_to_utc(datetime.combine(day, time(0)), zone)


@dataclass(frozen=True)
class NextTime:
    """The timetable's next time to run after an instant, and the excluded times it
    passed over on the way (each gets a `skipped` row, reason `excluded`)."""

    time: datetime | None  # None: no time left (past ends_at)
    excluded: list[datetime] = field(default_factory=list)  # the first `keep` passed over, oldest first
    excluded_count: int = 0  # how many were passed over in all


def next_time(tt: Timetable, after: datetime, *, keep: int = 100) -> NextTime:
    """The first time strictly after `after` not on an excluded date (or None past
    ends_at), with the excluded times before it: the first `keep` of them, and how
    many in all.

    Bounded: an `every` timetable steps over an excluded day in one jump (its times
    there are counted, not walked: an every-1s job excluded for a day is 86,400 of
    them); a cron expression has at most 1,440 times a day."""
    kept: list[datetime] = []
    count = 0
    times = timetable_times(tt, after)
    while True:
        candidate = next(times, None)
        if candidate is None or not tt.is_excluded(candidate):
            return NextTime(time=candidate, excluded=kept, excluded_count=count)
        if tt.every is not None and not tt.crons:
            anchor, step, _ = _every_parts(tt)
            day_end = _start_of_next_day(candidate, get_zone(tt.zone))
            last = _seconds(day_end - timedelta(microseconds=1))  # the last whole second of the day
            if tt.ends_at is not None:
                last = min(last, _seconds(tt.ends_at))
            first_k = (_seconds(candidate) - anchor) // step
            last_k = (last - anchor) // step
            count += last_k - first_k + 1
            kept += [_from_seconds(anchor + k * step) for k in range(first_k, min(last_k, first_k + keep - len(kept) - 1) + 1)]
            times = timetable_times(tt, _from_seconds(anchor + last_k * step))
            continue
        count += 1
        if len(kept) < keep:
            kept.append(candidate)


def describe_timetable(tt: Timetable) -> str:
    """Words for people, for any recurring timing (describe_cron for each expression)."""
    if tt.every is not None:
        words = f"every {format_duration(tt.every)} (UTC)"
        if tt.anchor_runs and tt.anchor is not None:
            words += f" from {tt.anchor.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"
    else:
        words = " and ".join(describe_cron(expr, tt.zone) for expr in tt.crons) or "-"
    if tt.ends_at is not None:
        words += f", until {tt.ends_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}Z"
    if tt.exclude:
        words += f", except on {len(tt.exclude)} date{'s' if len(tt.exclude) != 1 else ''}"
    return words


# --------------------------------------------------------------------------- spreading & retries


# Fibonacci hashing: 2**64 divided by the golden ratio (odd), and a second odd
# constant to move the sequence from one scheduled time to the next.
_GOLDEN = 0x9E3779B97F4A7C15
_SHIFT = 0xC2B2AE3D27D4EB4F
_2_64 = 1 << 64


def spread_due_at(job_id: int, scheduled_for: datetime, window: timedelta) -> datetime:
    """A deterministic start inside [scheduled_for, scheduled_for + window], to the
    millisecond, so a spike spreads evenly over the window and over each second of it.

    The offset is the job's place in a golden-ratio (Weyl) sequence, shifted by the
    scheduled time: job ids k, k+1, k+2... land as far apart as they can, so N jobs
    due at one time fill each second of the window with N / window of them, give or
    take one or two, where a hash would leave the busiest second about three standard
    deviations above the mean. Milliseconds, not whole seconds: within a second the
    starts are as even, so 1,000 jobs due at one time with a window are not handed
    on as one burst each second. Integer arithmetic: every scanner on every machine
    agrees on the same due_at, and another time of the same job gets another offset.
    (`scheduled_for`, the nominal time in the API and the Idempotency-Key, stays
    whole seconds; only due_at has the fraction.)"""
    if window < timedelta(0):
        raise ValueError(f"the window {window} is negative")
    start = round_up_to_second(scheduled_for)
    # scheduled_for is whole seconds in practice; if not, rounding up already used
    # part of the window, and the offset must not push past its end.
    room_ms = (_as_utc(scheduled_for) + window - start) // timedelta(milliseconds=1)
    if room_ms <= 0:
        return start
    place = (job_id * _GOLDEN + int(start.timestamp()) * _SHIFT) % _2_64
    offset_ms = (place * (room_ms + 1)) >> 64
    return start + timedelta(milliseconds=offset_ms)


_BACKOFFS = ("exponential", "linear", "fixed")
_rng = random.Random()


def retry_delay(
    *, attempt: int, backoff: str, base: timedelta, cap: timedelta, retry_after: timedelta | None = None,
    rng: random.Random | None = None,
) -> timedelta:
    """The wait before try `attempt + 1` after try `attempt` (1-based) failed.
    exponential: base * 2**(attempt-1); linear: base * attempt; fixed: base; never above cap;
    always with jitter. A Retry-After is honoured up to cap. Whole seconds, at least 1s.

    Jitter is "equal jitter": of the backoff d (whole seconds, already capped), half
    is fixed and the other half random, so the wait is uniform in [d - d//2, d]. It
    never waits less than half the backoff (so retries still back off) yet spreads
    clients that failed together. A Retry-After r is a floor: the wait is
    max(jittered backoff, min(r, cap)), so a server cannot make us wait past cap.
    The 1s floor wins over a cap below 1s."""
    if attempt < 1:
        raise ValueError(f"attempt must be 1 or more, not {attempt}")
    if backoff not in _BACKOFFS:
        raise ValueError(f"unknown backoff {backoff!r}: use exponential, linear or fixed")
    if base < timedelta(0) or cap < timedelta(0):
        raise ValueError("base and cap must not be negative")
    rng = rng if rng is not None else _rng
    base_s = base.total_seconds()
    cap_s = math.floor(cap.total_seconds())
    if backoff == "exponential":
        # Python ints do not overflow, but keep the exponent small: past 2**64 the
        # cap has long won, and float(base * 2**10000) would raise.
        raw = base_s * 2 ** min(attempt - 1, 64)
    elif backoff == "linear":
        raw = base_s * attempt
    else:
        raw = base_s
    delay = min(math.ceil(raw), cap_s)
    delay = delay - rng.randint(0, delay // 2)
    if retry_after is not None:
        delay = max(delay, min(math.ceil(max(retry_after.total_seconds(), 0)), cap_s))
    return timedelta(seconds=max(delay, 1))


# --------------------------------------------------------------------------- misfires


def misfire_deadline(*, scheduled_for: datetime, due_at: datetime, window: timedelta, grace: timedelta) -> datetime:
    """After this instant a run that was not queued has misfired:
    max(scheduled_for + window, due_at) + grace."""
    return max(_as_utc(scheduled_for) + window, _as_utc(due_at)) + grace


@dataclass(frozen=True)
class MissedTimes:
    """A recurring job's times after a late run's, as seen at one instant."""

    latest: list[datetime]  # the most recent missed times, at most `keep`, oldest first
    count: int  # how many were missed in all (`latest` may keep fewer)
    next_time: datetime | None  # the first time not missed: inside its window plus grace, or ahead (None: past ends_at)
    # Times among the latest `keep` that fall on excluded dates: not missed, they get
    # a `skipped` row with reason `excluded` (oldest first; not in `latest` or `count`).
    excluded: list[datetime] = field(default_factory=list)


def missed_times(
    *, expr: str = "", zone: str = "UTC", timetable: Timetable | None = None, late_time: datetime, now: datetime,
    window: timedelta, grace: timedelta, keep: int
) -> MissedTimes:
    """The times after `late_time` that are missed at `now`, and the first one that is not.

    A time t is missed by the same rule as a run (misfire_deadline): now is past
    max(t + window, due_at) + grace. A run at t has its due_at inside
    [t, t + window], so that is now > t + window + grace, i.e. t < now - window - grace.
    A later time, even one already past, is not missed while now is inside its
    window plus the grace: it is the job's next run, queued on time like any other.

    The times are the `timetable`'s (or the one cron `expr` in `zone`): an `every`
    job's are counted by arithmetic, not walked (an every-1s job down for a year is
    31 million of them). A time on an excluded date is not missed; it is returned in
    `excluded` when it is among the latest `keep` times.

    Only the latest `keep` missed times are returned (a job down for a year at one
    run a minute would otherwise mean 500k `skipped` rows); `next_time` goes on
    from the last of all of them, so the schedule resumes from now, not from
    the start of the outage."""
    tt = timetable if timetable is not None else Timetable(zone=zone, crons=(expr,))
    cutoff = _as_utc(now, "now") - window - grace
    if tt.every is not None and not tt.crons:
        return _missed_every(tt, late_time, cutoff, keep)
    recent: deque[datetime] = deque(maxlen=max(keep, 0))
    count = 0
    last = late_time
    for t in _times_before(timetable_times(tt, late_time), cutoff):
        recent.append(t)
        count += 0 if tt.is_excluded(t) else 1
        last = t
    return _split_missed(tt, list(recent), count, next_time(tt, last, keep=0).time)


def _split_missed(tt: Timetable, recent: list[datetime], count: int, nxt: datetime | None) -> MissedTimes:
    excluded = [t for t in recent if tt.is_excluded(t)]
    latest = [t for t in recent if not tt.is_excluded(t)]
    return MissedTimes(latest=latest, count=count, next_time=nxt, excluded=excluded)


def _missed_every(tt: Timetable, late_time: datetime, cutoff: datetime, keep: int) -> MissedTimes:
    anchor, step, _ = _every_parts(tt)
    low = _every_first_k(tt, late_time)
    # t < cutoff for a whole-second t is t < ceil(cutoff).
    below = -((-(cutoff - _EPOCH)) // timedelta(seconds=1))
    high = (below - 1 - anchor) // step
    if tt.ends_at is not None:
        high = min(high, (_seconds(tt.ends_at) - anchor) // step)
    if high < low:
        return MissedTimes(latest=[], count=0, next_time=next_time(tt, late_time, keep=0).time)
    count = high - low + 1 - sum(_ks_on_day(tt, day, low, high) for day in tt.exclude)
    recent = [_from_seconds(anchor + k * step) for k in range(max(low, high - max(keep, 0) + 1), high + 1)]
    return _split_missed(tt, recent, count, next_time(tt, _from_seconds(anchor + high * step), keep=0).time)


def _ks_on_day(tt: Timetable, day: date, low: int, high: int) -> int:
    """How many k in [low, high] have their time on local `day`."""
    anchor, step, _ = _every_parts(tt)
    zone = get_zone(tt.zone)
    start = _seconds(_wall_to_utc(datetime.combine(day, time(0)), zone))  # whole seconds (zone offsets are)
    end = _seconds(_wall_to_utc(datetime.combine(day + timedelta(days=1), time(0)), zone))
    first = max(low, -((anchor - start) // step))  # ceil((start - anchor) / step)
    last = min(high, (end - 1 - anchor) // step)
    return max(0, last - first + 1)


@dataclass(frozen=True)
class MisfireDecision:
    run_late: bool  # the late run runs now (run_once, run_all) or is skipped (skip)
    skipped_times: list[datetime] = field(default_factory=list)  # other missed times: a `skipped` row each
    next_time: datetime | None = None  # skip only: the time of the job's next run, made now


MISFIRE_POLICIES = ("run_once", "skip", "run_all")


def misfire_decision(*, policy: str, late_time: datetime, missed_after: list[datetime], next_time: datetime | None) -> MisfireDecision:
    """What to do with a late run at `late_time` (its scheduled_for):
    `missed_after` are the job's other missed times after it (oldest first; see
    missed_times: a time still inside its window plus grace is not one of them),
    `next_time` the first time after those that is not missed (None for a one-off).
    run_once: the late run runs, the missed others are skipped; the job's next run,
      made when the late run ends after its latest row, is then `next_time`.
    skip: the late run and the missed others are skipped; the next run is
      `next_time`, made now.
    run_all: the late run runs; the others are left for later (each runs in turn).
    No policy skips a time that is not missed."""
    if policy == "run_once":
        return MisfireDecision(run_late=True, skipped_times=list(missed_after))
    if policy == "skip":
        return MisfireDecision(run_late=False, skipped_times=list(missed_after), next_time=next_time)
    if policy == "run_all":
        return MisfireDecision(run_late=True)
    raise ValueError(f"unknown misfire policy {policy!r}: use run_once, skip or run_all")
