"""The clock (jobs.schedule): pure functions, so plain pytest and hypothesis, no database.

Expected instants in the tables are worked out by hand from the zone's offsets
(written next to each case: "02:30 EST = 07:30Z"), not copied from the code; the
offsets and transition dates were read from zoneinfo (2026):
- America/New_York: 2026-03-08 02:00 EST -> 03:00 EDT (at 07:00Z);
  2026-11-01 02:00 EDT -> 01:00 EST (at 06:00Z), so 01:00-01:59 happens twice.
- Europe/London: 2026-03-29 01:00 GMT -> 02:00 BST (at 01:00Z);
  2026-10-25 02:00 BST -> 01:00 GMT (at 01:00Z).
- Australia/Lord_Howe (a 30-minute shift): 2026-10-04 02:00 (+10:30) -> 02:30 (+11)
  (at 2026-10-03 15:30Z); 2026-04-05 02:00 (+11) -> 01:30 (+10:30) (at 2026-04-04 15:00Z).
- Asia/Kolkata: +05:30 all year.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from itertools import islice
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from jobs.schedule import (
    MisfireDecision,
    Timetable,
    cron_times,
    describe_cron,
    format_duration,
    get_zone,
    misfire_deadline,
    misfire_decision,
    missed_times,
    next_cron_time,
    next_time,
    parse_duration,
    resolve_at,
    retry_delay,
    round_up_to_second,
    spread_due_at,
    timetable_times,
    validate_cron,
)

UTC = timezone.utc


def z(text: str) -> datetime:
    """'2026-03-08T07:00' -> an aware UTC datetime (the tables read better this way)."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def times(expr: str, zone: str, after: str, until: str) -> list[datetime]:
    return list(cron_times(expr, zone, z(after), z(until)))


# ------------------------------------------------------------------ next times, fixed cases


def test_a_0200_kolkata_job_created_at_1000z_next_runs_at_2030z_the_same_day() -> None:
    # 02:00 IST on 10-29 is 02:00 - 05:30 = 20:30Z on 10-28, the first after 10:00Z.
    assert next_cron_time("0 2 * * *", "Asia/Kolkata", z("2026-10-28T10:00")) == z("2026-10-28T20:30")


def test_a_0900_kolkata_job_runs_at_0330z() -> None:
    assert times("0 9 * * *", "Asia/Kolkata", "2026-06-01T00:00", "2026-06-03T00:00") == [
        z("2026-06-01T03:30"),
        z("2026-06-02T03:30"),
    ]


def test_a_daily_0230_new_york_job_runs_at_0300_edt_on_the_spring_forward_night() -> None:
    # 03-07 02:30 EST = 07:30Z; 03-08 02:30 does not exist -> 03:00 EDT = 07:00Z;
    # 03-09 02:30 EDT = 06:30Z.
    after = z("2026-03-07T00:00")
    got = []
    for _ in range(3):
        after = next_cron_time("30 2 * * *", "America/New_York", after)
        got.append(after)
    assert got == [z("2026-03-07T07:30"), z("2026-03-08T07:00"), z("2026-03-09T06:30")]


def test_a_daily_0130_new_york_job_runs_once_on_the_fall_back_night_at_the_first_0130() -> None:
    # 10-31 01:30 EDT = 05:30Z; 11-01 01:30 EDT (first) = 05:30Z, the second 01:30 EST
    # (06:30Z) is not a run; 11-02 01:30 EST = 06:30Z.
    assert times("30 1 * * *", "America/New_York", "2026-10-31T00:00", "2026-11-03T00:00") == [
        z("2026-10-31T05:30"),
        z("2026-11-01T05:30"),
        z("2026-11-02T06:30"),
    ]


@pytest.mark.parametrize(
    "after",
    [
        "2026-11-01T05:45",  # 01:45 EDT, inside the first pass of the repeated hour
        "2026-11-01T06:15",  # 01:15 EST, inside the second pass: 01:30 is still ahead on the wall clock
        "2026-11-01T06:30",  # exactly the second 01:30
    ],
)
def test_asked_from_inside_the_repeated_hour_the_next_0130_is_the_next_day_never_a_past_or_second_0130(after: str) -> None:
    # The first 01:30 (05:30Z) has passed and the second (06:30Z) is not a run, so the
    # next is 11-02 01:30 EST = 06:30Z.
    assert next_cron_time("30 1 * * *", "America/New_York", z(after)) == z("2026-11-02T06:30")


def test_every_15_minutes_in_the_2am_hour_runs_once_at_0300_edt_on_the_spring_forward_day() -> None:
    # 03-07: 02:xx EST = 07:xxZ. 03-08: 02:00, 02:15, 02:30, 02:45 all fall in the gap
    # and all mean 03:00 EDT = 07:00Z: one instant, one run. 03-09: 02:xx EDT = 06:xxZ.
    got = times("*/15 2 * * *", "America/New_York", "2026-03-07T00:00", "2026-03-10T00:00")
    assert got == [
        z("2026-03-07T07:00"), z("2026-03-07T07:15"), z("2026-03-07T07:30"), z("2026-03-07T07:45"),
        z("2026-03-08T07:00"),
        z("2026-03-09T06:00"), z("2026-03-09T06:15"), z("2026-03-09T06:30"), z("2026-03-09T06:45"),
    ]  # fmt: skip


def test_every_15_minutes_in_the_2am_hour_is_normal_on_the_fall_back_day() -> None:
    # 02:00-02:59 happens once on 11-01 (the repeat is 01:xx): 10-31 02:xx EDT = 06:xxZ,
    # 11-01 02:xx EST = 07:xxZ, 11-02 02:xx EST = 07:xxZ.
    got = times("*/15 2 * * *", "America/New_York", "2026-10-31T00:00", "2026-11-03T00:00")
    assert got == [
        z("2026-10-31T06:00"), z("2026-10-31T06:15"), z("2026-10-31T06:30"), z("2026-10-31T06:45"),
        z("2026-11-01T07:00"), z("2026-11-01T07:15"), z("2026-11-01T07:30"), z("2026-11-01T07:45"),
        z("2026-11-02T07:00"), z("2026-11-02T07:15"), z("2026-11-02T07:30"), z("2026-11-02T07:45"),
    ]  # fmt: skip


def test_an_hourly_new_york_job_runs_the_repeated_0100_once_on_the_fall_back_night() -> None:
    # 00:00 EDT = 04:00Z, 01:00 EDT = 05:00Z, (01:00 EST = 06:00Z is the repeat: no run),
    # 02:00 EST = 07:00Z, 03:00 EST = 08:00Z.
    assert times("0 * * * *", "America/New_York", "2026-11-01T03:00", "2026-11-01T09:00") == [
        z("2026-11-01T04:00"),
        z("2026-11-01T05:00"),
        z("2026-11-01T07:00"),
        z("2026-11-01T08:00"),
    ]


def test_an_hourly_new_york_job_runs_the_missing_0200_at_0300_edt_once_on_the_spring_forward_night() -> None:
    # 01:00 EST = 06:00Z; 02:00 is in the gap -> 03:00 EDT = 07:00Z, which is also the
    # 03:00 run itself: one run, not two; 04:00 EDT = 08:00Z.
    assert times("0 * * * *", "America/New_York", "2026-03-08T05:00", "2026-03-08T09:00") == [
        z("2026-03-08T06:00"),
        z("2026-03-08T07:00"),
        z("2026-03-08T08:00"),
    ]


def test_an_every_minute_new_york_job_never_repeats_a_minute_across_the_fall_back_hour() -> None:
    got = times("* * * * *", "America/New_York", "2026-11-01T04:30", "2026-11-01T07:30")
    # 00:31 EDT .. 01:59 EDT (04:31Z-05:59Z), then nothing until 02:00 EST = 07:00Z.
    expected = [z("2026-11-01T04:31") + timedelta(minutes=i) for i in range(89)]
    expected += [z("2026-11-01T07:00") + timedelta(minutes=i) for i in range(30)]
    assert got == expected


@pytest.mark.parametrize(
    ("expr", "zone", "after", "until", "expected"),
    [
        pytest.param(
            # 03-28 01:30 GMT = 01:30Z; 03-29 01:30 is in the gap -> 02:00 BST = 01:00Z;
            # 03-30 01:30 BST = 00:30Z.
            "30 1 * * *", "Europe/London", "2026-03-28T00:00", "2026-03-31T00:00",
            ["2026-03-28T01:30", "2026-03-29T01:00", "2026-03-30T00:30"],
            id="london-spring-0130-in-the-gap",
        ),
        pytest.param(
            # 10-24 01:30 BST = 00:30Z; 10-25 01:30 BST (first) = 00:30Z, the 01:30 GMT
            # repeat (01:30Z) is not a run; 10-26 01:30 GMT = 01:30Z.
            "30 1 * * *", "Europe/London", "2026-10-24T00:00", "2026-10-27T00:00",
            ["2026-10-24T00:30", "2026-10-25T00:30", "2026-10-26T01:30"],
            id="london-autumn-0130-repeated",
        ),
        pytest.param(
            # 10-03 02:15 (+10:30) = 10-02 15:45Z; 10-04 02:15 is in the 02:00-02:30 gap
            # -> 02:30 (+11) = 10-03 15:30Z; 10-05 02:15 (+11) = 10-04 15:15Z.
            "15 2 * * *", "Australia/Lord_Howe", "2026-10-02T00:00", "2026-10-05T00:00",
            ["2026-10-02T15:45", "2026-10-03T15:30", "2026-10-04T15:15"],
            id="lord-howe-forward-30-minutes",
        ),
        pytest.param(
            # On 10-04 02:00, 02:10, 02:20 are in the gap (-> 02:30 +11 = 15:30Z, once),
            # then 02:30 (the same instant, no second run), 02:40, 02:50 (+11).
            "*/10 2 4 10 *", "Australia/Lord_Howe", "2026-10-03T00:00", "2026-10-04T00:00",
            ["2026-10-03T15:30", "2026-10-03T15:40", "2026-10-03T15:50"],
            id="lord-howe-gap-every-10-minutes",
        ),
        pytest.param(
            # 04-04 01:45 (+11) = 04-03 14:45Z; 04-05 01:45 first pass (+11) = 04-04 14:45Z,
            # the repeat (+10:30, 15:15Z) is not a run; 04-06 01:45 (+10:30) = 04-05 15:15Z.
            "45 1 * * *", "Australia/Lord_Howe", "2026-04-03T00:00", "2026-04-06T00:00",
            ["2026-04-03T14:45", "2026-04-04T14:45", "2026-04-05T15:15"],
            id="lord-howe-back-30-minutes",
        ),
        pytest.param(
            # No DST in Kolkata: 09:00 IST = 03:30Z every day.
            "0 9 * * *", "Asia/Kolkata", "2026-03-07T00:00", "2026-03-10T00:00",
            ["2026-03-07T03:30", "2026-03-08T03:30", "2026-03-09T03:30"],
            id="kolkata-no-dst",
        ),
        pytest.param(
            # UTC is UTC: 2026-01-02 is a Friday, so the next weekday 09:00 is Monday 01-05.
            "0 9 * * 1-5", "UTC", "2026-01-02T09:00", "2026-01-07T00:00",
            ["2026-01-05T09:00", "2026-01-06T09:00"],
            id="utc-weekdays",
        ),
    ],
)
def test_cron_times_across_dst_in_other_zones_follows_the_rule(
    expr: str, zone: str, after: str, until: str, expected: list[str]
) -> None:
    assert times(expr, zone, after, until) == [z(t) for t in expected]


def test_cron_times_excludes_both_ends_of_the_interval() -> None:
    # Hourly in UTC between 10:00 and 13:00: 11:00 and 12:00 only.
    assert times("0 * * * *", "UTC", "2026-05-01T10:00", "2026-05-01T13:00") == [
        z("2026-05-01T11:00"),
        z("2026-05-01T12:00"),
    ]


def test_next_cron_time_is_strictly_after_even_a_fraction_of_a_second_past_a_time() -> None:
    after = z("2026-05-01T10:00") + timedelta(microseconds=1)
    assert next_cron_time("0 * * * *", "UTC", after) == z("2026-05-01T11:00")
    assert next_cron_time("0 * * * *", "UTC", z("2026-05-01T10:00") - timedelta(microseconds=1)) == z("2026-05-01T10:00")


def test_next_cron_time_accepts_any_aware_after_and_answers_in_utc() -> None:
    after = datetime(2026, 10, 28, 15, 30, tzinfo=ZoneInfo("Asia/Kolkata"))  # = 10:00Z
    got = next_cron_time("0 2 * * *", "Asia/Kolkata", after)
    assert got == z("2026-10-28T20:30")
    assert got.utcoffset() == timedelta(0)


def test_next_cron_time_refuses_a_naive_after_an_unknown_zone_and_a_bad_expression() -> None:
    with pytest.raises(ValueError, match="time zone"):
        next_cron_time("0 2 * * *", "UTC", datetime(2026, 1, 1))
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        next_cron_time("0 2 * * *", "Mars/Olympus", z("2026-01-01T00:00"))
    with pytest.raises(ValueError, match="not a valid cron expression"):
        next_cron_time("0 2 * *", "UTC", z("2026-01-01T00:00"))


def test_cron_times_refuses_a_bad_expression_when_called_not_when_first_iterated() -> None:
    with pytest.raises(ValueError, match="not a valid cron expression"):
        cron_times("99 * * * *", "UTC", z("2026-01-01T00:00"), z("2026-01-02T00:00"))


# ------------------------------------------------------------------ zones, instants


def test_get_zone_returns_the_iana_zone_and_refuses_unknown_names() -> None:
    assert get_zone("Asia/Kolkata") == ZoneInfo("Asia/Kolkata")
    for bad in ["Mars/Olympus", "", "../etc/passwd", "America"]:
        with pytest.raises(ValueError, match="unknown time zone"):
            get_zone(bad)


@pytest.mark.parametrize(
    ("value", "zone", "expected"),
    [
        pytest.param("2026-10-28T20:30:00Z", "Asia/Kolkata", "2026-10-28T20:30:00", id="z-suffix-ignores-zone"),
        pytest.param("2026-10-29T02:00:00+05:30", "UTC", "2026-10-28T20:30:00", id="offset"),
        pytest.param("2026-10-29T02:00:00", "Asia/Kolkata", "2026-10-28T20:30:00", id="naive-is-wall-clock-in-zone"),
        pytest.param("2026-10-29 02:00", "Asia/Kolkata", "2026-10-28T20:30:00", id="space-and-no-seconds"),
        # 02:30 does not exist on 03-08 in New York: the first moment after is 03:00 EDT = 07:00Z.
        pytest.param("2026-03-08T02:30:00", "America/New_York", "2026-03-08T07:00:00", id="naive-in-the-gap"),
        # 01:30 happens twice on 11-01: the first is 01:30 EDT = 05:30Z.
        pytest.param("2026-11-01T01:30:00", "America/New_York", "2026-11-01T05:30:00", id="naive-in-the-repeat"),
        pytest.param("2026-10-28T20:30:00.2Z", "UTC", "2026-10-28T20:30:01", id="fraction-rounds-up"),
        pytest.param("2026-10-28T20:30:59.999999+00:00", "UTC", "2026-10-28T20:31:00", id="fraction-rounds-up-a-minute"),
        pytest.param("2026-10-28T20:30:00.000Z", "UTC", "2026-10-28T20:30:00", id="zero-fraction-stays"),
        # 01:59:59.5 EST is half a second before the jump; rounded up it is 03:00 EDT = 07:00Z.
        pytest.param("2026-03-08T01:59:59.5", "America/New_York", "2026-03-08T07:00:00", id="fraction-into-the-gap"),
    ],
)
def test_resolve_at_reads_iso_8601_into_whole_utc_seconds(value: str, zone: str, expected: str) -> None:
    got = resolve_at(value, zone)
    assert got == z(expected)
    assert got.microsecond == 0
    assert got.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    "value",
    ["", "tomorrow", "2026-13-01T00:00:00", "2026-02-30T10:00:00", "2026-10-28T25:00", "2026-10-28T10:00:00+25:00", "   "],
)
def test_resolve_at_refuses_a_malformed_time_with_a_readable_message(value: str) -> None:
    with pytest.raises(ValueError, match="is not a time: use ISO 8601"):
        resolve_at(value, "UTC")


def test_resolve_at_refuses_a_time_out_of_the_calendar_range() -> None:
    # Rounding 23:59:59.5 up would need year 10000.
    with pytest.raises(ValueError, match="out of the range"):
        resolve_at("9999-12-31T23:59:59.5Z", "UTC")


def test_resolve_at_refuses_an_unknown_zone() -> None:
    with pytest.raises(ValueError, match="unknown time zone"):
        resolve_at("2026-10-28T10:00:00", "Nowhere/Land")


def test_round_up_to_second_rounds_fractions_up_and_answers_in_utc() -> None:
    kolkata = ZoneInfo("Asia/Kolkata")
    assert round_up_to_second(datetime(2026, 10, 29, 2, 0, 0, 200000, tzinfo=kolkata)) == z("2026-10-28T20:30:01")
    assert round_up_to_second(z("2026-10-28T20:30:00")) == z("2026-10-28T20:30:00")
    with pytest.raises(ValueError):
        round_up_to_second(datetime(2026, 1, 1))


# ------------------------------------------------------------------ durations


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("5m", 300), ("2h", 7200), ("1d", 86400), ("0s", 0), ("365d", 365 * 86400), ("05m", 300)],
)
def test_parse_duration_reads_a_whole_number_and_a_unit(text: str, seconds: int) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("-5m", "'-5m' is not a duration: use a whole number followed by s, m, h or d, like '90s' or '5m'"),
        ("", "a duration is needed"),
        ("5", "'5' is not a duration"),  # missing unit
        ("5.5m", "'5.5m' is not a duration"),  # a fraction
        ("5w", "'5w' is not a duration"),  # unknown unit
        ("5M", "'5M' is not a duration"),  # units are lower case (M could be months)
        ("m", "'m' is not a duration"),
        ("5 m", "'5 m' is not a duration"),
        ("1h30m", "'1h30m' is not a duration"),
        ("٥m", "is not a duration"),  # a non-ASCII digit
        ("366d", "'366d' is too long: a duration can be at most 365d"),
        ("8761h", "'8761h' is too long"),
        ("9" * 5000 + "s", "is too long"),
    ],
)
def test_parse_duration_says_in_words_what_is_wrong(text: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_duration(text)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (90, "90s"), (300, "5m"), (3600, "1h"), (5400, "90m"), (86400, "1d"), (90000, "25h"), (86401, "86401s")],
)
def test_format_duration_uses_the_largest_whole_unit(seconds: int, text: str) -> None:
    assert format_duration(timedelta(seconds=seconds)) == text


def test_format_duration_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError):
        format_duration(timedelta(seconds=-1))
    with pytest.raises(ValueError):
        format_duration(timedelta(milliseconds=1500))


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=365 * 86400))
def test_format_duration_and_parse_duration_round_trip(seconds: int) -> None:
    value = timedelta(seconds=seconds)
    text = format_duration(value)
    assert parse_duration(text) == value
    # ...and with the largest unit: the number does not divide by the next unit up.
    number, unit = int(text[:-1]), text[-1]
    bigger = {"s": 60, "m": 60, "h": 24, "d": None}[unit]
    assert bigger is None or number == 0 or number % bigger != 0


# ------------------------------------------------------------------ validate_cron, describe_cron


@pytest.mark.parametrize(
    "expr",
    ["* * * * *", "0 2 * * *", "*/15 9-17 * * 1-5", "0 0 1,15 * *", "0 12 * JAN,JUL MON", "0 0 L * *", "0 0 * * 5#5", "0 0 29 2 *", "  0   2 * * *  "],
)
def test_validate_cron_accepts_five_field_expressions(expr: str) -> None:
    validate_cron(expr)


@pytest.mark.parametrize(
    ("expr", "words"),
    [
        ("61 * * * *", "minute 61 is out of range 0-59"),
        ("0 24 * * *", "hour 24 is out of range 0-23"),
        ("0 0 0 * *", "day-of-month 0 is out of range 1-31"),
        ("0 0 * 13 *", "month 13 is out of range 1-12"),
        ("0 0 * * 8", "day-of-week 8 is out of range 0-7"),
        ("*/0 * * * *", "step"),
        ("5-1 * * * *", "runs backwards"),
        ("0 0 * * * *", "6 fields (a seconds field is not supported)"),
        ("0 0 * *", "4 fields"),
        ("@reboot", "macros"),
        ("@daily", "macros"),
        ("garbage * * * *", "the minute field 'garbage' is not understood"),
        ("every day", "2 fields"),
        ("", "it is empty"),
        ("0 0 30 2 *", "can never run"),
        ("0 0 31 4,6,9,11 *", "can never run"),
        ("0 0 1-L * *", "the day-of-month field '1-L' is not understood"),
    ],
)
def test_validate_cron_refuses_with_the_expression_and_what_is_wrong(expr: str, words: str) -> None:
    with pytest.raises(ValueError) as caught:
        validate_cron(expr)
    message = str(caught.value)
    assert repr(expr) in message
    assert "is not a valid cron expression" in message
    assert words in message


@pytest.mark.parametrize(
    ("expr", "zone", "words"),
    [
        ("* * * * *", "UTC", "every minute in UTC"),
        ("*/15 * * * *", "Europe/London", "every 15 minutes in Europe/London"),
        ("5 * * * *", "Asia/Kolkata", "every hour at :05 in Asia/Kolkata"),
        ("0 2 * * *", "Asia/Kolkata", "every day at 02:00 Asia/Kolkata"),
        ("30 9 * * 1-5", "America/New_York", "every weekday at 09:30 America/New_York"),
        ("0 9 * * MON", "UTC", "every Monday at 09:00 UTC"),
        ("0 9 * * 7", "UTC", "every Sunday at 09:00 UTC"),
        ("0 6 1 * *", "UTC", "day 1 of every month at 06:00 UTC"),
        ("*/7 1-5 * * 1", "Europe/London", "cron '*/7 1-5 * * 1' in Europe/London"),
        ("*/7 * * * *", "UTC", "cron '*/7 * * * *' in UTC"),  # */7 is not "every 7 minutes" across :56 -> :00
        ("not cron", "UTC", "cron 'not cron' in UTC"),
    ],
)
def test_describe_cron_says_common_shapes_in_words_and_always_names_the_zone(expr: str, zone: str, words: str) -> None:
    assert describe_cron(expr, zone) == words


# ------------------------------------------------------------------ spread_due_at


def test_spread_due_at_with_no_window_is_the_scheduled_time() -> None:
    assert spread_due_at(42, z("2026-10-28T20:30"), timedelta(0)) == z("2026-10-28T20:30")


@pytest.mark.parametrize("job_id", [1, 2, 42, 10**9])
def test_spread_due_at_is_deterministic_whole_milliseconds_and_inside_the_window(job_id: int) -> None:
    scheduled = z("2026-10-28T20:30")
    window = timedelta(minutes=5)
    got = spread_due_at(job_id, scheduled, window)
    assert got == spread_due_at(job_id, scheduled, window)
    assert scheduled <= got <= scheduled + window
    assert got.microsecond % 1000 == 0


def test_spread_due_at_gives_different_times_of_one_job_different_offsets() -> None:
    scheduled = z("2026-10-28T00:00")
    offsets = {spread_due_at(7, scheduled + timedelta(days=d), timedelta(minutes=5)) - scheduled - timedelta(days=d) for d in range(50)}
    assert len(offsets) > 45  # 50 draws from 300,001 values: a constant offset would be 1


def test_spread_due_at_spreads_ten_thousand_jobs_evenly_over_the_window() -> None:
    # 10,000 jobs over offsets 0..300: 10-second buckets 0-9, ..., 280-289, and the last
    # one 290-300 (11 seconds). Each bucket expects 10,000 * width / 301 (~332); its
    # standard deviation is ~18 (~5.5%), so over 30 buckets the largest deviation is
    # about 2.5-3 sigma (~15%). A 30% bound is 5+ sigma: it fails only for a real bias.
    scheduled = z("2026-10-28T20:30")
    counts: Counter[int] = Counter()
    for job_id in range(1, 10_001):
        offset = int((spread_due_at(job_id, scheduled, timedelta(seconds=300)) - scheduled).total_seconds())
        assert 0 <= offset <= 300
        counts[min(offset // 10, 29)] += 1
    # Offsets are milliseconds 0..300,000: the last bucket holds one millisecond more.
    ratios = [counts[b] / (10_000 * (10_001 if b == 29 else 10_000) / 300_001) for b in range(30)]
    assert max(ratios) <= 1.3
    assert min(ratios) >= 0.7


def test_spread_due_at_fills_every_second_of_the_window_alike_for_a_spike() -> None:
    # The spike bench's case: 100,000 jobs (consecutive ids) due at one instant with a
    # 5 minute window. Each of the 300 seconds gets 100,000 * 1000 / 300,001 (~333)
    # starts (the window's end, 09:05:00.000, is one millisecond of its own); a hash
    # would put the busiest second near 1.16 times that.
    scheduled = z("2026-10-28T09:00")
    offsets = [spread_due_at(job_id, scheduled, timedelta(seconds=300)) - scheduled for job_id in range(5_000, 105_000)]
    assert all(o.microseconds % 1000 == 0 and timedelta(0) <= o <= timedelta(seconds=300) for o in offsets)
    counts = Counter(int(o.total_seconds()) for o in offsets)
    last = counts.pop(300, 0)
    assert sorted(counts) == list(range(300)) and last <= 2
    mean = 100_000 * 1000 / 300_001
    assert max(counts.values()) <= mean * 1.02 and min(counts.values()) >= mean * 0.98


def test_spread_due_at_fills_each_millisecond_band_of_a_second_alike() -> None:
    # 1,000 jobs due at one time with a one-minute window (the sustained bench's
    # shape): within each second the starts are spread, not one burst at the second's
    # start. Over the 60,001 milliseconds, 1,000 starts fall in ten 100 ms bands of
    # the second alike (the Weyl sequence, not chance: a band's expected 100 is met to
    # within a few).
    scheduled = z("2026-10-28T09:00")
    bands = Counter(
        (spread_due_at(job_id, scheduled, timedelta(seconds=60)) - scheduled).microseconds // 100_000
        for job_id in range(1, 1_001)
    )
    assert sorted(bands) == list(range(10))
    assert max(bands.values()) <= 110 and min(bands.values()) >= 90


# ------------------------------------------------------------------ retry_delay


def _bounds(d: int) -> tuple[int, int]:
    """Equal jitter over a backoff of d whole seconds: half fixed, half random."""
    return d - d // 2, d


@pytest.mark.parametrize(
    ("backoff", "attempt", "backoff_seconds"),
    [
        ("exponential", 1, 10), ("exponential", 2, 20), ("exponential", 3, 40), ("exponential", 9, 2560),
        ("exponential", 10, 3600), ("exponential", 1000, 3600),  # capped at 1h
        ("linear", 1, 10), ("linear", 2, 20), ("linear", 7, 70), ("linear", 400, 3600),
        ("fixed", 1, 10), ("fixed", 50, 10),
    ],
)  # fmt: skip
def test_retry_delay_backs_off_with_equal_jitter_under_the_cap(backoff: str, attempt: int, backoff_seconds: int) -> None:
    low, high = _bounds(backoff_seconds)
    seen = set()
    for seed in range(40):
        got = retry_delay(attempt=attempt, backoff=backoff, base=timedelta(seconds=10), cap=timedelta(hours=1), rng=random.Random(seed))
        assert got.microseconds == 0
        assert timedelta(seconds=low) <= got <= timedelta(seconds=high)
        seen.add(got)
    assert len(seen) > 1  # jitter: 40 seeds over 6+ possible values are not all equal


def test_retry_delay_is_reproducible_with_a_seed_and_differs_between_seeds() -> None:
    def delay(seed: int) -> timedelta:
        return retry_delay(attempt=5, backoff="exponential", base=timedelta(seconds=10), cap=timedelta(hours=1), rng=random.Random(seed))

    assert delay(1) == delay(1)
    assert delay(1) != delay(2)
    # 160s backoff: both in [80s, 160s].
    for seed in (1, 2):
        assert timedelta(seconds=80) <= delay(seed) <= timedelta(seconds=160)


def test_retry_delay_equal_jitter_averages_three_quarters_of_the_backoff() -> None:
    # Uniform over [d/2, d] has mean 3d/4: 300 for d = 400, and a standard error of
    # ~58/sqrt(4000) < 1s, so +-5s is generous and still catches "no jitter" (400)
    # and "full jitter" (200).
    rng = random.Random(7)
    samples = [
        retry_delay(attempt=1, backoff="fixed", base=timedelta(seconds=400), cap=timedelta(hours=1), rng=rng).total_seconds()
        for _ in range(4000)
    ]
    assert abs(sum(samples) / len(samples) - 300) < 5
    assert min(samples) >= 200 and max(samples) <= 400


def test_retry_delay_honours_retry_after_up_to_the_cap() -> None:
    base, cap = timedelta(seconds=10), timedelta(minutes=10)
    rng = random.Random(3)
    # Retry-After longer than the backoff (5-10s) wins.
    assert retry_delay(attempt=1, backoff="exponential", base=base, cap=cap, retry_after=timedelta(seconds=120), rng=rng) == timedelta(seconds=120)
    # Longer than the cap: the cap.
    assert retry_delay(attempt=1, backoff="exponential", base=base, cap=cap, retry_after=timedelta(hours=2), rng=rng) == cap
    # Shorter than the backoff: the backoff (attempt 6 -> 320s, so 160-320s).
    got = retry_delay(attempt=6, backoff="exponential", base=base, cap=cap, retry_after=timedelta(seconds=3), rng=rng)
    assert timedelta(seconds=160) <= got <= timedelta(seconds=320)
    # A fractional Retry-After is whole seconds, rounded up.
    assert retry_delay(attempt=1, backoff="fixed", base=timedelta(0), cap=cap, retry_after=timedelta(seconds=30.2), rng=rng) == timedelta(seconds=31)


def test_retry_delay_is_at_least_one_second() -> None:
    for backoff in ("exponential", "linear", "fixed"):
        assert retry_delay(attempt=1, backoff=backoff, base=timedelta(0), cap=timedelta(hours=1), rng=random.Random(0)) == timedelta(seconds=1)
        assert retry_delay(attempt=3, backoff=backoff, base=timedelta(seconds=1), cap=timedelta(0), rng=random.Random(0)) == timedelta(seconds=1)


def test_retry_delay_works_without_an_rng() -> None:
    got = retry_delay(attempt=2, backoff="linear", base=timedelta(seconds=10), cap=timedelta(hours=1))
    assert timedelta(seconds=10) <= got <= timedelta(seconds=20)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempt": 0, "backoff": "fixed"},
        {"attempt": 1, "backoff": "fibonacci"},
        {"attempt": 1, "backoff": "fixed", "base": timedelta(seconds=-1)},
    ],
)
def test_retry_delay_refuses_nonsense(kwargs: dict) -> None:
    args = {"base": timedelta(seconds=10), "cap": timedelta(hours=1)} | kwargs
    with pytest.raises(ValueError):
        retry_delay(**args)


# ------------------------------------------------------------------ misfires


def test_misfire_deadline_is_the_later_of_window_end_and_due_at_plus_grace() -> None:
    scheduled = z("2026-10-28T10:00")
    grace = timedelta(seconds=60)
    # Window end (10:05) is later than due_at (10:02): 10:05 + 60s.
    assert misfire_deadline(scheduled_for=scheduled, due_at=z("2026-10-28T10:02"), window=timedelta(minutes=5), grace=grace) == z("2026-10-28T10:06")
    # A retry pushed due_at to 10:30: that counts, not the window.
    assert misfire_deadline(scheduled_for=scheduled, due_at=z("2026-10-28T10:30"), window=timedelta(minutes=5), grace=grace) == z("2026-10-28T10:31")
    assert misfire_deadline(scheduled_for=scheduled, due_at=scheduled, window=timedelta(0), grace=timedelta(0)) == scheduled


LATE = z("2026-10-28T10:00")
MISSED = [z("2026-10-28T11:00"), z("2026-10-28T12:00")]
NEXT = z("2026-10-28T14:00")


def test_run_once_runs_the_late_run_and_skips_the_other_missed_times() -> None:
    decision = misfire_decision(policy="run_once", late_time=LATE, missed_after=MISSED, next_time=NEXT)
    assert decision == MisfireDecision(run_late=True, skipped_times=MISSED, next_time=None)


def test_skip_skips_the_late_run_and_the_others_and_goes_on_at_the_next_future_time() -> None:
    decision = misfire_decision(policy="skip", late_time=LATE, missed_after=MISSED, next_time=NEXT)
    assert decision == MisfireDecision(run_late=False, skipped_times=MISSED, next_time=NEXT)


def test_run_all_runs_the_late_run_and_leaves_the_others_to_run_in_turn() -> None:
    decision = misfire_decision(policy="run_all", late_time=LATE, missed_after=MISSED, next_time=NEXT)
    assert decision == MisfireDecision(run_late=True, skipped_times=[], next_time=None)


@pytest.mark.parametrize(("policy", "runs"), [("run_once", True), ("skip", False), ("run_all", True)])
def test_a_late_one_off_has_nothing_else_to_skip_and_no_next_time(policy: str, runs: bool) -> None:
    decision = misfire_decision(policy=policy, late_time=LATE, missed_after=[], next_time=None)
    assert decision == MisfireDecision(run_late=runs, skipped_times=[], next_time=None)


def test_misfire_decision_does_not_share_the_callers_list() -> None:
    missed = list(MISSED)
    decision = misfire_decision(policy="run_once", late_time=LATE, missed_after=missed, next_time=NEXT)
    missed.clear()
    assert decision.skipped_times == MISSED


def test_an_unknown_misfire_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown misfire policy 'later'"):
        misfire_decision(policy="later", late_time=LATE, missed_after=[], next_time=None)


def _missed(now: str, *, window: int = 0, grace: int = 60, keep: int = 1000, expr: str = "* * * * *") -> Any:
    return missed_times(expr=expr, zone="UTC", late_time=z("2026-10-28T20:30"), now=datetime.fromisoformat(now).replace(tzinfo=UTC),
                        window=timedelta(seconds=window), grace=timedelta(seconds=grace), keep=keep)


def test_a_time_still_inside_its_grace_is_not_missed_and_is_the_next_time() -> None:
    # Back at 20:32:30 with 60 s grace: 20:31 is past 20:31 + 60 s, 20:32 is only 30 s old.
    got = _missed("2026-10-28T20:32:30")
    assert (got.latest, got.count, got.next_time) == ([z("2026-10-28T20:31")], 1, z("2026-10-28T20:32"))


def test_a_time_is_missed_only_once_its_window_and_grace_have_both_passed() -> None:
    # Window 120 s: 20:31 is missed after 20:34:00, not at 20:34:00 itself.
    assert _missed("2026-10-28T20:34:00", window=120).next_time == z("2026-10-28T20:31")
    assert _missed("2026-10-28T20:34:01", window=120).latest == [z("2026-10-28T20:31")]


def test_with_no_time_missed_the_next_time_is_the_first_after_the_late_one() -> None:
    got = _missed("2026-10-28T20:30:45", expr="0 * * * *")
    assert (got.latest, got.count, got.next_time) == ([], 0, z("2026-10-28T21:00"))


def test_a_long_outage_keeps_the_latest_missed_times_and_goes_on_after_the_last_of_all() -> None:
    got = _missed("2026-10-28T22:30:30", keep=3)
    assert got.count == 119  # 20:31 .. 22:29; 22:30 is still inside its grace
    assert got.latest == [z("2026-10-28T22:27"), z("2026-10-28T22:28"), z("2026-10-28T22:29")]
    assert got.next_time == z("2026-10-28T22:30")
    assert _missed("2026-10-28T22:30:30", keep=0).next_time == z("2026-10-28T22:30")


def test_a_stored_schedule_that_no_longer_parses_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a valid cron expression"):
        _missed("2026-10-28T20:32:30", expr="61 * * * *")


# ------------------------------------------------------------------ properties
#
# The reference model below is independent of jobs.schedule and of cronsim: each
# field is drawn together with the set of values it allows, and a UTC minute u is a
# run instant exactly when, reading it on the zone's wall clock (zoneinfo):
# - it is not the second pass of a repeated hour (fold=1), and its wall time matches
#   the fields; or
# - it is the first moment after a spring-forward gap, and some wall minute inside
#   the gap matches the fields.

ZONES = [
    "UTC",
    "America/New_York",
    "Europe/London",
    "Australia/Lord_Howe",
    "Asia/Kolkata",
    "America/Sao_Paulo",
    "Pacific/Chatham",
]


@dataclass(frozen=True)
class Cron:
    text: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday (7 is folded into 0)
    days_and: bool  # Vixie cron: day-of-month AND day-of-week only if either starts with '*'

    def matches(self, wall: datetime) -> bool:
        if wall.minute not in self.minutes or wall.hour not in self.hours or wall.month not in self.months:
            return False
        dom = wall.day in self.days
        dow = (wall.weekday() + 1) % 7 in self.weekdays
        return (dom and dow) if self.days_and else (dom or dow)


@st.composite
def cron_field(draw: st.DrawFn, low: int, high: int) -> tuple[str, frozenset[int]]:
    def single() -> st.SearchStrategy[tuple[str, frozenset[int]]]:
        return st.integers(low, high).map(lambda v: (str(v), frozenset({v})))

    @st.composite
    def span(draw: st.DrawFn) -> tuple[str, frozenset[int]]:
        a = draw(st.integers(low, high))
        b = draw(st.integers(a, high))
        step = draw(st.one_of(st.none(), st.integers(1, max(1, high - low))))
        if step is None:
            return f"{a}-{b}", frozenset(range(a, b + 1))
        return f"{a}-{b}/{step}", frozenset(range(a, b + 1, step))

    star = st.just(("*", frozenset(range(low, high + 1))))
    every = st.integers(1, max(1, (high - low) // 2)).map(lambda n: (f"*/{n}", frozenset(range(low, high + 1, n))))

    @st.composite
    def listing(draw: st.DrawFn) -> tuple[str, frozenset[int]]:
        parts = draw(st.lists(st.one_of(single(), span()), min_size=2, max_size=4))
        return ",".join(p[0] for p in parts), frozenset().union(*(p[1] for p in parts))

    return draw(st.one_of(star, every, single(), span(), listing()))


@st.composite
def crons(draw: st.DrawFn) -> Cron:
    minute = draw(cron_field(0, 59))
    hour = draw(cron_field(0, 23))
    dom = draw(cron_field(1, 31))
    month = draw(cron_field(1, 12))
    dow = draw(cron_field(0, 7))
    return Cron(
        text=" ".join(f[0] for f in (minute, hour, dom, month, dow)),
        minutes=minute[1],
        hours=hour[1],
        days=dom[1],
        months=month[1],
        weekdays=frozenset(d % 7 for d in dow[1]),
        days_and=dom[0].startswith("*") or dow[0].startswith("*"),
    )


def _transitions() -> list[datetime]:
    """Every UTC-offset change of the zones above in 2025-2027, to the hour (good enough
    to aim `after` near one)."""
    found = []
    for name in ZONES:
        tz = ZoneInfo(name)
        t = datetime(2025, 1, 1, tzinfo=UTC)
        previous = t.astimezone(tz).utcoffset()
        while t < datetime(2028, 1, 1, tzinfo=UTC):
            t += timedelta(hours=1)
            offset = t.astimezone(tz).utcoffset()
            if offset != previous:
                found.append(t)
                previous = offset
    return found


TRANSITIONS = _transitions()

instants = st.one_of(
    st.datetimes(min_value=datetime(2025, 1, 1), max_value=datetime(2027, 12, 31)).map(lambda d: d.replace(tzinfo=UTC)),
    # Near a DST change, where the rule matters: up to two days before, one after.
    st.builds(
        lambda t, s: t + timedelta(seconds=s),
        st.sampled_from(TRANSITIONS),
        st.integers(-2 * 86400, 86400),
    ),
)


def is_run_instant(cron: Cron, tz: ZoneInfo, u: datetime) -> bool:
    local = u.astimezone(tz)  # zoneinfo sets fold=1 on the second pass of a repeated hour
    if local.fold == 0 and cron.matches(local.replace(tzinfo=None)):
        return True
    jump = local.utcoffset() - (u - timedelta(seconds=1)).astimezone(tz).utcoffset()
    if jump > timedelta(0):  # u is the first moment after a gap of `jump`
        end = local.replace(tzinfo=None)
        wall = end - jump
        while wall < end:
            if cron.matches(wall):
                return True
            wall += timedelta(minutes=1)
    return False


def test_the_reference_model_agrees_with_the_hand_worked_cases() -> None:
    # The model itself, on cases checked by hand above, so the property below stands on it.
    ny = ZoneInfo("America/New_York")
    every_15_at_2 = Cron("*/15 2 * * *", frozenset({0, 15, 30, 45}), frozenset({2}), frozenset(range(1, 32)),
                         frozenset(range(1, 13)), frozenset(range(7)), True)  # fmt: skip
    assert is_run_instant(every_15_at_2, ny, z("2026-03-08T07:00"))  # the gap
    assert not is_run_instant(every_15_at_2, ny, z("2026-03-08T07:15"))  # 03:15 EDT
    hourly = Cron("0 * * * *", frozenset({0}), frozenset(range(24)), frozenset(range(1, 32)),
                  frozenset(range(1, 13)), frozenset(range(7)), True)  # fmt: skip
    assert is_run_instant(hourly, ny, z("2026-11-01T05:00"))  # 01:00 EDT
    assert not is_run_instant(hourly, ny, z("2026-11-01T06:00"))  # 01:00 EST, the repeat


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(cron=crons(), zone=st.sampled_from(ZONES), after=instants)
def test_successive_next_times_are_increasing_whole_seconds_and_exactly_the_rules_run_instants(
    cron: Cron, zone: str, after: datetime
) -> None:
    try:
        validate_cron(cron.text)
    except ValueError:
        # Only an expression that can never fire (31 in months without it) is refused.
        assume(False)
    tz = ZoneInfo(zone)
    got = []
    current = after
    for _ in range(4):
        current = next_cron_time(cron.text, zone, current)
        got.append(current)

    assert got[0] > after
    assert all(a < b for a, b in zip(got, got[1:]))
    for t in got:
        assert t.microsecond == 0 and t.second == 0
        assert t.utcoffset() == timedelta(0)
        assert is_run_instant(cron, tz, t), f"{t} ({t.astimezone(tz)}) is not a time of {cron.text!r}"

    # Nothing was missed: no run instant of the model lies between `after` and the
    # results (checked minute by minute over at most a day, to stay fast).
    horizon = min(got[-1], after + timedelta(days=1))
    u = after.replace(second=0, microsecond=0) + timedelta(minutes=1)
    while u < horizon:
        assert is_run_instant(cron, tz, u) == (u in got), f"{u} ({u.astimezone(tz)}) for {cron.text!r}"
        u += timedelta(minutes=1)

    # cron_times says the same as repeated next_cron_time.
    assert list(cron_times(cron.text, zone, after, got[-1] + timedelta(seconds=1))) == got


walls = st.datetimes(min_value=datetime(2025, 1, 1), max_value=datetime(2027, 12, 31))
near_transitions = st.builds(
    lambda t, s, name: ((t + timedelta(seconds=s)).astimezone(ZoneInfo(name)).replace(tzinfo=None, fold=0), name),
    st.sampled_from(TRANSITIONS),
    st.integers(-2 * 3600, 2 * 3600).map(lambda s: s - s % 60),
    st.sampled_from(ZONES),
)


@settings(max_examples=200, deadline=None)
@given(pair=st.one_of(st.tuples(walls.map(lambda w: w.replace(microsecond=0)), st.sampled_from(ZONES)), near_transitions))
def test_a_naive_time_resolves_to_the_first_instant_the_wall_clock_reads_it_or_later(pair: tuple[datetime, str]) -> None:
    # This is the DST rule in one sentence: a repeated time is reached first on its first
    # pass; a time in a gap is first passed at the moment after the gap.
    wall, zone = pair
    tz = ZoneInfo(zone)
    got = resolve_at(wall.isoformat(), zone)
    reads = got.astimezone(tz).replace(tzinfo=None)
    before = (got - timedelta(seconds=1)).astimezone(tz).replace(tzinfo=None)
    assert reads >= wall
    assert before < wall
    if reads != wall:  # only a time in a gap may read later, and then `got` is a jump
        assert got.astimezone(tz).utcoffset() > (got - timedelta(seconds=1)).astimezone(tz).utcoffset()


@settings(max_examples=200, deadline=None)
@given(job_id=st.integers(1, 2**63 - 1), scheduled=instants, window=st.integers(0, 86400))
def test_spread_due_at_is_always_inside_the_window_in_whole_milliseconds(job_id: int, scheduled: datetime, window: int) -> None:
    scheduled = scheduled.replace(microsecond=0)
    got = spread_due_at(job_id, scheduled, timedelta(seconds=window))
    assert scheduled <= got <= scheduled + timedelta(seconds=window)
    assert got.microsecond % 1000 == 0
    assert got == spread_due_at(job_id, scheduled, timedelta(seconds=window))


@settings(max_examples=200, deadline=None)
@given(
    attempt=st.integers(1, 100),
    backoff=st.sampled_from(["exponential", "linear", "fixed"]),
    base=st.integers(0, 600),
    cap=st.integers(1, 86400),
    retry_after=st.one_of(st.none(), st.integers(0, 200000)),
    seed=st.integers(0, 2**32),
)
def test_retry_delay_is_whole_seconds_between_one_second_and_the_cap(
    attempt: int, backoff: str, base: int, cap: int, retry_after: int | None, seed: int
) -> None:
    got = retry_delay(
        attempt=attempt, backoff=backoff, base=timedelta(seconds=base), cap=timedelta(seconds=cap),
        retry_after=None if retry_after is None else timedelta(seconds=retry_after), rng=random.Random(seed),
    )  # fmt: skip
    assert got.microseconds == 0
    assert timedelta(seconds=1) <= got <= timedelta(seconds=cap)
    full = min({"exponential": base * 2 ** (attempt - 1), "linear": base * attempt, "fixed": base}[backoff], cap)
    low, high = _bounds(full)
    floor = max(low, min(retry_after or 0, cap), 1)
    assert floor <= got.total_seconds() <= max(high, floor)
    if retry_after is not None:
        assert got.total_seconds() >= min(retry_after, cap)


def test_model_weekday_numbering_matches_the_calendar() -> None:
    # 2026-01-04 is a Sunday (cron 0), 2026-01-05 a Monday (cron 1).
    assert date(2026, 1, 4).weekday() == 6 and (date(2026, 1, 4).weekday() + 1) % 7 == 0
    assert (date(2026, 1, 5).weekday() + 1) % 7 == 1


# ------------------------------------------------------------------ timetables: every, lists, bounds, exclude

# The table: weekdays at 09:00 and Saturdays at 12:00 in London, no run on
# Christmas Day. London is UTC+0 in December and switches to BST (UTC+1) on
# 2027-03-28, so 09:00 is 08:00Z from Monday 29 March.
LONDON_WORK_AND_SATURDAY = Timetable(
    zone="Europe/London", crons=("0 9 * * 1-5", "0 12 * * 6"), exclude=frozenset({date(2026, 12, 25)})
)
DECEMBER_2026 = """
    2026-12-01T09:00 2026-12-02T09:00 2026-12-03T09:00 2026-12-04T09:00 2026-12-05T12:00
    2026-12-07T09:00 2026-12-08T09:00 2026-12-09T09:00 2026-12-10T09:00 2026-12-11T09:00 2026-12-12T12:00
    2026-12-14T09:00 2026-12-15T09:00 2026-12-16T09:00 2026-12-17T09:00 2026-12-18T09:00 2026-12-19T12:00
    2026-12-21T09:00 2026-12-22T09:00 2026-12-23T09:00 2026-12-24T09:00 2026-12-26T12:00
    2026-12-28T09:00 2026-12-29T09:00 2026-12-30T09:00 2026-12-31T09:00
"""
MARCH_2027 = """
    2027-03-01T09:00 2027-03-02T09:00 2027-03-03T09:00 2027-03-04T09:00 2027-03-05T09:00 2027-03-06T12:00
    2027-03-08T09:00 2027-03-09T09:00 2027-03-10T09:00 2027-03-11T09:00 2027-03-12T09:00 2027-03-13T12:00
    2027-03-15T09:00 2027-03-16T09:00 2027-03-17T09:00 2027-03-18T09:00 2027-03-19T09:00 2027-03-20T12:00
    2027-03-22T09:00 2027-03-23T09:00 2027-03-24T09:00 2027-03-25T09:00 2027-03-26T09:00 2027-03-27T12:00
    2027-03-29T08:00 2027-03-30T08:00 2027-03-31T08:00
"""


def run_times(tt: Timetable, after: str, until: str) -> tuple[list[datetime], list[datetime]]:
    """(the times that run, the excluded times passed over) in (after, until), by next_time."""
    ran: list[datetime] = []
    passed: list[datetime] = []
    at: datetime | None = z(after)
    while True:
        found = next_time(tt, at)
        passed += [t for t in found.excluded if t < z(until)]
        if found.time is None or found.time >= z(until):
            return ran, passed
        ran.append(found.time)
        at = found.time


@pytest.mark.parametrize(
    ("after", "until", "expected"), [("2026-11-30T23:59", "2027-01-01T00:00", DECEMBER_2026),
                                     ("2027-02-28T23:59", "2027-04-01T00:00", MARCH_2027)],
)
def test_weekdays_at_0900_and_saturdays_at_1200_in_london_without_christmas_give_the_table(
    after: str, until: str, expected: str
) -> None:
    ran, passed = run_times(LONDON_WORK_AND_SATURDAY, after, until)

    assert ran == [z(t) for t in expected.split()]
    assert passed == ([z("2026-12-25T09:00")] if after.startswith("2026") else [])


def test_two_expressions_naming_the_same_instant_give_one_time() -> None:
    tt = Timetable(zone="UTC", crons=("0 9 * * *", "0 9,21 * * *", "*/30 9 * * *"))

    got = list(islice(timetable_times(tt, z("2026-12-01T00:00")), 5))

    assert got == [z("2026-12-01T09:00"), z("2026-12-01T09:30"), z("2026-12-01T21:00"), z("2026-12-02T09:00"),
                   z("2026-12-02T09:30")]


def test_each_expression_of_a_list_keeps_the_dst_rule_on_the_spring_forward_night() -> None:
    # 02:30 does not exist on 2026-03-08 in New York: it runs at 03:00 EDT (07:00Z), once,
    # and 03:00 itself (the other expression) is that same instant.
    tt = Timetable(zone="America/New_York", crons=("30 2 * * *", "0 3 * * *"))

    got = list(islice(timetable_times(tt, z("2026-03-07T12:00")), 3))

    assert got == [z("2026-03-08T07:00"), z("2026-03-09T06:30"), z("2026-03-09T07:00")]


def test_an_every_timetable_counts_from_its_anchor_in_utc() -> None:
    tt = Timetable(every=timedelta(minutes=90), anchor=z("2026-12-01T00:00"))

    assert list(islice(timetable_times(tt, z("2026-12-01T00:00")), 3)) == [
        z("2026-12-01T01:30"), z("2026-12-01T03:00"), z("2026-12-01T04:30")
    ]
    # Asked from anywhere, the phase is the anchor's.
    assert next_time(tt, z("2026-12-07T10:14:59")).time == z("2026-12-07T10:30")


def test_an_every_timetable_anchored_at_starts_at_runs_at_starts_at_itself() -> None:
    tt = Timetable(every=timedelta(hours=1), anchor=z("2026-12-01T00:00:05"), starts_at=z("2026-12-01T00:00:05"))

    assert next_time(tt, z("2026-11-20T00:00")).time == z("2026-12-01T00:00:05")
    assert next_time(tt, z("2026-12-01T00:00:05")).time == z("2026-12-01T01:00:05")


def test_an_every_timetable_anchored_at_the_creation_first_runs_one_interval_later() -> None:
    tt = Timetable(every=timedelta(hours=1), anchor=z("2026-12-01T00:00"), anchor_runs=False)

    assert next_time(tt, z("2026-11-30T00:00")).time == z("2026-12-01T01:00")


def test_an_every_job_across_the_new_york_dst_change_keeps_its_exact_utc_spacing() -> None:
    tt = Timetable(zone="America/New_York", every=timedelta(hours=5), anchor=z("2026-03-07T00:00"))

    got = list(islice(timetable_times(tt, z("2026-03-07T00:00")), 6))  # through 2026-03-08 07:00Z

    assert [b - a for a, b in zip(got, got[1:])] == [timedelta(hours=5)] * 5
    assert got[0] == z("2026-03-07T05:00") and got[-1] == z("2026-03-08T06:00")
    fall = list(islice(timetable_times(tt, z("2026-10-31T00:00")), 6))
    assert [b - a for a, b in zip(fall, fall[1:])] == [timedelta(hours=5)] * 5


def test_no_time_is_before_starts_at_or_after_ends_at() -> None:
    tt = Timetable(crons=("0 * * * *",), starts_at=z("2026-12-01T10:30"), ends_at=z("2026-12-01T13:00"))

    assert list(timetable_times(tt, z("2026-12-01T00:00"))) == [
        z("2026-12-01T11:00"), z("2026-12-01T12:00"), z("2026-12-01T13:00")
    ]
    assert next_time(tt, z("2026-12-01T13:00")).time is None


def test_an_every_1s_timetable_steps_over_an_excluded_day_counting_its_86400_times_keeping_the_first_few() -> None:
    tt = Timetable(every=timedelta(seconds=1), anchor=z("2026-12-01T00:00"), exclude=frozenset({date(2026, 12, 25)}))

    found = next_time(tt, z("2026-12-24T23:59:59"), keep=3)

    assert found.time == z("2026-12-26T00:00:00")
    assert found.excluded_count == 86_400
    assert found.excluded == [z("2026-12-25T00:00:00"), z("2026-12-25T00:00:01"), z("2026-12-25T00:00:02")]


def test_an_excluded_date_is_a_date_in_the_jobs_zone() -> None:
    # 2026-12-25 in Tokyo is 2026-12-24T15:00Z to 2026-12-25T15:00Z.
    tt = Timetable(zone="Asia/Tokyo", every=timedelta(hours=6), anchor=z("2026-12-01T00:00"),
                   exclude=frozenset({date(2026, 12, 25)}))

    found = next_time(tt, z("2026-12-24T12:00"))

    assert found.excluded == [z("2026-12-24T18:00"), z("2026-12-25T00:00"), z("2026-12-25T06:00"),
                              z("2026-12-25T12:00")]
    assert found.time == z("2026-12-25T18:00")


def test_missed_times_of_an_every_job_are_counted_without_walking_them_and_excluded_ones_are_not_missed() -> None:
    tt = Timetable(every=timedelta(seconds=1), anchor=z("2026-01-01T00:00"), exclude=frozenset({date(2026, 6, 1)}))

    found = missed_times(timetable=tt, late_time=z("2026-01-01T00:00"), now=z("2027-01-01T00:00:10"),
                         window=timedelta(0), grace=timedelta(seconds=5), keep=3)

    assert found.count == 365 * 86_400 + 4 - 86_400  # up to 00:00:04 of 2027, less the excluded day
    assert found.latest == [z("2027-01-01T00:00:02"), z("2027-01-01T00:00:03"), z("2027-01-01T00:00:04")]
    assert found.next_time == z("2027-01-01T00:00:05")


def test_missed_times_name_the_excluded_times_among_the_latest_ones() -> None:
    found = missed_times(timetable=LONDON_WORK_AND_SATURDAY, late_time=z("2026-12-23T09:00"),
                         now=z("2026-12-27T00:00"), window=timedelta(0), grace=timedelta(seconds=60), keep=10)

    assert found.latest == [z("2026-12-24T09:00"), z("2026-12-26T12:00")]
    assert found.excluded == [z("2026-12-25T09:00")]
    assert found.count == 2 and found.next_time == z("2026-12-28T09:00")


def test_every_may_be_366d_though_other_durations_stop_at_365d() -> None:
    assert parse_duration("366d", longest=timedelta(days=366)) == timedelta(days=366)
    with pytest.raises(ValueError, match="at most 365d"):
        parse_duration("366d")
