"""The parsers facing user input never fail in an unplanned way.

Arbitrary text (and text made of the parsers' own alphabet, which reaches deeper)
either parses or raises ValueError with words; what parses behaves. Pure functions:
no database, so these also run on the embedded defaults.
"""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.test import override_settings
from hypothesis import given, settings
from hypothesis import strategies as st

from jobs import schedule
from jobs.public_ids import parse_id
from jobs.validators import validate_header_name, validate_min_interval, validate_target
from receiver.views import parse_signature, verify_signature
from runs.signing import signature

pytestmark = pytest.mark.embedded

ZONES = ["UTC", "America/New_York", "Europe/London", "Asia/Kolkata", "Australia/Lord_Howe", "Pacific/Chatham"]
# Cron's own alphabet, field by field, with some junk mixed in: most examples get past
# the first check and into cronsim, where the surprises would be.
JUNK = st.sampled_from(["60", "99", "-1", "?", "¹", "٣", "\x00", "@daily", "", "L#", "*/0", "1-", "//"])
FIELD_ATOMS = [
    st.integers(0, 59).map(str),
    st.integers(0, 23).map(str),
    st.integers(1, 31).map(str) | st.sampled_from(["L", "LW", "15W", "1W", "31W"]),
    st.integers(1, 12).map(str) | st.sampled_from(["JAN", "feb", "DEC"]),
    st.integers(0, 7).map(str) | st.sampled_from(["MON", "sun", "5L", "1#2", "7#5", "0#1"]),
]


def cron_field(atom: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    atom = st.one_of(atom, atom, atom, atom, atom, st.just("*"), st.just("*"), JUNK)  # junk 1 in 8
    term = st.one_of(
        atom,
        st.tuples(atom, st.just("-"), atom).map("".join),
        st.tuples(atom, st.just("/"), st.integers(1, 40).map(str)).map("".join),
        st.tuples(atom, st.just("-"), atom, st.just("/"), st.integers(0, 40).map(str)).map("".join),
    )
    return st.lists(term, min_size=1, max_size=3).map(",".join)


cronish = st.one_of(
    st.tuples(*(cron_field(a) for a in FIELD_ATOMS)).map(" ".join),
    st.lists(cron_field(FIELD_ATOMS[0]), min_size=1, max_size=7).map(" ".join),
)
DURATION_TOKENS = st.sampled_from(["0", "1", "9", "90", "365", "366", "99999999999999", "s", "m", "h", "d", "w", "-", " ", ".", "¹", "٣", "\x00"])
durationish = st.lists(DURATION_TOKENS, max_size=5).map("".join)
AT_TOKENS = st.sampled_from(
    ["2026", "0001", "9999", "-", "10", "28", "T", " ", ":", "30", "00", "24", "60", ".", "5", "999999", "Z", "+05:30",
     "+24:00", "-00:00", "W", "٣", "\x00"]
)
atish = st.lists(AT_TOKENS, max_size=12).map("".join)
instants = st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(2200, 1, 1), timezones=st.just(UTC))


@settings(max_examples=500)
@given(text=st.text() | cronish)
def test_a_cron_expression_is_valid_or_a_value_error_in_words(text: str) -> None:
    try:
        schedule.validate_cron(text)
    except ValueError as exc:
        assert str(exc).strip()


@settings(max_examples=300, deadline=None)
@given(text=cronish, zone=st.sampled_from(ZONES), after=instants)
def test_a_valid_cron_expression_gives_a_later_whole_second_in_utc(text: str, zone: str, after: datetime) -> None:
    try:
        schedule.validate_cron(text)
    except ValueError:
        return
    try:
        following = schedule.next_cron_time(text, zone, after)
    except ValueError as exc:  # never fires again (cronsim looks 50 years ahead)
        assert "no time after" in str(exc)
        return
    assert following > after and following.tzinfo is not None and following.utcoffset() == timedelta(0)
    assert following.microsecond == 0


@given(text=st.text() | durationish)
def test_a_duration_parses_to_whole_seconds_in_range_or_is_a_value_error(text: str) -> None:
    try:
        value = schedule.parse_duration(text)
    except ValueError as exc:
        assert str(exc).strip()
        return
    assert timedelta(0) <= value <= timedelta(days=365) and value.microseconds == 0
    assert schedule.parse_duration(schedule.format_duration(value)) == value


@settings(max_examples=300)
@given(text=st.text() | atish, zone=st.sampled_from(ZONES))
def test_an_at_time_resolves_to_whole_utc_seconds_or_is_a_value_error(text: str, zone: str) -> None:
    try:
        when = schedule.resolve_at(text, zone)
    except ValueError as exc:
        assert str(exc).strip()
        return
    assert when.utcoffset() == timedelta(0) and when.microsecond == 0


@given(name=st.text(max_size=40) | st.sampled_from(ZONES + ["../etc/passwd", "America", "/", ".", "UTC\x00"]))
def test_a_zone_is_known_or_a_value_error(name: str) -> None:
    try:
        zone = schedule.get_zone(name)
    except ValueError as exc:
        assert "unknown time zone" in str(exc)
        return
    assert str(zone) == name


@given(text=st.text(max_size=30))
def test_a_public_id_is_a_number_or_none(text: str) -> None:
    parsed = parse_id("job", text)
    assert parsed is None or (isinstance(parsed, int) and parsed >= 0)


@given(text=st.text(max_size=300))
def test_a_target_and_a_header_name_are_valid_or_a_value_error(text: str) -> None:
    for check in (validate_target, validate_header_name):
        try:
            check(text)
        except ValueError as exc:
            assert str(exc).strip()


@override_settings(SCHEDULER_MIN_INTERVAL="5m")
@settings(max_examples=100, deadline=None)
@given(text=cronish)
def test_the_min_interval_check_passes_or_is_a_value_error_naming_the_gap(text: str) -> None:
    try:
        schedule.validate_cron(text)
    except ValueError:
        return
    try:
        validate_min_interval(text)
    except ValueError as exc:
        assert "apart" in str(exc) and "SCHEDULER_MIN_INTERVAL" in str(exc)


signature_headers = st.text(max_size=80) | st.lists(
    st.sampled_from(["t=", "v1=", "v0=", ",", "=", "1793219401", "¹", "abc", "5f0c", " ", "t=٣"]), max_size=8
).map("".join)


@given(header=signature_headers, body=st.binary(max_size=64))
def test_a_signature_header_of_any_shape_is_checked_without_an_error(header: str, body: bytes) -> None:
    t, macs = parse_signature(header)
    assert t is None or t >= 0
    problem = verify_signature(header, body, ["whsec_test"], tolerance=300, now=1793219401)
    assert problem is None or problem.strip()


@given(body=st.binary(max_size=256), secret=st.text(min_size=1, max_size=40), t=st.integers(0, 10**10))
def test_a_signature_verifies_under_its_secret_and_not_after_any_change(body: bytes, secret: str, t: int) -> None:
    header = signature(body, [secret], t)

    assert verify_signature(header, body, [secret], tolerance=300, now=t) is None
    assert verify_signature(header, body + b"x", [secret], tolerance=300, now=t) is not None
    assert verify_signature(header, body, [secret + "x"], tolerance=300, now=t) is not None
    assert verify_signature(header, body, [secret], tolerance=300, now=t + 301) is not None
