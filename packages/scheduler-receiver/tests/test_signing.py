"""X-Signature without Django: signed calls pass, anything else is refused in words."""
from __future__ import annotations

import pytest

from receiver.signing import parse_signature, sign, verify_signature

BODY = b'{"report":"daily"}'
NOW = 1793219401


def test_a_body_signed_with_the_secret_verifies() -> None:
    header = sign(BODY, ["whsec_a"], t=NOW)
    assert verify_signature(header, BODY, ["whsec_a"], now=NOW) is None


def test_during_a_rotation_either_secret_verifies_a_call_signed_with_both() -> None:
    header = sign(BODY, ["whsec_new", "whsec_old"], t=NOW)
    assert parse_signature(header)[0] == NOW and len(parse_signature(header)[1]) == 2
    assert verify_signature(header, BODY, ["whsec_old"], now=NOW) is None
    assert verify_signature(header, BODY, ["whsec_new"], now=NOW) is None


@pytest.mark.parametrize(
    ("header", "body", "words"),
    [
        ("", BODY, "missing"),
        ("v1=abc", BODY, "malformed"),
        (sign(BODY, ["whsec_a"], t=NOW), BODY + b" ", "does not match"),
        (sign(BODY, ["whsec_other"], t=NOW), BODY, "does not match"),
        (sign(BODY, ["whsec_a"], t=NOW - 301), BODY, "replay"),
    ],
)
def test_a_call_not_signed_by_the_secret_now_is_refused_with_the_reason(header: str, body: bytes, words: str) -> None:
    problem = verify_signature(header, body, ["whsec_a"], now=NOW)
    assert problem is not None and words in problem


def test_unknown_schemes_are_ignored_beside_v1() -> None:
    header = sign(BODY, ["whsec_a"], t=NOW) + ",v2=future"
    assert verify_signature(header, BODY, ["whsec_a"], now=NOW) is None
