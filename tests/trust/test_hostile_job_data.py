"""Hostile job data is refused when the job is made (issue 13), in the API and the
admin form alike: a 400 (or a form error) naming the field, and nothing written.

Each table below is one finding's category of hostile input; `HOSTILE_COUNTS`
says how many inputs each tries (the security table in docs/security.md).
"""
from __future__ import annotations

import ipaddress
import socket
from typing import Any
from urllib.parse import urlsplit

import pytest
from django.test import Client, override_settings
from hypothesis import given, settings
from hypothesis import strategies as st
from urllib3.util import parse_url

from jobs.models import AuditEntry, Job
from jobs.secrets import decrypt_headers
from jobs.validators import is_refused_address, target_host
from runs.models import Run, RunEvent
from tests.conftest import Service
from tests.jobs.conftest import error_messages

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]
JOBS = "/api/jobs/"
ADMIN_ADD = "/admin/jobs/job/add/"
JOB = {"schedule": "0 2 * * *", "target": "https://reports.internal/rebuild"}


def written() -> tuple[int, int, int, int]:
    return Job.objects.count(), Run.objects.count(), RunEvent.objects.count(), AuditEntry.objects.count()


def refused(service: Service, body: dict[str, Any], field: str, *, mentions: str = "") -> dict[str, Any]:
    """POST body; assert a 400 naming `field` in words, and no row written."""
    before = written()
    response = service.post(JOBS, body)
    assert response.status_code == 400, (body, response.status_code, response.content[:300])
    errors = response.json()
    assert field in errors, errors
    messages = error_messages(errors[field])
    assert messages and all(len(m.split()) >= 2 for m in messages), messages
    if mentions:
        assert mentions.lower() in " ".join(messages).lower(), messages
    assert written() == before
    return errors


# --------------------------------------------------------------------------- 1. URL parsing disagreement

# (id, target, allow-list): each must be a 400 naming `target`.
AMBIGUOUS_TARGETS = [
    ("backslash-past-the-allowlist", "http://127.0.0.1\\.allowed.internal/x", "*.internal"),
    ("backslash-to-metadata", "http://169.254.169.254\\.x/latest/meta-data/", ""),
    ("backslash-in-the-path", "http://reports.internal/a\\b", ""),
    ("fragment-before-an-at", "http://127.0.0.1#@x.allowed.internal/ok", ""),
    ("fragment", "http://reports.internal/hook#part", ""),
    ("query-before-an-at", "http://127.0.0.1?@x.allowed.internal:8080/ok", ""),
    ("zone-id-past-the-allowlist", "http://[::1%25.internal]:8302/", "*.internal"),
    ("zone-id", "http://[fe80::1%25eth0]/", ""),
    ("userinfo", "http://user@reports.internal/", ""),
    ("userinfo-before-an-address", "http://reports.internal@127.0.0.1/", "*.internal"),
    ("userinfo-with-password", "http://a:b@reports.internal/", ""),
    ("empty-userinfo", "http://@reports.internal/", ""),
    ("percent-encoded-host", "http://reports%2einternal/", ""),
    ("percent-encoded-address", "http://%31%32%37.0.0.1/", "*.internal"),
    ("percent-encoded-letter", "http://rep%6frts.internal/", ""),
    ("trailing-dot", "http://reports.internal./", ""),
    ("empty-label", "http://reports..internal/", ""),
    ("leading-dot", "http://.reports.internal/", ""),
    ("space-in-host", "http://reports .internal/", ""),
    ("space-in-path", "http://reports.internal/a b", ""),
    ("leading-space", " http://reports.internal/", ""),
    ("trailing-newline", "http://reports.internal/\n", ""),
    ("tab-in-host", "http://reports\t.internal/", ""),
    ("nul", "http://reports.internal/\x00", ""),
    ("line-separator", "http://reports.internal/\u2028", ""),
    ("nel", "http://reports.internal/\x85", ""),
    ("non-ascii-host", "http://r\u00e9ports.internal/", ""),
    ("fullwidth-dots", "http://127\uff0e0\uff0e0\uff0e1/", "*.internal"),
    ("non-canonical-port", "http://reports.internal:080/", ""),
    ("port-zero", "http://reports.internal:0/", ""),
    ("empty-port", "http://reports.internal:/", ""),
    ("sub-delims-in-host", "http://reports!internal/", ""),
]


@pytest.mark.parametrize(("target", "allow"), [c[1:] for c in AMBIGUOUS_TARGETS], ids=[c[0] for c in AMBIGUOUS_TARGETS])
def test_a_target_the_parsers_could_read_two_ways_is_a_400_naming_target(
    service: Service, target: str, allow: str
) -> None:
    with override_settings(SCHEDULER_TARGET_ALLOWLIST=[allow] if allow else []):
        refused(service, {**JOB, "target": target}, "target")


CLEAR_TARGETS = [
    "https://reports.internal/rebuild",
    "http://Reports.Internal:8443/a/b?c=d",
    "http://127.0.0.1:8302/hook",
    "http://[::1]:8302/hook",
    "https://my_service.internal/x",
    "http://reports.internal/caf%C3%A9?q=%20",
]


@pytest.mark.parametrize("target", CLEAR_TARGETS)
def test_a_clear_target_is_accepted_and_keyed_by_the_host_the_connection_uses(service: Service, target: str) -> None:
    response = service.post(JOBS, {**JOB, "target": target})

    assert response.status_code == 201, response.content
    assert Job.objects.get().target == target
    parsed = parse_url(target)
    assert target_host(target) == parsed.netloc == (f"{parsed.host}:{parsed.port}" if parsed.port else parsed.host)


@override_settings(SCHEDULER_TARGET_ALLOWLIST=["*.internal"])
def test_the_allowlist_is_checked_against_the_host_the_connection_uses(service: Service) -> None:
    assert service.post(JOBS, {**JOB, "target": "http://reports.internal/x"}).status_code == 201
    refused(service, {**JOB, "target": "http://127.0.0.1/x.internal"}, "target", mentions="ALLOWLIST")


# URLs made of the pieces parsers disagree on: scheme, host labels, separators,
# port and path each drawn mostly from ordinary pieces, so about half the examples
# are accepted and the property below has something to hold for.
LABELS = st.sampled_from(
    ["reports", "internal", "127", "0", "1", "169", "254", "a_b", "xn--bcher-kva", "A"] * 2
    + ["0x7f", "2852039166", "", "%2e", "r\u00e9", "\uff0e", "-x", "x" * 64]
)
SEPARATORS = st.sampled_from(["."] * 12 + ["..", "\\", "@", " ", "\t", "\u2028", "%2e"])
hostish = st.one_of(
    st.sampled_from(
        ["[::1]", "[::ffff:a9fe:a9fe]", "[fe80::1%25eth0]", "[64:ff9b::a00:1]", "[2001:db8::1]", "127.0.0.1",
         "10.0.0.1", "169.254.169.254", "reports.internal", "metadata.google.internal"]
    ),
    st.lists(st.tuples(LABELS, SEPARATORS), min_size=1, max_size=4).map(
        lambda parts: "".join(label + sep for label, sep in parts)[:-1] or "x"
    ),
)
urlish = st.builds(
    "".join,
    st.tuples(
        st.sampled_from(["http://"] * 3 + ["https://", "HTTP://", "http:/", "ftp://", "http://user@"]),
        hostish,
        st.sampled_from([""] * 6 + [":8080", ":8080", ":080", ":", ":0", ":65536"]),
        st.sampled_from(["", "/", "/x?y=1#z", "/@evil", "?q", "#f"] * 2 + ["/a\\b", "/ x"]),
    ),
)


@settings(max_examples=500, deadline=None)
@given(url=urlish)
def test_an_accepted_target_reads_the_same_to_every_parser_and_the_os(url: str) -> None:
    """Whatever is accepted, urlsplit, urllib3 and the OS resolver agree on its host
    and port, and the bulkhead's key is that host and port."""
    from jobs.validators import validate_target

    try:
        validate_target(url)
    except ValueError as exc:
        assert str(exc).strip()
        return
    split, parsed = urlsplit(url), parse_url(url)
    assert split.username is None and split.password is None
    host = parsed.host.strip("[]")
    assert split.hostname == host and split.port == parsed.port
    assert target_host(url) == split.netloc.lower()
    try:
        as_ipv4 = socket.inet_aton(host)
    except OSError:
        return
    assert str(ipaddress.IPv4Address(as_ipv4)) == host  # a number is only ever a dotted quad
    assert not is_refused_address(host)


# --------------------------------------------------------------------------- 2. framing and hop-by-hop headers

FRAMING_HEADERS = [
    "Host", "Content-Length", "content-length", "Transfer-Encoding", "Connection", "Keep-Alive", "TE", "Trailer",
    "Upgrade", "Proxy-Authorization", "Proxy-Connection", "Proxy-Authenticate", "proxy-anything",
]


@pytest.mark.parametrize("name", FRAMING_HEADERS)
def test_a_framing_or_hop_by_hop_header_is_a_400_naming_it(service: Service, name: str) -> None:
    refused(service, {**JOB, "headers": {"X-Team": "reports", name: "0"}}, "headers", mentions=repr(name))


def test_a_framing_header_in_a_patch_is_a_400_and_changes_nothing(service: Service) -> None:
    job = service.post(JOBS, {**JOB, "headers": {"X-Team": "reports"}}).json()

    response = service.patch(f"{JOBS}{job['id']}/", {"headers": {"Content-Length": "0"}})

    assert response.status_code == 400 and "Content-Length" in str(response.json()["headers"])
    assert Job.objects.get().headers == {"X-Team": "reports"}


# --------------------------------------------------------------------------- 3. header names and values

BAD_HEADER_VALUES = [
    ("japanese", "日本"), ("line-separator", "a\u2028b"), ("soh", "a\x01b"), ("del", "a\x7fb"),
    ("vertical-tab", "a\x0bb"), ("nel", "a\x85b"), ("nbsp", "a\u00a0b"), ("form-feed", "a\x0cb"),
    ("esc", "\x1b[31m"), ("bom", "\ufeffa"), ("cr", "a\rb"), ("lf", "a\nb"), ("nul", "a\x00b"),
    ("latin-1", "caf\u00e9"), ("emoji", "\U0001f600"),
]
BAD_HEADER_NAMES = [
    ("space", "X Team"), ("colon", "X:Team"), ("non-ascii", "X-T\u00ebam"), ("japanese", "日本"),
    ("line-separator", "X\u2028"), ("tab", "X\tTeam"), ("empty", ""), ("slash", "X/Team"), ("brackets", "[X]"),
    ("del", "X\x7f"),
]


@pytest.mark.parametrize("value", [c[1] for c in BAD_HEADER_VALUES], ids=[c[0] for c in BAD_HEADER_VALUES])
def test_a_header_value_outside_visible_ascii_space_and_tab_is_a_400(service: Service, value: str) -> None:
    refused(service, {**JOB, "headers": {"X-Team": value}}, "headers", mentions="X-Team")


@pytest.mark.parametrize("name", [c[1] for c in BAD_HEADER_NAMES], ids=[c[0] for c in BAD_HEADER_NAMES])
def test_a_header_name_that_is_not_a_token_is_a_400(service: Service, name: str) -> None:
    refused(service, {**JOB, "headers": {name: "reports"}}, "headers")


def test_a_header_value_with_spaces_and_tabs_is_accepted_as_given(service: Service) -> None:
    value = 'a b\tc ~!"#$%&()*+,-./:;<=>?@[\\]^_`{|}'

    assert service.post(JOBS, {**JOB, "headers": {"X-Team": value}}).status_code == 201
    assert Job.objects.get().headers == {"X-Team": value}


def test_a_secret_header_value_is_checked_like_any_other(service: Service) -> None:
    refused(service, {**JOB, "headers": {"Authorization": "Bearer \x01"}}, "headers", mentions="Authorization")
    refused(service, {**JOB, "headers": {"X-Key": "日本"}, "secret_headers": ["X-Key"]}, "headers")


# --------------------------------------------------------------------------- 7. every field's limit, on its column

LONG_EMAIL = "a" * 64 + "@" + ".".join(["b" * 60] * 4) + ".test"  # 313 characters: Django's check allows it
FIELD_LIMITS = [
    # (id, changes to JOB, the field the 400 names)
    ("name-201", {"name": "n" * 201}, "name"),
    ("schedule-201", {"schedule": "0 2 * * *" + " " * 191 + "x"}, "schedule"),
    ("timezone-65", {"timezone": "A" * 65}, "timezone"),
    ("method-11", {"method": "P" * 11}, "method"),
    ("target-2001", {"target": "https://reports.internal/" + "a" * 1976}, "target"),
    ("host-label-64", {"target": f"https://{'a' * 64}.internal/"}, "target"),
    ("host-254", {"target": "https://" + ".".join(["a" * 62] * 4) + ".internal/"}, "target"),
    ("headers-17-kib", {"headers": {"X-Big": "y" * (17 * 1024)}}, "headers"),
    ("headers-65", {"headers": {f"X-H{n}": "v" for n in range(65)}}, "headers"),
    ("secret-headers-101", {"secret_headers": [f"X-S{n}" for n in range(101)]}, "secret_headers"),
    ("secret-header-name-201", {"secret_headers": ["X" * 201]}, "secret_headers"),
    ("notify-313-character-email", {"notify": LONG_EMAIL}, "notify"),
    ("notify-2001-character-url", {"notify": "https://hooks.internal/" + "a" * 1978}, "notify"),
    ("notify-http-url", {"notify": "http://hooks.internal/dead"}, "notify"),
    ("notify-metadata-url", {"notify": "https://169.254.169.254/"}, "notify"),
    ("notify-not-an-address", {"notify": "the reports team"}, "notify"),
    ("payload-over-256-kib", {"payload": {"blob": "x" * (256 * 1024)}}, "payload"),
    ("window-2d", {"window": "2d"}, "window"),
    ("timeout-2h", {"timeout": "2h"}, "timeout"),
    ("retry-max-101", {"retry": {"max": 101}}, "retry"),
]


@pytest.mark.parametrize(("changes", "field"), [c[1:] for c in FIELD_LIMITS], ids=[c[0] for c in FIELD_LIMITS])
def test_a_value_over_its_columns_limit_is_a_400_naming_the_field_never_a_500(
    service: Service, changes: dict[str, Any], field: str
) -> None:
    service.client.raise_request_exception = False
    refused(service, {**JOB, **changes}, field)


@pytest.mark.parametrize("notify", ["reports-team@example.test", "https://hooks.internal/dead?team=reports"])
def test_notify_takes_an_email_address_or_an_https_url(service: Service, notify: str) -> None:
    response = service.post(JOBS, {**JOB, "notify": notify})

    assert response.status_code == 201, response.content
    assert response.json()["notify"] == notify == Job.objects.get().notify


def test_the_longest_values_each_column_takes_are_stored_whole(service: Service) -> None:
    longest = {
        "name": "n" * 200,
        "target": "https://reports.internal/" + "a" * 1975,
        "notify": "https://hooks.internal/" + "a" * 1977,
        "headers": {f"X-H{n}": "v" for n in range(64)},
    }

    response = service.post(JOBS, {**JOB, **longest})

    assert response.status_code == 201, response.content
    job = Job.objects.get()
    assert (job.name, job.target, job.notify, len(job.headers)) == (
        longest["name"], longest["target"], longest["notify"], 64
    )


# --------------------------------------------------------------------------- 8. metadata and link-local spellings

METADATA_SPELLINGS = [
    ("decimal", "http://2852039166/"),
    ("hex", "http://0xa9fea9fe/"),
    ("octal", "http://0251.0376.0251.0376/"),
    ("two-part", "http://169.254.43518/"),
    ("three-part", "http://169.254.169.254.1/"),
    ("trailing-dot", "http://169.254.169.254./"),
    ("leading-zero", "http://169.254.169.0254/"),
    ("mixed-hex", "http://0xa9.0xfe.0xa9.0xfe/"),
    ("google-name-trailing-dot", "http://metadata.google.internal./"),
    ("google-name-upper-case", "http://METADATA.Google.Internal/"),
    ("ipv4-compatible", "http://[::169.254.169.254]/"),
    ("ipv4-mapped", "http://[::ffff:169.254.169.254]/"),
    ("ipv4-mapped-hex", "http://[::ffff:a9fe:a9fe]/"),
    ("ipv4-translated", "http://[::ffff:0:a9fe:a9fe]/"),
    ("nat64", "http://[64:ff9b::a9fe:a9fe]/"),
    ("nat64-dotted", "http://[64:ff9b::169.254.169.254]/"),
    ("6to4", "http://[2002:a9fe:a9fe::1]/"),
    ("link-local-v6", "http://[fe80::1]/"),
    ("aws-v6", "http://[fd00:ec2::254]/"),
    ("decimal-loopback", "http://2130706433/"),
    ("short-loopback", "http://127.1/"),
]


@pytest.mark.parametrize("target", [c[1] for c in METADATA_SPELLINGS], ids=[c[0] for c in METADATA_SPELLINGS])
def test_every_spelling_of_a_metadata_or_odd_numeric_host_is_a_400_naming_target(service: Service, target: str) -> None:
    refused(service, {**JOB, "target": target}, "target")


@pytest.mark.parametrize(
    "address",
    ["169.254.169.254", "::169.254.169.254", "::ffff:169.254.169.254", "::ffff:0:a9fe:a9fe", "64:ff9b::a9fe:a9fe",
     "2002:a9fe:a9fe::", "fe80::1%eth0", "fd00:ec2::254"],
)
def test_an_address_that_reaches_a_refused_ipv4_through_ipv6_is_refused(address: str) -> None:
    assert is_refused_address(address)


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "10.0.0.1", "2001:db8::1", "64:ff9b::a00:1", "::"])
def test_an_ordinary_address_is_not_refused(address: str) -> None:
    assert not is_refused_address(address)


# --------------------------------------------------------------------------- 10. a stored secret made readable

SECRET = "k3y-v4lue-never-shown"


@pytest.fixture
def secret_job(service: Service) -> dict[str, Any]:
    body = {**JOB, "headers": {"X-Api-Key": SECRET, "X-Team": "reports"}, "secret_headers": ["X-Api-Key"]}
    return service.post(JOBS, body).json()


def stored_secret() -> tuple[dict[str, str], dict[str, str], list[str]]:
    job = Job.objects.get()
    return job.headers, decrypt_headers(job.secret_headers), job.secret_header_names


def test_unmarking_a_secret_header_without_its_value_is_a_400_and_shows_nothing(
    service: Service, secret_job: dict[str, Any]
) -> None:
    before = stored_secret()

    response = service.patch(f"{JOBS}{secret_job['id']}/", {"secret_headers": []})

    assert response.status_code == 400, response.content
    assert "secret_headers" in response.json() and "X-Api-Key" in str(response.json()["secret_headers"])
    assert SECRET not in response.content.decode()
    assert stored_secret() == before == ({"X-Team": "reports"}, {"X-Api-Key": SECRET}, ["X-Api-Key"])
    assert SECRET not in service.get(f"{JOBS}{secret_job['id']}/").content.decode()


def test_unmarking_a_secret_header_sent_back_as_stars_is_a_400(service: Service, secret_job: dict[str, Any]) -> None:
    response = service.patch(f"{JOBS}{secret_job['id']}/", {"secret_headers": [], "headers": secret_job["headers"]})

    assert response.status_code == 400 and "X-Api-Key" in str(response.json()), response.content
    assert SECRET not in response.content.decode()
    assert stored_secret()[1] == {"X-Api-Key": SECRET}


def test_unmarking_a_secret_header_with_its_value_sent_again_makes_it_plain(
    service: Service, secret_job: dict[str, Any]
) -> None:
    response = service.patch(
        f"{JOBS}{secret_job['id']}/", {"secret_headers": [], "headers": {"X-Api-Key": "now-plain", "X-Team": "reports"}}
    )

    assert response.status_code == 200, response.content
    assert stored_secret() == ({"X-Api-Key": "now-plain", "X-Team": "reports"}, {}, [])
    assert SECRET not in response.content.decode()


# --------------------------------------------------------------------------- the admin form says the same


@pytest.fixture
def admin_client(superuser: Any) -> Client:
    client = Client()
    client.force_login(superuser)
    return client


def admin_add(admin_client: Client, service: Service, **changes: str) -> dict[str, list[str]]:
    data = {
        "owner": str(service.user.pk), "name": "hostile", "schedule": "0 2 * * *", "timezone": "UTC",
        "window": "0s", "misfire": "run_once", "target": "https://reports.internal/rebuild", "method": "POST",
        "headers": "{}", "payload": "null", "retry_max": "3", "retry_backoff": "exponential", "retry_base": "10s",
        "retry_cap": "1h", "timeout": "30s",
    }
    data.update(changes)
    before = written()
    response = admin_client.post(ADMIN_ADD, data)
    assert response.status_code == 200, "the add page should have shown a form error"
    assert written() == before
    return {k: [str(m) for m in v] for k, v in response.context["adminform"].form.errors.items()}


ADMIN_CASES = [
    ("backslash-target", {"target": "http://127.0.0.1\\.allowed.internal/x"}, "target"),
    ("decimal-metadata", {"target": "http://2852039166/"}, "target"),
    ("nat64-metadata", {"target": "http://[64:ff9b::a9fe:a9fe]/"}, "target"),
    ("content-length-header", {"headers": '{"Content-Length": "0"}'}, "headers"),
    ("host-header", {"headers": '{"Host": "billing.internal"}'}, "headers"),
    ("japanese-header-value", {"headers": '{"X-Team": "\\u65e5\\u672c"}'}, "headers"),
    ("line-separator-header-value", {"headers": '{"X-Team": "a\\u2028b"}'}, "headers"),
    ("control-header-value", {"headers": '{"X-Team": "a\\u0001b"}'}, "headers"),
    ("long-notify", {"notify": LONG_EMAIL}, "notify"),
]


@pytest.mark.parametrize(("changes", "field"), [c[1:] for c in ADMIN_CASES], ids=[c[0] for c in ADMIN_CASES])
def test_the_admin_add_form_refuses_hostile_data_on_the_same_field(
    admin_client: Client, service: Service, changes: dict[str, str], field: str
) -> None:
    errors = admin_add(admin_client, service, **changes)

    assert field in errors and all(len(m.split()) >= 2 for m in errors[field]), errors


def change_form_data(admin_client: Client, page: str, **changes: str) -> dict[str, Any]:
    """The change page's form as shown, with `changes` typed over it."""
    form = admin_client.get(page).context["adminform"].form
    data = {name: form.initial.get(name, "") for name in form.fields}
    for name in ("headers", "payload"):
        data[name] = form.fields[name].prepare_value(data[name]) if data[name] is not None else "null"
    data["paused"] = ""
    data.update(changes)
    return {k: v for k, v in data.items() if v != ""}


def test_the_admin_change_form_refuses_a_framing_header(admin_client: Client, service: Service) -> None:
    service.post(JOBS, {**JOB, "headers": {"X-Team": "reports"}})
    page = f"/admin/jobs/job/{Job.objects.get().pk}/change/"

    response = admin_client.post(page, change_form_data(admin_client, page, headers='{"Transfer-Encoding": "chunked"}'))

    assert response.status_code == 200
    assert "Transfer-Encoding" in " ".join(response.context["adminform"].form.errors["headers"])
    assert Job.objects.get().headers == {"X-Team": "reports"}


def test_the_admin_cannot_unmark_a_secret_header_without_its_value(
    admin_client: Client, service: Service, secret_job: dict[str, Any]
) -> None:
    page = f"/admin/jobs/job/{Job.objects.get().pk}/change/"
    before = stored_secret()

    response = admin_client.post(page, change_form_data(admin_client, page, secret_headers=""))

    assert response.status_code == 200
    assert "secret_headers" in response.context["adminform"].form.errors
    assert SECRET not in response.content.decode()
    assert stored_secret() == before
    assert SECRET not in admin_client.get(page).content.decode()


HOSTILE_COUNTS = {
    "ambiguous target URLs (finding 1)": len(AMBIGUOUS_TARGETS),
    "generated near-miss target URLs, parsers must agree (finding 1)": 500,
    "framing and hop-by-hop headers (finding 2)": len(FRAMING_HEADERS) + 1,
    "header names and values off the wire alphabet (finding 3)": len(BAD_HEADER_VALUES) + len(BAD_HEADER_NAMES) + 2,
    "values over a column's limit (finding 7)": len(FIELD_LIMITS),
    "metadata and odd numeric host spellings (finding 8)": len(METADATA_SPELLINGS),
    "unmarking a stored secret (finding 10)": 3,
    "the same through the admin form": len(ADMIN_CASES) + 2,
}

