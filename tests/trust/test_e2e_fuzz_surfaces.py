"""End to end: hostile input on the job surfaces tests/trust/test_e2e_fuzz.py leaves out.

That file fuzzes URL jobs from the API to the bytes on the wire. This one fuzzes the
other ways a job comes to be, each through its real entry point, with hypothesis
making the input (control characters, CR/LF, NUL, lone surrogates, very long
strings, Unicode lookalikes, case variants, reserved names). Five categories:

- `task`: POST /api/jobs/ as service `reports` (granted `reports.` by grant_tasks)
  with hostile `task`, `args`, `kwargs` and `queue`. Never a 5xx; a refusal is a 400
  naming only fields that were made hostile (or, for a body no JSON reader should take
  - a lone surrogate, a number out of range, nesting deeper than the stack - the
  parser's {"detail": "JSON parse error - ..."}), with no job, run or audit row
  written. An accepted job's task is under `reports.`, its queue passes
  jobs.validators.queue_refusal (or is the default `celery`, left out), its args and
  kwargs are the ones sent. Its run is then made due and executed by the real run
  path (runs.services.run_execute) against a Redis database of this test's own (the
  broker's server, db 15; flushed at the start and the end only): exactly one Celery
  protocol-2 message lands, in the list named by the job's queue and nowhere else,
  its headers carry the task and the run's identity (idempotency_key, fence_token,
  run_id, attempt, scheduled_for) and its body decodes to exactly the job's args and
  kwargs; no broker key of the transport's own (unacked*, _kombu.*, celeryev*,
  *.pidbox, seeded before) changes type, and the scheduler's run queue is untouched.
- `notify`: POST /api/jobs/ with hostile `notify` (e-mail addresses and https
  webhooks: scheme case, user info, IP literals, metadata addresses, CR/LF, very long
  values, Unicode domains), SCHEDULER_NOTIFY_ALLOWLIST set to ["allowed.example",
  "*.hooks.example"] for about half the examples and empty for the rest. Never a 5xx;
  a refusal is a 400 naming `notify` only, nothing written; an accepted value is stored
  as sent, passes jobs.validators.notify_refusal under the list, and its destination
  (the webhook's host as urllib3 and urlsplit read it; the e-mail domain as Django's
  mail would send it) matches the list when it is set; a link-local or metadata
  webhook is never accepted.
- `admin_form`: the admin's job add form (/admin/jobs/job/add/, as a superuser),
  posted as a browser would (urlencoded; a lone surrogate goes as its bytes) with
  hostile name, schedule, target, headers, payload, task, queue, args and kwargs.
  Never a 500; an invalid form is re-rendered (200, with errors) and writes nothing
  (jobs, runs, audit, admin log); a valid one makes exactly one job whose stored
  fields the API would accept again (JobSerializer on its own representation) and
  whose change page renders.
- `import_beat`: django-celery-beat PeriodicTask rows (crontab or interval) with
  hostile name, task, args/kwargs JSON text, queue, message headers and crontab
  fields; `import_beat --owner beat-owner`. Nothing but a CommandError escapes; every
  row is imported as exactly one job (named as the row, its task, queue, args and
  kwargs carried over, the API would accept it) or listed as skipped with a reason;
  no job appears that no row names; no line printed holds a control or format
  character (TERMINAL_UNSAFE); a second run creates nothing and writes nothing. A row
  PostgreSQL cannot hold (NUL, a lone surrogate, too long) cannot exist in beat's
  table: counted as refused.
- `sync_jobs`: code-defined jobs (tests/codejobs' SCHEDULES, as in
  tests/jobs/test_sync_jobs.py) with hostile names, owners, forms and fields
  (including those a definition may not give). Nothing but a CommandError (one line)
  escapes; no line printed holds a control or format character; a refused set writes
  nothing; an accepted set makes exactly one code-owned job per definition, keyed by
  its exact name, each valid as above; a second run changes nothing.

Each input is mostly ordinary and hostile in none, one or two of its fields (drawn from
the hostile strategies), so that accepted inputs are checked all the way, and a 400
must name only the fields that were drawn hostile.

Normal run: at least MIN_PER_CATEGORY (100) inputs per category; `pytest
--hypothesis-profile=long` runs max(100, the profile's max_examples / 5) per category
(1,000, so 5,000 in all, with the `long` profile of tests/conftest.py). A category's
failure is shrunk (for SHRINK_SECONDS at most) and recorded, and the next category
still runs; the counts per category, the commonest refusals and one problem of each
kind go to `e2e_fuzz_surfaces_counts.json` in the test's tmp dir, and the table is
printed; the test fails if any category had a problem or too few inputs. While
working on a failure: E2E_SURFACES_CATEGORIES=a,b narrows the categories, and
E2E_SURFACES_REFUSALS=1 prints the commonest refusals too; CI sets neither.
"""
from __future__ import annotations

import base64
import ipaddress
import json
import math
import os
import re
import time
import traceback
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from io import StringIO
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlencode, urlsplit, urlunsplit

import pytest
import redis
from django.conf import settings as django_settings
from django.contrib.admin.models import LogEntry
from django.core.mail.message import sanitize_address
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction
from django.test import Client, override_settings
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask
from hypothesis import HealthCheck, given, settings
from hypothesis import example as hypothesis_example
from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from rest_framework.throttling import UserRateThrottle
from urllib3.util import parse_url

from jobs.models import AuditEntry, Job
from jobs.serializers import JobSerializer
from jobs.validators import (
    DEFAULT_QUEUE,
    escape_controls,
    notify_is_webhook,
    notify_refusal,
    queue_refusal,
    task_name_granted,
    validate_header,
    validate_notify,
    validate_queue,
    validate_target,
    validate_task_name,
)
from runs.models import Run
from runs.services import run_execute
from tests.codejobs import schedules as code_app
from tests.conftest import Service
from tests.runs.test_publishing import queue_now
from tests.trust.test_e2e_fuzz import (
    AMBIGUOUS_URLS,
    CRONS,
    HOSTILE_BITS,
    METADATA_HOSTS,
    PLAIN_URLS,
    _random_case,
    framing_header,
    odd_header,
    payloads,
)

pytestmark = pytest.mark.django_db(transaction=True)

CATEGORIES = ("task", "notify", "admin_form", "import_beat", "sync_jobs")
# Inputs one hypothesis example holds, per category (several rows or jobs meet in one run).
PER_EXAMPLE = {"task": 2, "notify": 3, "admin_form": 1, "import_beat": 3, "sync_jobs": 2}
MIN_PER_CATEGORY = 100
SHRINK_SECONDS = 20
GRANTED = "reports."
NOTIFY_ALLOWLIST = ["allowed.example", "*.hooks.example"]
CODE_SOURCE = "tests.codejobs.schedules"
ADMIN_ADD = "/admin/jobs/job/add/"
FORM = "application/x-www-form-urlencoded"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
# Broker keys of kombu's Redis transport and Celery's (jobs.validators.RESERVED_QUEUE_*).
RESERVED_KEY_PREFIXES = ("unacked", "_kombu.", "celeryev")
RESERVED_KEY_SUFFIXES = (".pidbox",)
REFUSED_HOSTS = {"metadata.google.internal", "metadata", "instance-data", "instance-data.ec2.internal"}

# --------------------------------------------------------------------------- what is generated

# Beyond test_e2e_fuzz's bits: lone surrogates, invisible and bidi characters, letters
# whose case mapping lands on ASCII (Kelvin K, long s, dotless i, dotted I), other dots
# and spaces.
EXTRA_BITS = ["\ud800", "\udfff", "\udbff", "\u200b", "\u202e", "\u212a", "\u017f", "\u0131", "\u0130", "\uff0e",
              "\u3002", "\u00a0", "\u3000", "\x00", "\x1c", "\x85"]
BITS = [*HOSTILE_BITS, *EXTRA_BITS]
hostile_bit = st.sampled_from(BITS)
ascii_word = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=8)
long_text = st.tuples(st.sampled_from([199, 200, 201, 254, 255, 2000, 2001, 5000]),
                      st.sampled_from(["a", "é", "日", "\u200b", " "])).map(lambda t: t[1] * t[0])
hostile_text = st.one_of(
    st.lists(st.one_of(hostile_bit, st.text(max_size=6), ascii_word), min_size=1, max_size=4).map("".join),
    long_text,
    st.text(max_size=30),
)


def spliced(base: str) -> st.SearchStrategy[str]:
    """`base` with one or two hostile bits put in anywhere (the ends included)."""
    def insert(text: str, at: int, bit: str) -> str:
        at = min(at, len(text))
        return text[:at] + bit + text[at:]

    one = st.tuples(st.integers(0, len(base)), hostile_bit).map(lambda t: insert(base, *t))
    return st.one_of(one, st.tuples(one, st.integers(0, len(base) + 2), hostile_bit).map(lambda t: insert(*t)))


IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
granted_task = st.lists(IDENT, min_size=1, max_size=3).map(lambda parts: GRANTED + ".".join(parts))
ODD_TASKS = [
    "reports", "reports.", "reports..x", ".reports.x", "reports.x.", "Reports.x", "REPORTS.TASKS.SYNC", "reportsx.y",
    "reports_x.y", "report.x", "ｒｅｐｏｒｔｓ.x", "r\u0435ports.x", "reports.t\u0430sks", "reports.x ", " reports.x",
    "reports.x\n", "reports.x\r\n", "reports.\u0131", "reports.\u212a", "reports.\u017f", "reports.1x", "reports.x-y",
    "reports.x y", "reports.x/y", "reports.x:y", "reports.__init__", "reports.x\x00", "reports.x\ud800", "celery.chord",
    "celery.backend_cleanup", "celery", "runs.tasks.execute_runs", "jobs.x", "scanners.scan",
    "scheduler_project.celery.debug_task", "", " ", "reports.é", "reports.x\u200b", "reports." + "a" * 192,
    "reports." + "a" * 193, "reports." + "a" * 5000, "reports.x\t", "reports.x\x1b[31m",
]
task_names = st.one_of(
    granted_task, granted_task, granted_task.flatmap(spliced), st.sampled_from(ODD_TASKS),
    _random_case("reports.tasks.sync"), hostile_text,
)
RESERVED_QUEUE_NAMES = [
    "celery", "runs", "celeryev", "celeryev.x", "unacked", "unacked_index", "unacked_mutex", "unacked2",
    "_kombu.binding.celery", "_kombu.binding.runs", "_kombu.x", "x.pidbox", "reply.celery.pidbox", "celery.pidbox",
    "celery.x", "amq.direct", "amq.gen-x",
]
ODD_QUEUES = [
    "", " ", ".x", "-x", "x y", "x\n", "x\r\nY", "x\x00", "x\ud800", "ｘ", "qu\u0435ue", "x:y", "x/y", "x*", "a" * 100,
    "a" * 101, "a" * 5000, "reports", "reports-q", "reports.q", "runs2", "celery2", "celery_x", "celery-x", "runsx",
    "tasks", "_x", "0", "x\u200b", "unacked\u200b", " runs", "runs ", "celery\n", "x.pidbox\n", "x.PIDBOX",
]
queue_texts = st.one_of(
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,15}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,15}", fullmatch=True),
    st.sampled_from(RESERVED_QUEUE_NAMES).flatmap(_random_case),
    st.sampled_from(ODD_QUEUES),
    hostile_text,
)
queue_values = st.one_of(queue_texts, queue_texts, st.sampled_from([5, None, [], True]))


# JSON: a value may hold markers that become raw JSON text when rendered (render()):
# numbers Python's json module does not write, and nesting too deep to build here.
def raw(text: str) -> str:
    return f"@@RAW({text})@@"


def deep(depth: int) -> str:
    return f"@@DEEP({depth})@@"


MARKER = re.compile(r'"@@(RAW|DEEP)\(([^)"]*)\)@@"')
RAW_NUMBERS = ["1e400", "-1e400", "1e-400", "123456789012345678901234567890", "-0", "1.0e+2", "NaN", "Infinity"]
DEPTHS = [10, 63, 64, 65, 200, 3000, 50000]  # none near the stack's limit, where the answer depends on the frames
json_key = st.one_of(st.text(max_size=8), hostile_bit,
                     st.sampled_from(["", "__proto__", "args", "kwargs", "self", "a" * 300]))
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False), hostile_text, st.text(max_size=12),
    st.sampled_from(RAW_NUMBERS).map(raw),
)
json_values = st.recursive(
    json_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_key, inner, max_size=4), max_leaves=10
)
# JSON a task may well carry (any text PostgreSQL can hold, control characters and all): most
# inputs are mostly this, so that accepted jobs reach the broker.
plain_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
plain_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                       plain_text, st.sampled_from(BITS).filter(lambda b: b.encode("utf-8", "ignore").decode() == b
                                                                and "\x00" not in b))
plain_values = st.recursive(
    plain_leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(plain_text, inner, max_size=4),
    max_leaves=10,
)
big_string = st.sampled_from([200_000, 262_139, 262_140, 262_141, 300_000]).map(lambda n: "x" * n)
args_values = st.one_of(
    st.lists(plain_values, max_size=5), st.lists(plain_values, max_size=5), st.lists(plain_values, max_size=5),
    st.lists(json_values, max_size=5), json_values,
    st.sampled_from(DEPTHS).map(lambda d: [deep(d)]), big_string.map(lambda s: [s]), st.sampled_from([[], None]),
)
kwargs_values = st.one_of(
    st.dictionaries(plain_text, plain_values, max_size=5), st.dictionaries(plain_text, plain_values, max_size=5),
    st.dictionaries(plain_text, plain_values, max_size=5), st.dictionaries(json_key, json_values, max_size=5),
    json_values, st.sampled_from(DEPTHS).map(lambda d: {"deep": deep(d)}), big_string.map(lambda s: {"s": s}),
    st.sampled_from([{}, None]),
)


def render(value: Any) -> str:
    """JSON text for `value`, markers replaced; lone surrogates written as \\u escapes
    (the text itself must be UTF-8 to be sent)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value, ensure_ascii=True)
    return MARKER.sub(lambda m: m[2] if m[1] == "RAW" else "[" * int(m[2]) + "]" * int(m[2]), text)


def body_flaw(text: str) -> str | None:
    """Why the API's JSON reader (jobs.api.StrictJSONParser) refuses the whole body, or None."""
    try:
        data = json.loads(text)
        json.dumps(data, allow_nan=False, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        return "nested too deeply"
    except UnicodeEncodeError:
        return "a lone surrogate"
    except ValueError:
        return "a number out of range"
    return None


def parsed_json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: jsonb keeps a number's digits, not its Python type (1e16
    comes back as the int 10000000000000000)."""
    def canon(v: Any) -> Any:
        if isinstance(v, bool) or v is None or isinstance(v, str):
            return v
        if isinstance(v, (int, float)):
            try:
                return float(v)
            except OverflowError:
                return v
        if isinstance(v, list):
            return [canon(x) for x in v]
        if isinstance(v, dict):
            return {k: canon(x) for k, x in v.items()}
        return v

    return a == b or canon(a) == canon(b)


# ---- task


plain_queue = st.from_regex(r"[a-z][a-z0-9_-]{0,12}", fullmatch=True).filter(
    lambda q: q not in ("celery", "runs", "celeryev") and not q.startswith(("unacked", "celeryev")))
TASK_FIELDS = ("task", "args", "kwargs", "queue")


@dataclass
class TaskInput:
    body: dict[str, Any]  # task, and args/kwargs/queue when given (markers in them)
    hostile: set[str]  # the fields drawn from the hostile strategies (a 400 may name these only)


@st.composite
def task_inputs(draw: st.DrawFn) -> TaskInput:
    hostile = set(draw(st.one_of(st.just([]), *[st.lists(st.sampled_from(TASK_FIELDS), min_size=1, max_size=2,
                                                         unique=True)] * 2)))
    body: dict[str, Any] = {"schedule": "*/5 * * * *"}
    odd_task = st.one_of(task_names, task_names, st.sampled_from([5, True, []]))
    body["task"] = draw(odd_task if "task" in hostile else granted_task)
    for name, plain, odd in (("args", st.lists(plain_values, max_size=5), args_values),
                             ("kwargs", st.dictionaries(plain_text, plain_values, max_size=5), kwargs_values),
                             ("queue", plain_queue, queue_values)):
        if name in hostile:
            body[name] = draw(odd)
        elif draw(st.booleans()):
            body[name] = draw(plain)
    return TaskInput(body, hostile)


# ---- notify

ALLOWED_HOSTS = ["allowed.example", "ALLOWED.EXAMPLE", "Allowed.Example", "a.hooks.example", "A.HOOKS.EXAMPLE",
                 "x.y.hooks.example", "x-1.hooks.example", "xn--bcher-kva.hooks.example"]
NEAR_HOSTS = [
    "hooks.example", "allowed.example.evil.test", "evil.test", "allowed.exampl", "allowed-example", "xhooks.example",
    "a.hooks.example.evil.test", "evil.test#.hooks.example", "evil.test?.hooks.example", "evil.test\\.hooks.example",
    "evil.test/.hooks.example", "evil.test%2f.hooks.example", "a.hooks.example.", "allowed.example.",
    ".allowed.example", "a..hooks.example", "\u0430llowed.example", "allowed\uff0eexample", "allowed\u3002example",
    "b\u00fccher.hooks.example", "a.hooks.example\u3002", "127.0.0.1", "[::1]", "10.0.0.1", "localhost",
    "2130706433", "0x7f.1", "allowed.example:443@evil.test", "a.hooks.example\r\nX: y", "a.hooks.example\x00",
    "a.hooks.example\ud800", "\u212aooks.example", "a.ho\u212aks.example", "*.hooks.example", "[allowed.example]",
]
METADATA_NOTIFY_HOSTS = [*METADATA_HOSTS, "instance-data", "instance-data.ec2.internal", "INSTANCE-DATA",
                         "[fd00:ec2::254]", "[FE80::A9FE:A9FE]", "169.254.169.254:443", "[::ffff:169.254.169.254]"]
SCHEMES = ["https", "HTTPS", "Https", "hTTpS", "http", "HTTP", "ftp", "https:", "httpss", " https", "https\t"]
USERINFO = ["", "", "", "user@", "user:pass@", "allowed.example@", "a.hooks.example:x@", "@", "a@b@"]
PORTS = ["", "", ":443", ":8443", ":0", ":65536", ":-1", ": 443", ":4\uff143", ":443:443"]
PATHS = ["", "/", "/hook", "/hook?x=1", "/#frag", "/\r\nX-Injected: 1", "/%0d%0a", "/a b", "/" + "a" * 2100, "?x",
         "#@evil.test"]
LOCALS = ["ops", "OPS", "a.b", "a+tag", '"quoted"', '"a@b"', '"https://x"', "a\r\nbcc: x", "a\n", "\x00", "ü",
          "a" * 64, "a" * 65, "https://x", "..", "a..b", ".a", "a.", "a b", "a\tb", "<a>", "a,b"]
EMAIL_DOMAINS = [*ALLOWED_HOSTS, *NEAR_HOSTS, "[169.254.169.254]", "[127.0.0.1]", "[IPv6:fe80::1]",
                 "metadata.google.internal", "evil.com\uff0e.hooks.example", "x.hooks.example\n"]


@dataclass
class NotifyInput:
    value: Any
    metadata: bool = False  # a webhook naming a link-local or metadata host


@st.composite
def notify_inputs(draw: st.DrawFn) -> NotifyInput:
    kind = draw(st.sampled_from(["plain", "plain", "plain", "webhook", "webhook", "metadata", "email", "email",
                                 "other"]))
    if kind == "plain":  # what a service would send, mostly: to check what is accepted
        host = draw(st.sampled_from(ALLOWED_HOSTS + NEAR_HOSTS[:8]))
        return NotifyInput(draw(st.one_of(
            st.tuples(st.sampled_from(SCHEMES[:4]), st.sampled_from(PORTS[:5]), st.sampled_from(PATHS[:5]))
            .map(lambda t: f"{t[0]}://{host}{t[1]}{t[2]}"),
            st.sampled_from(LOCALS[:6]).map(lambda local: f"{local}@{host}"),
        )))
    if kind in ("webhook", "metadata"):
        hosts = METADATA_NOTIFY_HOSTS if kind == "metadata" else ALLOWED_HOSTS + NEAR_HOSTS
        host = draw(st.sampled_from(hosts))
        scheme = draw(st.sampled_from(SCHEMES[:4]) if kind == "metadata" else st.sampled_from(SCHEMES))
        url = f"{scheme}://{draw(st.sampled_from(USERINFO))}{host}{draw(st.sampled_from(PORTS))}" \
              f"{draw(st.sampled_from(PATHS))}"
        if kind == "webhook" and draw(st.integers(0, 3)) == 0:
            url = draw(spliced(url))
        return NotifyInput(url, metadata=kind == "metadata")
    if kind == "email":
        local = draw(st.sampled_from(LOCALS) | spliced("ops"))
        domain = draw(st.sampled_from(EMAIL_DOMAINS) | spliced("a.hooks.example"))
        value = draw(st.one_of(st.just(f"{local}@{domain}"), st.emails(),
                               st.sampled_from([190, 191, 250, 300]).map(lambda n: "o" * 60 + "@" + "d" * (n - 77)
                                                                         + ".hooks.example")))
        return NotifyInput(value)
    return NotifyInput(draw(st.one_of(
        st.sampled_from(["", " ", None, "mailto:ops@allowed.example", "//allowed.example/x", "allowed.example",
                         "@allowed.example", "ops@", "ops@allowed.example,evil@evil.test",
                         "ops@allowed.example\r\nBcc: evil@evil.test", "ops@allowed.example ", " ops@allowed.example",
                         "https://allowed.example/" + "a" * 2000, "https://a.hooks.example/" + "a" * 1970,
                         5, [], {}, "https://", "https:///x", "HTTPS://[::1]:443/"]),
        hostile_text,
    )))


# ---- admin form

SCHEDULE_SEPARATORS = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029", "\n\n", " \n ", "\t"]
admin_schedules = st.one_of(
    st.sampled_from(CRONS),
    st.tuples(st.lists(st.sampled_from(CRONS), min_size=2, max_size=12), st.sampled_from(SCHEDULE_SEPARATORS))
    .map(lambda t: t[1].join(t[0])),
    spliced("0 2 * * *"), hostile_text, st.sampled_from(["0 2 * * *\n", "\n0 2 * * *", "0 2 * * *\x00",
                                                          "0\t2 * * *", "0 2 * * *" + " " * 2200]),
)
admin_targets = st.one_of(
    st.sampled_from(PLAIN_URLS + AMBIGUOUS_URLS).map(lambda u: u.replace("{P}", "8080")),
    st.sampled_from(METADATA_HOSTS).map(lambda h: "http://" + h + "{path}"),
    st.just("https://reports.internal{path}").flatmap(spliced),
).flatmap(lambda u: st.sampled_from(["", "/x", "/a b", "/\r\n", "/%0d%0a", "/é"]).map(lambda p: u.replace("{path}", p)))
INVALID_JSON = ["{", "[", "nul", '{"a":}', "'single'", "[1,]", "\ufeff{}", '{"a": 1} x', "", " "]
json_text = st.one_of(
    json_values.map(render), st.sampled_from(INVALID_JSON), st.sampled_from(DEPTHS).map(lambda d: "[" * d + "]" * d),
    st.sampled_from(RAW_NUMBERS), st.sampled_from(['"\\u0000"', '"\\ud800"', '["\\udfff"]', '{"\\u0000": 1}']),
)
header_texts = st.one_of(
    st.lists(st.one_of(framing_header, odd_header), min_size=1, max_size=3).map(lambda pairs: render(dict(pairs))),
    json_text,
)
ADMIN_FIELDS = {
    "name": st.one_of(hostile_text, spliced("adm")),
    "schedule": admin_schedules,
    "target": admin_targets,
    "headers": header_texts,
    "payload": st.one_of(payloads.map(render), json_text, big_string.map(lambda s: render([s]))),
    "task": task_names,
    "queue": queue_texts,
    "args": st.one_of(args_values.map(render), json_text),
    "kwargs": st.one_of(kwargs_values.map(render), json_text),
}


@dataclass
class AdminInput:
    kind: str  # the form's base: "url" or "task"
    changes: dict[str, str]


@st.composite
def admin_inputs(draw: st.DrawFn) -> AdminInput:
    kind = draw(st.sampled_from(["url", "task"]))
    names = draw(st.one_of(st.just([]), st.lists(st.sampled_from(sorted(ADMIN_FIELDS)), min_size=1, max_size=3,
                                                 unique=True)))
    return AdminInput(kind, {name: draw(ADMIN_FIELDS[name]) for name in names})


# ---- import_beat

CRON_MINUTES = ["*", "0", "*/5", "61", "*/0", "0-59/7", "1,2,3", "0\n1", " 0", "0 ", "a", "", "٣", "L", "1-", "-1",
                "*/15\r\n", "0," * 79 + "0", "0\x00", "0\ud800", "0\x1b[31m", "５"]
CRON_HOURS = ["*", "2", "*/2", "24", "9-17", "17-9", "2\t", "x", "", "0-23/0"]
CRON_DOMS = ["*", "1", "13", "L", "0", "32", "1-31", "15W", "31"]
CRON_MONTHS = ["*", "1", "jan", "JAN-MAR", "13", "0", "feb"]
CRON_DOWS = ["*", "mon", "mon-fri", "fri-mon", "7", "8", "sun", "MON", "1#2", "5L", "mon\n"]
ZONES = ["UTC", "Asia/Kolkata", "America/New_York", "Australia/Lord_Howe"]
INTERVAL_EVERY = [1, 30, 59, 60, 90, 3600, 86400 * 366, 0, -1, 10**9, 2**31 - 1]
INTERVAL_PERIODS = ["seconds", "minutes", "hours", "days", "microseconds", "Minutes", "fortnights", ""]
ODD_ARGS_TEXT = ["", " ", "[", "NaN", "[NaN]", "[1e400]", '["\\u0000"]', '["\\ud800"]', '{"a":1}', '"x"', "null", "[] ",
                 " []", "[1,]", "[1]garbage", '["\\x"]', '["a"\n]', "\ufeff[]", "[" * 3000 + "]" * 3000, "[]"]
ODD_KWARGS_TEXT = ['{"a":1,"a":2}', '{"\\u0000":1}', '{"":1}', '{"\\ud800":1}', "{}", "[]", '{"a":NaN}', '{"a":1e400}',
                   "{", '{"a": ' + "[" * 3000 + "]" * 3000 + "}", "\x00{}"]
beat_names = st.one_of(
    st.from_regex(r"beat-[a-z0-9]{1,10}", fullmatch=True), hostile_text, spliced("beat-row"),
    st.sampled_from([" padded", "padded ", "\tpadded", "padded\n", "\u3000padded", "padded\u00a0", "PADDED", "Padded",
                     "x" * 200, "x" * 201, "", " ", "celery.backend_cleanup", "beat\x1b[2Jrow"]),
)


@dataclass
class BeatInput:
    name: str
    task: str
    args: str | None
    kwargs: str | None
    queue: str | None
    headers: str | None
    schedule: tuple[Any, ...]  # ("crontab", m, h, dom, moy, dow, zone) or ("interval", every, period)
    enabled: bool
    one_off: bool
    extra: dict[str, Any]


def mostly(usual: list[Any], odd: list[Any]) -> st.SearchStrategy[Any]:
    """One of `usual` three times in four, else one of `odd` (a hostile row is mostly an ordinary one)."""
    return st.one_of(st.sampled_from(usual), st.sampled_from(usual), st.sampled_from(usual), st.sampled_from(odd))


BEAT_ASPECTS = ("name", "task", "args", "kwargs", "queue", "headers", "schedule", "extra")


@st.composite
def beat_inputs(draw: st.DrawFn) -> BeatInput:
    """An ordinary periodic task, hostile in none, one or two of its aspects."""
    odd = set(draw(st.one_of(st.just([]), st.lists(st.sampled_from(BEAT_ASPECTS), min_size=1, max_size=2,
                                                   unique=True))))
    if "schedule" in odd and draw(st.integers(0, 3)) == 0:
        schedule: tuple[Any, ...] = ("interval", draw(mostly([60, 90, 300, 3600, 86400], INTERVAL_EVERY)),
                                     draw(mostly(["seconds", "minutes", "hours", "days"], INTERVAL_PERIODS)))
    elif "schedule" in odd:
        schedule = ("crontab", draw(mostly(["*", "0", "*/5", "15"], CRON_MINUTES)),
                    draw(mostly(["*", "2", "*/2", "9-17"], CRON_HOURS)), draw(mostly(["*"], CRON_DOMS)),
                    draw(mostly(["*", "1", "jan"], CRON_MONTHS)), draw(mostly(["*", "mon-fri"], CRON_DOWS)),
                    draw(st.sampled_from(ZONES)))
    elif draw(st.booleans()):
        schedule = ("interval", draw(st.sampled_from([60, 90, 300, 3600, 86400])),
                    draw(st.sampled_from(["seconds", "minutes", "hours", "days"])))
    else:
        schedule = ("crontab", draw(st.sampled_from(["*", "0", "*/5", "15", "0-59/7", "1,2,3"])),
                    draw(st.sampled_from(["*", "2", "*/2", "9-17"])), "*", draw(st.sampled_from(["*", "1", "jan"])),
                    draw(st.sampled_from(["*", "mon-fri", "sun"])), draw(st.sampled_from(ZONES)))
    plain_args = st.one_of(st.none(), st.lists(plain_values, max_size=4).map(render))
    plain_kwargs = st.one_of(st.none(), st.dictionaries(plain_text, plain_values, max_size=4).map(render))
    return BeatInput(
        name=draw(beat_names if "name" in odd else st.from_regex(r"beat-[a-z0-9]{1,10}", fullmatch=True)),
        task=draw(task_names if "task" in odd else granted_task),
        args=draw(st.one_of(st.lists(json_values, max_size=4).map(render), st.sampled_from(ODD_ARGS_TEXT),
                            args_values.map(render)) if "args" in odd else plain_args),
        kwargs=draw(st.one_of(st.dictionaries(json_key, json_values, max_size=4).map(render),
                              st.sampled_from(ODD_KWARGS_TEXT), kwargs_values.map(render))
                    if "kwargs" in odd else plain_kwargs),
        queue=draw(queue_texts if "queue" in odd else st.one_of(st.none(), st.sampled_from(["", "celery"]),
                                                                 plain_queue)),
        headers=draw(st.sampled_from([None, "", "[]", '{"x-team": "a"}', "not json", "null", "{}"])
                     if "headers" in odd else st.just("{}")),
        schedule=schedule,
        enabled=draw(st.sampled_from([True, True, True, False])),
        one_off=draw(st.sampled_from([False] * 7 + [True])),
        extra=draw(st.sampled_from([{"routing_key": "rk"}, {"priority": 5}, {"exchange": "ex"}, {"expire_seconds": 60},
                                    {"routing_key": ""}]) if "extra" in odd else st.just({})),
    )


# ---- sync_jobs

SYNC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "schedule": st.one_of(st.sampled_from(CRONS), spliced("0 3 * * *"),
                          st.lists(st.sampled_from(CRONS), min_size=1, max_size=12), hostile_text),
    "target": admin_targets,
    "task": task_names,
    "queue": queue_values,
    "args": args_values,
    "kwargs": kwargs_values,
    "headers": st.one_of(st.lists(st.one_of(framing_header, odd_header), max_size=3).map(dict),
                         st.sampled_from([[], "x", None, {"X": 5}])),
    "payload": payloads,
    "notify": notify_inputs().map(lambda n: n.value),
    "timezone": st.sampled_from(["UTC", "Mars/Olympus", "", "../../etc/passwd", "utc", "Europe/Paris\n", "Etc/GMT+5",
                                 "Europe/Paris\x00", "Europe/Par\ud800is"]),
    # Not a definition's: each refused with its reason (jobs.code.NOT_IN_CODE), or unknown.
    "paused": st.booleans(),
    "delay": st.sampled_from(["5m", "0s"]),
    "name": st.sampled_from(["other", ""]),
    "owner": st.sampled_from([code_app.OWNER, "reports"]),
    "shedule": st.just("0 3 * * *"),
    "state": st.just("paused"),
}
SYNC_OWNERS = [code_app.OWNER] * 10 + ["reports", "Code-Service", "code-service ", " code-service", "nobody", "",
                                       "code-service\n", "c\u043ede-service", "code-service\x00"]
sync_names = st.one_of(
    st.from_regex(r"def-[a-z0-9]{1,10}", fullmatch=True), st.from_regex(r"def-[a-z0-9]{1,10}", fullmatch=True),
    hostile_text, spliced("def-x"),
    st.sampled_from([" padded", "padded ", "\tpadded", "padded\n", "Def-X", "DEF-X", "def-x", "x" * 200, "x" * 201,
                     "", "   ", "def\x1b[2Jx"]),
)


@dataclass
class SyncInput:
    name: Any
    owner: Any
    fields: dict[Any, Any]
    form: str  # "schedule" (jobs.code.Schedule), "job" (jobs.code.job), "dict" or "other"

    def build(self) -> Any:
        from jobs.code import Schedule, job

        if self.form == "job" and not {"name", "owner"} & set(self.fields):
            return job(self.name, owner=self.owner, **self.fields)
        if self.form == "dict":
            return {"name": self.name, "owner": self.owner, **self.fields}
        if self.form == "other":
            return (self.name, self.owner, self.fields)
        return Schedule(name=self.name, owner=self.owner, fields=self.fields)


PLAIN_SYNC_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "queue": plain_queue, "args": st.lists(plain_values, max_size=3),
    "kwargs": st.dictionaries(plain_text, plain_values, max_size=3), "payload": plain_values,
    "timezone": st.sampled_from(["Europe/Paris", "Asia/Kolkata"]), "window": st.sampled_from(["5m", "0s"]),
    "notify": st.sampled_from(["ops@allowed.example", "https://a.hooks.example/x"]),
    "headers": st.dictionaries(st.from_regex(r"X-[A-Za-z]{1,8}", fullmatch=True),
                               st.from_regex(r"[ -~]{0,12}", fullmatch=True), max_size=2),
    "retry": st.fixed_dictionaries({"max": st.integers(0, 5)}),
}


@st.composite
def sync_inputs(draw: st.DrawFn) -> SyncInput:
    kind = draw(st.sampled_from(["url", "task"]))
    fields: dict[Any, Any] = {"schedule": "0 3 * * *"}
    fields.update({"target": "https://reports.internal/code"} if kind == "url" else {"task": "reports.tasks.code"})
    plain = [n for n in PLAIN_SYNC_FIELDS if (n in ("queue", "args", "kwargs")) == (kind == "task")
             and (n != "payload" or kind == "url") and (n != "headers" or kind == "url")]
    for name in draw(st.lists(st.sampled_from(plain), max_size=2, unique=True)):
        fields[name] = draw(PLAIN_SYNC_FIELDS[name])
    ways = draw(st.one_of(st.just([]), st.lists(st.sampled_from(["name", "owner", "form", "field", "field"]),
                                                min_size=1, max_size=2)))
    for name in draw(st.lists(st.sampled_from(sorted(SYNC_FIELDS)), min_size=1, max_size=2, unique=True)) \
            if "field" in ways else []:
        fields[name] = draw(SYNC_FIELDS[name])
    form = draw(st.sampled_from(["schedule", "job", "dict", "other"] if "form" in ways else ["schedule", "job"]))
    if form == "dict" and draw(st.integers(0, 5)) == 0:
        fields[1] = 2  # a key that is not even a string
    return SyncInput(
        name=draw(sync_names if "name" in ways else st.from_regex(r"def-[a-z0-9]{1,10}", fullmatch=True)),
        owner=draw(st.sampled_from(SYNC_OWNERS[10:]) if "owner" in ways else st.just(code_app.OWNER)),
        fields=fields, form=form,
    )


# ---- explicit inputs: run first in every run (hypothesis @example), one of each hostile class
# the brief of this file names, besides what is generated.

EVERY_5 = "*/5 * * * *"
TASK = "reports.tasks.sync"
TASK_SEEDS = [
    TaskInput({"schedule": EVERY_5, "task": TASK + "\ud800"}, {"task"}),
    TaskInput({"schedule": EVERY_5, "task": "Reports.tasks.sync"}, {"task"}),
    TaskInput({"schedule": EVERY_5, "task": "celery.chord"}, {"task"}),
    TaskInput({"schedule": EVERY_5, "task": TASK + "\r\nX: 1"}, {"task"}),
    TaskInput({"schedule": EVERY_5, "task": "reports." + "a" * 300}, {"task"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "queue": "unacked_index"}, {"queue"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "queue": "CELERY"}, {"queue"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "queue": "x.PIDBOX"}, {"queue"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "args": ["\x00"]}, {"args"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "kwargs": {"deep": deep(3000)}}, {"kwargs"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "args": [raw("1e400")]}, {"args"}),
    TaskInput({"schedule": EVERY_5, "task": TASK, "args": [1e300, "\r\n", "日本", 2**70],
               "kwargs": {"\u2028": None, "": [{}]}, "queue": "reports-q"}, set()),
]
NOTIFY_SEEDS = [
    NotifyInput("HTTPS://169.254.169.254/latest/meta-data/", metadata=True),
    NotifyInput("https://[::ffff:a9fe:a9fe]/", metadata=True),
    NotifyInput("https://metadata.google.internal/computeMetadata/v1/", metadata=True),
    NotifyInput("https://user@a.hooks.example/"),
    NotifyInput("ops@allowed.example\r\nBcc: evil@evil.test"),
    NotifyInput("https://b\u00fccher.hooks.example/"),
    NotifyInput("ops@b\u00fccher.hooks.example"),
    NotifyInput("https://a.hooks.example/" + "a" * 2000),
    NotifyInput("OPS@ALLOWED.EXAMPLE"),
]
ADMIN_SEEDS = [
    AdminInput("url", {"payload": "[" * 3000 + "]" * 3000}),
    AdminInput("url", {"payload": '"\\ud800"'}),
    AdminInput("url", {"name": "x\x00", "target": "http://169.254.169.254/latest/meta-data/"}),
    AdminInput("task", {"name": "x\x1b[31m", "queue": "celeryev"}),
    AdminInput("task", {"task": "celery.chord"}),
    AdminInput("url", {"schedule": "0 2 * * *\r\n*/5 * * * *", "headers": '{"X-Team": "a"}'}),
    AdminInput("url", {"headers": '{"Host": "evil.example"}'}),
]


def beat_row(name: str, **changes: Any) -> BeatInput:
    row = BeatInput(name=name, task=TASK, args=None, kwargs=None, queue=None, headers="{}",
                    schedule=("crontab", "0", "2", "*", "*", "*", "UTC"), enabled=True, one_off=False, extra={})
    for key, value in changes.items():
        setattr(row, key, value)
    return row


BEAT_SEEDS = [
    beat_row(" nightly"),
    beat_row("weekly", schedule=("interval", 1, "fortnights")),
    beat_row("forever", schedule=("interval", 10**9, "days")),
    beat_row("nul-arg", args='["\\u0000"]'),
    beat_row("broker-key", queue="unacked"),
    beat_row("terminal\x1b[2J"),
    beat_row("invoice\u202etxt.exe"),
    beat_row("ok", args='[1, "two"]', kwargs='{"three": 3.5}', queue="reports-q"),
]
URL_FIELDS = {"schedule": "0 3 * * *", "target": "https://reports.internal/code"}
SYNC_SEEDS = [
    SyncInput("nightly ", code_app.OWNER, dict(URL_FIELDS), "job"),
    SyncInput("nightly", code_app.OWNER + "\x00", dict(URL_FIELDS), "job"),
    SyncInput("nightly\x00", code_app.OWNER, dict(URL_FIELDS), "job"),
    SyncInput("big-number", code_app.OWNER, {**URL_FIELDS, "payload": {"n": 1e300}}, "job"),
    SyncInput("invoice\u202etxt.exe", code_app.OWNER, dict(URL_FIELDS), "schedule"),
    SyncInput("paused", code_app.OWNER, {**URL_FIELDS, "paused": True}, "dict"),
    SyncInput("ok", code_app.OWNER, {**URL_FIELDS, "headers": {"X-Team": "a"}, "notify": "ops@allowed.example"}, "job"),
]


def in_batches(seeds: list[Any], per: int) -> list[list[Any]]:
    return [seeds[i:i + per] for i in range(0, len(seeds), per)]


# --------------------------------------------------------------------------- checks shared by the categories


RUN_OF_ONE = re.compile(r"(.)\1{15,}", re.S)


PROBLEM_KIND = re.compile(r"(job|run)_[0-9]+|[0-9]+")


def shown(value: Any, limit: int = 400) -> str:
    """repr(value) for a message: long runs of one character written as x*N, then cut."""
    text = RUN_OF_ONE.sub(lambda m: f"{m[1]}*{len(m[0])}", repr(value))
    return text if len(text) <= limit else text[:limit] + f"...({len(text)} chars)"


def control_character(text: str) -> str | None:
    return next((c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F), None)


def api_body(job: Job) -> dict[str, Any]:
    """The job's API representation, as a POST body: the writable fields given."""
    fields = JobSerializer().fields
    data = JobSerializer(job).data
    body = {k: v for k, v in data.items() if k in fields and not fields[k].read_only and v is not None}
    if body.get("queue") == DEFAULT_QUEUE:
        body.pop("queue")  # read back for a job that left it out; a job may not name it
    return body


def job_problems(job: Job) -> list[str]:
    """What is wrong with a stored job, whatever made it: the API's own checks again."""
    problems = []
    where = f"{job.public_id} ({job.name[:60]!r})"
    bad = control_character(job.name)
    if bad is not None:
        problems.append(f"{where}: its name holds the control character {bad!r}")
    try:
        job.name.encode("utf-8")
    except UnicodeEncodeError:
        problems.append(f"{where}: its name holds a lone surrogate")
    if job.task:
        if not task_name_granted(job.task, [GRANTED]):
            problems.append(f"{where}: task {job.task!r} is not under {GRANTED}")
        for check, value in ((validate_task_name, job.task), (validate_queue, job.queue)):
            try:
                check(value)
            except ValueError as exc:
                problems.append(f"{where}: {value!r} fails {check.__name__}: {exc}")
        if job.queue != DEFAULT_QUEUE and queue_refusal(job.queue) is not None:
            problems.append(f"{where}: queue {job.queue!r} is refused: {queue_refusal(job.queue)}")
    else:
        try:
            validate_target(job.target)
        except ValueError as exc:
            problems.append(f"{where}: target {job.target!r} fails validate_target: {exc}")
        for name, value in (job.headers or {}).items():
            try:
                validate_header(name, value)
            except ValueError as exc:
                problems.append(f"{where}: header {name!r}: {exc}")
    if job.notify:
        try:
            validate_notify(job.notify)
        except ValueError as exc:
            problems.append(f"{where}: notify {job.notify!r}: {exc}")
    again = JobSerializer(data=api_body(job), context={"owner": job.owner})
    if not again.is_valid():
        problems.append(f"{where}: the API would refuse the job as stored: {dict(again.errors)!r}"[:600])
    return problems


def is_metadata_host(host: str | None) -> bool:
    """A link-local or metadata host, by a check of this test's own (ipaddress)."""
    if not host:
        return False
    host = host.strip("[]").split("%", 1)[0].lower().rstrip(".")
    if host in REFUSED_HOSTS:
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    inner: list[Any] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip == ipaddress.ip_address("fd00:ec2::254"):
            return True
        inner += [a for a in (ip.ipv4_mapped, ip.sixtofour) if a is not None]
        if any(ip in ipaddress.ip_network(n) for n in ("::/96", "::ffff:0:0:0/96", "64:ff9b::/96")):
            inner.append(ipaddress.IPv4Address(ip.packed[-4:]))
    return any(a.is_link_local for a in inner)


# What acts on an operator's terminal rather than showing there: control characters (escape
# sequences), format characters (bidi overrides, zero-width), line and paragraph separators,
# surrogates. jobs.validators.escape_controls writes them (and more) as escapes.
TERMINAL_UNSAFE = ("Cc", "Cf", "Zl", "Zp", "Cs")


def unsafe_lines(text: str) -> list[str]:
    """Lines of a command's output (split at \n only) holding a character TERMINAL_UNSAFE."""
    return [line for line in text.split("\n") if any(unicodedata.category(c) in TERMINAL_UNSAFE for c in line)]


# --------------------------------------------------------------------------- the run


@dataclass
class Tally:
    counts: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    problems: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    failures: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))  # why, roughly

    def refused_because(self, category: str, reason: Any) -> None:
        self.refusals[category][RUN_OF_ONE.sub(lambda m: f"{m[1]}*{len(m[0])}", str(reason))[:160]] += 1

    def count(self, category: str, outcome: str, problems: list[str]) -> None:
        counts = self.counts[category]
        counts["tried"] += 1
        if problems:
            counts["problems"] += 1
            # One of each kind (the words before the first quote, ids and numbers aside).
            kinds = {PROBLEM_KIND.sub("N", p.split("'")[0].split('"')[0])[:60] for p in self.problems[category]}
            for problem in problems:
                kind = PROBLEM_KIND.sub("N", problem.split("'")[0].split('"')[0])[:60]
                if kind not in kinds and len(kinds) < 10:
                    kinds.add(kind)
                    self.problems[category].append(RUN_OF_ONE.sub(lambda m: f"{m[1]}*{len(m[0])}", problem)[:1500])
        else:
            counts[outcome] += 1

    def as_json(self) -> dict[str, Any]:
        return {
            category: {**{k: self.counts[category][k] for k in ("tried", "refused", "accepted", "problems")},
                       "seconds": round(self.seconds.get(category, 0.0), 1),
                       "problems_of_each_kind": self.problems[category],
                       "common_refusals": [f"{n} x {why}" for why, n in self.refusals[category].most_common(8)],
                       "failure": self.failures.get(category, "")}
            for category in CATEGORIES
        }


class Surfaces:
    def __init__(self, reports: Service, beat_owner: Service, code_owner: Service, staff: Client,
                 redis_url: str) -> None:
        self.reports, self.beat_owner, self.code_owner, self.staff = reports, beat_owner, code_owner, staff
        self.redis_url = redis_url
        self.redis = redis.Redis.from_url(redis_url)
        self.tally = Tally()
        self.n = 0
        self.category = ""

    @staticmethod
    def written() -> tuple[int, int, int, int]:
        return Job.objects.count(), Run.objects.count(), AuditEntry.objects.count(), LogEntry.objects.count()

    # ------------------------------------------------------------------ the API

    def post(self, body: dict[str, Any], problems: list[str]) -> tuple[Any, str]:
        text = render(body)
        try:
            response = self.reports.client.post("/api/jobs/", data=text, content_type="application/json")
        except Exception as exc:  # the test client re-raises what would have been a 500
            problems.append(f"POST /api/jobs/ raised {exc!r} for {shown(text, 300)}")
            return None, text
        return response, text

    def judge(self, response: Any, text: str, hostile: set[str], before: tuple[int, ...],
              problems: list[str]) -> Job | None:
        """The API's answer: None for a refusal (checked), the job for a 201."""
        flaw = body_flaw(text)
        status = response.status_code
        if status >= 500 or status not in (201, 400):
            problems.append(f"POST /api/jobs/ answered {status}: {response.content[:300]!r} for {shown(text, 300)}")
            return None
        if status == 400:
            errors = response.json()
            self.tally.refused_because(self.category, errors)
            if self.written() != before:
                problems.append(f"a 400 wrote rows ({before} -> {self.written()}) for {shown(text, 300)}")
            if flaw:
                if not (isinstance(errors, dict) and set(errors) == {"detail"}
                        and str(errors["detail"]).startswith("JSON parse error")):
                    problems.append(f"a body with {flaw} was refused with {errors!r}, not as unreadable JSON")
                return None
            named = set(errors) if isinstance(errors, dict) else set()
            if not named or not named <= hostile:
                problems.append(f"a 400 that names {sorted(named)}, not the hostile field(s) {sorted(hostile)}: "
                                f"{str(errors)[:300]} for {shown(text, 300)}")
            return None
        if flaw:
            problems.append(f"a body with {flaw} was accepted: {shown(text, 300)}")
        return Job.objects.get(pk=int(str(response.json()["id"]).removeprefix("job_")))

    # ------------------------------------------------------------------ 1. task

    def check_task(self, batch: list[TaskInput]) -> list[str]:
        found: list[str] = []
        for item in batch:
            self.n += 1
            problems: list[str] = []
            body = {**item.body, "name": f"task-fuzz-{self.n}"}
            before = self.written()
            response, text = self.post(body, problems)
            job = None
            if response is not None:
                job = self.judge(response, text, item.hostile, before, problems)
            sent = parsed_json(text)
            if job is not None and isinstance(sent, dict):
                self.check_task_job(job, sent, problems)
            self.tally.count("task", "accepted" if job is not None else "refused", problems)
            found += problems
        return found

    def check_task_job(self, job: Job, sent: dict[str, Any], problems: list[str]) -> None:
        if job.task != sent["task"] or not task_name_granted(job.task, [GRANTED]):
            problems.append(f"{job.public_id}: task {job.task!r} (sent {sent['task']!r}) is not under {GRANTED}")
        queue = sent.get("queue")
        if queue is None:
            if job.queue != DEFAULT_QUEUE:
                problems.append(f"{job.public_id}: no queue sent, {job.queue!r} stored")
        elif job.queue != str(queue) or queue_refusal(job.queue) is not None:
            problems.append(f"{job.public_id}: queue {queue!r} sent, {job.queue!r} stored, which queue_refusal says "
                            f"{queue_refusal(job.queue)!r} of")
        for name, empty in (("args", []), ("kwargs", {})):
            want = sent.get(name)
            want = empty if want is None else want
            if not same_json(getattr(job, name), want):
                problems.append(f"{job.public_id}: {name} stored as {getattr(job, name)!r:.200}, sent {want!r:.200}")
        problems += job_problems(job)
        if not problems:
            self.publish(job, problems)

    def redis_keys(self) -> dict[str, str]:
        return {k.decode("utf-8", "backslashreplace"): self.redis.type(k).decode() for k in self.redis.scan_iter()}

    def seed_redis(self) -> None:
        """The private db, flushed, with the keys a broker's server holds beside the queues."""
        r = self.redis
        r.flushdb()
        r.hset("unacked", "seed", "{}")
        r.zadd("unacked_index", {"seed": 1.0})
        r.set("unacked_mutex", "seed")
        r.sadd("_kombu.binding.runs", "runs\x06\x16\x06\x16runs")
        r.sadd("_kombu.binding.celeryev", "seed")
        r.set("celeryev", "seed")
        r.sadd("seed.pidbox", "seed")
        r.rpush("runs", "the scheduler's own run message")

    def publish(self, job: Job, problems: list[str]) -> None:
        """The run path on the private Redis db: one message, in the job's queue only."""
        run = queue_now(job)
        before = self.redis_keys()
        try:
            with override_settings(SCHEDULER_TASK_BROKER_URL=self.redis_url):
                outcome = run_execute(run_id=run.pk, worker="fuzz-surfaces")
        except Exception as exc:
            problems.append(f"{job.public_id}: run_execute raised {exc!r}")
            return
        run.refresh_from_db()
        if outcome != "succeeded":
            problems.append(f"{job.public_id}: its run ended {outcome!r}: {run.last_error[:300]!r}")
        queue = job.queue or DEFAULT_QUEUE
        messages = self.redis.lrange(queue, 0, -1)
        self.redis.delete(queue)
        after = self.redis_keys()
        for key, kind in before.items():
            if after.get(key) != kind:
                problems.append(f"{job.public_id}: broker key {key!r} was a {kind}, now a {after.get(key)}")
        for key, kind in after.items():
            reserved = key.startswith(RESERVED_KEY_PREFIXES) or key.endswith(RESERVED_KEY_SUFFIXES)
            # kombu binds the queue to its exchange (named as the queue): those two sets are new.
            bindings = (f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
            if key not in before and not (key in bindings and kind == "set"):
                problems.append(f"{job.public_id}: a new key {key!r} ({kind}) after publishing to {queue!r}")
            elif reserved and kind == "list":
                problems.append(f"{job.public_id}: the broker key {key!r} is a list")
        if self.redis.llen("runs") != 1:
            problems.append(f"{job.public_id}: the scheduler's run queue holds {self.redis.llen('runs')} messages")
        if len(messages) != 1:
            problems.append(f"{job.public_id}: {len(messages)} messages in {queue!r}, not one")
            return
        try:
            message = json.loads(messages[0])
            headers, properties = message["headers"], message["properties"]
            args, kwargs, _embed = json.loads(base64.b64decode(message["body"]))
        except Exception as exc:
            problems.append(f"{job.public_id}: the message does not decode: {exc!r} {messages[0][:300]!r}")
            return
        want = {"task": job.task, "lang": "py", "idempotency_key": run.idempotency_key, "fence_token": run.fence,
                "run_id": run.public_id, "attempt": run.attempt,
                "scheduled_for": run.scheduled_for.strftime(TIME_FORMAT)}
        differ = {k: (headers.get(k), v) for k, v in want.items() if headers.get(k) != v}
        if differ:
            problems.append(f"{job.public_id}: message headers (got, want): {differ!r}")
        if properties.get("body_encoding") != "base64" or message.get("content-type") != "application/json":
            problems.append(f"{job.public_id}: not a JSON Celery message: {properties!r:.200}")
        if properties.get("delivery_info", {}).get("routing_key") != queue:
            problems.append(f"{job.public_id}: routed {properties.get('delivery_info')!r}, not to {queue!r}")
        if args != job.args or kwargs != job.kwargs:
            problems.append(f"{job.public_id}: the message carries args {args!r:.200} kwargs {kwargs!r:.200}, "
                            f"the job {job.args!r:.200} {job.kwargs!r:.200}")

    # ------------------------------------------------------------------ 2. notify

    def check_notify(self, example: tuple[list[NotifyInput], bool]) -> list[str]:
        batch, listed = example
        # Set on the override the `settings` fixture made (see the fixture): one more
        # override per example would nest a settings holder per example.
        django_settings.SCHEDULER_NOTIFY_ALLOWLIST = list(NOTIFY_ALLOWLIST) if listed else []
        found: list[str] = []
        for item in batch:
            self.n += 1
            problems: list[str] = []
            body = {"name": f"notify-fuzz-{self.n}", "schedule": "*/5 * * * *",
                    "target": "https://reports.internal/rebuild", "notify": item.value}
            before = self.written()
            response, text = self.post(body, problems)
            job = self.judge(response, text, {"notify"}, before, problems) if response is not None else None
            if job is not None:
                self.check_notify_job(job, item, listed, problems)
            self.tally.count("notify", "accepted" if job is not None else "refused", problems)
            found += problems
        return found

    def check_notify_job(self, job: Job, item: NotifyInput, listed: bool, problems: list[str]) -> None:
        value = item.value
        where = f"{job.public_id}: notify {value!r:.200} (allow-list {'set' if listed else 'empty'})"
        if job.notify != ("" if value is None else str(value)):
            problems.append(f"{where} was stored as {job.notify!r:.200}")
        value = job.notify
        if not value:
            return
        if control_character(value) is not None:
            problems.append(f"{where} holds a control character")
        if notify_refusal(value) is not None:
            problems.append(f"{where}: notify_refusal says {notify_refusal(value)!r} of a value the API accepted")
        if item.metadata:
            problems.append(f"{where}: a link-local or metadata webhook was accepted")
        if notify_is_webhook(value):
            try:
                hosts = [parse_url(value).host, urlsplit(value).hostname]
            except ValueError as exc:
                problems.append(f"{where}: an accepted webhook two parsers cannot read: {exc}")
                return
            if any(is_metadata_host(h) for h in hosts):
                problems.append(f"{where}: a webhook to a link-local or metadata host ({hosts}) was accepted")
            if listed and not all(h and any(fnmatchcase(h.strip("[]").lower(), p) for p in NOTIFY_ALLOWLIST)
                                  for h in hosts):
                problems.append(f"{where}: the webhook's host, read as {hosts}, is not in the allow-list")
        elif listed:
            try:
                address = sanitize_address(value, "utf-8")  # what Django's mail sends: the domain as IDNA
            except Exception:
                return  # never sent anywhere: the mail backend refuses it
            domain = address.rpartition("@")[2].rstrip(">").lower()
            if not any(fnmatchcase(domain, p) for p in NOTIFY_ALLOWLIST):
                problems.append(f"{where}: mail would go to domain {domain!r}, not in the allow-list")
        problems += job_problems(job)

    # ------------------------------------------------------------------ 3. admin form

    def admin_form(self, item: AdminInput) -> dict[str, Any]:
        form: dict[str, Any] = {
            "owner": str(self.reports.user.pk), "name": f"adm-{self.n}", "schedule": "0 2 * * *", "timezone": "UTC",
            "window": "0s", "misfire": "run_once", "overlap": "skip", "method": "POST", "headers": "{}",
            "payload": "null", "retry_max": "3", "retry_backoff": "exponential", "retry_base": "10s", "retry_cap": "1h",
            "timeout": "30s", "notify_on": ["dead"], "pause_after_failures": "0", "_save": "Save",
        }
        if item.kind == "url":
            form["target"] = "https://reports.internal/rebuild"
        else:
            form.update(task="reports.tasks.sync", args="[]", kwargs="{}", queue="reports-q")
        form.update({k: str(v) for k, v in item.changes.items()})
        return form

    def check_admin(self, batch: list[AdminInput]) -> list[str]:
        found: list[str] = []
        for item in batch:
            self.n += 1
            problems: list[str] = []
            outcome = self.post_admin(item, problems)
            self.tally.count("admin_form", outcome, problems)
            found += problems
        return found

    def post_admin(self, item: AdminInput, problems: list[str]) -> str:
        form = self.admin_form(item)
        pairs = [(k, v) for k, vs in form.items() for v in (vs if isinstance(vs, list) else [vs])]
        # As a browser sends it: UTF-8, a lone surrogate as its (invalid) bytes.
        encoded = urlencode(pairs, encoding="utf-8", errors="surrogatepass")
        before, last = self.written(), Job.objects.order_by("-pk").values_list("pk", flat=True).first() or 0
        try:
            response = self.staff.post(ADMIN_ADD, data=encoded, content_type=FORM)
        except Exception as exc:
            problems.append(f"the admin add form raised {type(exc).__name__}: {str(exc)[:200]} for "
                            f"{shown(item.changes)}")
            return "problem"
        if response.status_code == 200:
            context_form = response.context["adminform"].form if response.context else None
            if context_form is None or not context_form.errors:
                problems.append(f"a 200 without form errors for {shown(item.changes)}")
            else:
                self.tally.refused_because("admin_form", dict(context_form.errors))
            if self.written() != before:
                problems.append(f"an invalid form wrote rows ({before} -> {self.written()}) for {shown(item.changes)}")
            return "refused"
        if response.status_code != 302:
            problems.append(f"the admin add form answered {response.status_code} for {shown(item.changes)}")
            return "problem"
        made = list(Job.objects.filter(pk__gt=last))
        if response["Location"].endswith(ADMIN_ADD):  # refused by the service after the checks (said on the page)
            if self.written() != before:
                problems.append(f"a refused save wrote rows ({before} -> {self.written()})")
            return "refused"
        if len(made) != 1:
            problems.append(f"a saved form made {len(made)} jobs for {shown(item.changes)}")
            return "problem"
        job = made[0]
        problems += job_problems(job)
        page = self.staff.get(f"/admin/jobs/job/{job.pk}/change/")
        if page.status_code != 200:
            problems.append(f"{job.public_id}'s change page answered {page.status_code}")
        return "accepted"

    # ------------------------------------------------------------------ 4. import_beat

    def make_row(self, row: BeatInput) -> PeriodicTask:
        with transaction.atomic():
            if row.schedule[0] == "crontab":
                m, h, dom, moy, dow, zone = row.schedule[1:]
                schedule = {"crontab": CrontabSchedule.objects.create(
                    minute=m, hour=h, day_of_month=dom, month_of_year=moy, day_of_week=dow, timezone=zone)}
            else:
                schedule = {"interval": IntervalSchedule.objects.create(every=row.schedule[1], period=row.schedule[2])}
            task = PeriodicTask(name=row.name, task=row.task, queue=row.queue, enabled=row.enabled,
                                one_off=row.one_off, **schedule, **row.extra)
            for name in ("args", "kwargs", "headers"):
                if getattr(row, name) is not None:
                    setattr(task, name, getattr(row, name))
            task.save()
            return task

    def command(self, name: str, *args: str, problems: list[str]) -> str | CommandError | None:
        """`manage.py NAME ARGS`: what it printed, or its CommandError; None, and a
        problem, when it raised anything else. A printed control or format character is
        a problem too."""
        out = StringIO()
        try:
            call_command(name, *args, stdout=out)
        except CommandError as exc:
            return exc
        except Exception as exc:
            problems.append(f"{name} raised {type(exc).__name__}: {str(exc)[:300]}\n"
                            f"{traceback.format_exc()[-1500:]}")
            return None
        text = out.getvalue()
        for line in unsafe_lines(text):
            problems.append(f"{name} printed a control or format character: {line[:200]!r}")
        return text

    def import_beat(self, problems: list[str]) -> str | None:
        got = self.command("import_beat", "--owner", self.beat_owner.user.username, problems=problems)
        return f"CommandError: {got}" if isinstance(got, CommandError) else got

    def check_beat(self, batch: list[BeatInput]) -> list[str]:
        owner = self.beat_owner.user
        found: list[str] = []
        made: list[tuple[BeatInput, PeriodicTask]] = []
        for row in batch:
            try:
                made.append((row, self.make_row(row)))
            except Exception:  # NUL, a lone surrogate, too long, a duplicate name: no such row can exist
                self.tally.refused_because("import_beat", "PostgreSQL cannot hold the row")
                self.tally.count("import_beat", "refused", [])
        try:
            if made:
                found += self.import_both_times(owner, made)
        finally:
            PeriodicTask.objects.all().delete()
            CrontabSchedule.objects.all().delete()
            IntervalSchedule.objects.all().delete()
            Job.objects.filter(owner=owner).delete()
        return found

    def import_both_times(self, owner: Any, made: list[tuple[BeatInput, PeriodicTask]]) -> list[str]:
        common: list[str] = []
        before = self.written()
        text = self.import_beat(common)
        per_row: dict[int, list[str]] = {task.pk: [] for _, task in made}
        outcomes: dict[int, str] = {}
        if text is None or text.startswith("CommandError"):
            if self.written() != before:
                common.append(f"a failed import_beat wrote rows ({before} -> {self.written()})")
            outcomes = {task.pk: "refused" for _, task in made}
        else:
            jobs = list(Job.objects.filter(owner=owner).exclude(state=Job.State.DELETED))
            # Which periodic task each job came from: the import's audit entry says.
            came_from = dict(
                (entry.object_id, entry.detail.get("periodic_task"))
                for entry in AuditEntry.objects.filter(object_type="job", action="created",
                                                       object_id__in=[j.public_id for j in jobs])
            )
            rows = {task.name: task for _, task in made}
            for job in jobs:
                source = came_from.get(job.public_id)
                if source not in rows:
                    common.append(f"import_beat made {job.public_id} ({job.name!r}) from no row of this run "
                                  f"(its audit says {source!r})")
                elif job.name != source.strip():  # the API trims a name; import_beat matches it trimmed
                    per_row[rows[source].pk].append(
                        f"{job.public_id} is named {job.name!r}, its periodic task {source!r}: a second run will not "
                        f"know it is imported")
            lines = text.splitlines()
            for row, task in made:
                mine = [j for j in jobs if came_from.get(j.public_id) == task.name]
                if len(mine) > 1:
                    per_row[task.pk].append(f"row {task.name!r} became {len(mine)} jobs")
                elif mine:
                    outcomes[task.pk] = "accepted"
                    per_row[task.pk] += self.beat_job_problems(mine[0], task)
                else:
                    outcomes[task.pk] = "refused"
                    shown = escape_controls(task.name)
                    said = [line for line in lines if line.startswith(shown) and "skipped: " in line]
                    if not said and task.name != task.name.strip():
                        # The table's name column shows such a name as padding: the reason says it.
                        said = [line for line in lines if "skipped: its name has spaces around it" in line]
                    if not said:
                        per_row[task.pk].append(f"row {task.name!r} was neither imported nor listed as skipped")
                    else:
                        self.tally.refused_because("import_beat", said[0].partition("skipped: ")[2])
            summary = (f"{len(made)} periodic tasks: created {len(jobs)} jobs; 0 already imported; "
                       f"{len(made) - len(jobs)} skipped (reasons above)")
            if summary not in text:
                common.append(f"import_beat's summary is not {summary!r}: {text[-300:]!r}")
            # Twice: nothing new.
            before = self.written()
            again = self.import_beat(common)
            if self.written() != before:
                common.append(f"a second import_beat wrote rows ({before} -> {self.written()}): {again!r:.600}")
            elif again is not None and f"created 0 jobs; {len(jobs)} already imported" not in again:
                common.append(f"a second import_beat said {again[-200:]!r}, not created 0 jobs; {len(jobs)} already "
                              f"imported")
        found = list(common)
        for i, (_, task) in enumerate(made):
            problems = per_row[task.pk] + (common if i == 0 else [])  # the run's own problems, counted once
            self.tally.count("import_beat", outcomes.get(task.pk, "refused"), problems)
            found += per_row[task.pk]
        return found

    @staticmethod
    def beat_job_problems(job: Job, task: PeriodicTask) -> list[str]:
        problems = []
        want_queue = task.queue if task.queue not in (None, "", DEFAULT_QUEUE) else DEFAULT_QUEUE
        if (job.task, job.queue, job.paused) != (task.task, want_queue, not task.enabled):
            problems.append(f"{job.public_id}: (task, queue, paused) {(job.task, job.queue, job.paused)!r}, "
                            f"the row's {(task.task, want_queue, not task.enabled)!r}")
        for name, empty in (("args", []), ("kwargs", {})):
            text = getattr(task, name)
            want = empty if text in (None, "") else parsed_json(text)
            if not same_json(getattr(job, name), want):
                problems.append(f"{job.public_id}: {name} {getattr(job, name)!r:.200}, the row's {text!r:.200}")
        return problems + job_problems(job)

    # ------------------------------------------------------------------ 5. sync_jobs

    def sync(self, problems: list[str]) -> str | None:
        got = self.command("sync_jobs", problems=problems)
        if isinstance(got, CommandError):
            self.tally.refused_because("sync_jobs", got)
            if unsafe_lines(str(got)) or "\n" in str(got):
                problems.append(f"sync_jobs' error is not one line free of control characters: {str(got)[:300]!r}")
            return None
        return got

    def check_sync(self, batch: list[SyncInput]) -> list[str]:
        common: list[str] = []
        outcome = "refused"
        try:
            code_app.SCHEDULES = [item.build() for item in batch]
            before = self.written()
            text = self.sync(common)
            if text is None:
                if self.written() != before:
                    common.append(f"a refused sync wrote rows ({before} -> {self.written()})")
            elif not common:
                outcome = "accepted"
                common += self.synced(batch)
                before = self.written()
                again = self.sync(common)
                if self.written() != before:
                    common.append(f"a second sync wrote rows ({before} -> {self.written()}): {again!r:.600}")
                elif again is not None and f"nothing to change: {len(batch)} unchanged" not in again:
                    common.append(f"a second sync said {again[-300:]!r}")
                elif again is None:
                    common.append("a second sync of the same definitions failed")
        finally:
            Job.objects.exclude(code_source="").delete()
        for i in range(len(batch)):
            self.tally.count("sync_jobs", outcome, common if i == 0 else [])
        return common

    @staticmethod
    def synced(batch: list[SyncInput]) -> list[str]:
        problems = []
        jobs = list(Job.objects.exclude(code_source="").exclude(state=Job.State.DELETED).select_related("owner"))
        if len(jobs) != len(batch):
            problems.append(f"{len(batch)} definitions made {len(jobs)} code-owned jobs: "
                            f"{[(j.owner.username, j.name) for j in jobs]!r:.300}")
        for item in batch:
            mine = [j for j in jobs if (j.owner.username, j.name) == (item.owner, item.name)]
            if len(mine) != 1:
                problems.append(f"definition ({item.owner!r}, {item.name!r}) is {len(mine)} jobs under its exact key")
        for job in jobs:
            if job.code_source != CODE_SOURCE:
                problems.append(f"{job.public_id}: code_source {job.code_source!r}")
            problems += job_problems(job)
        return problems

    # ------------------------------------------------------------------ running a category

    def run(self, category: str, examples_of: Callable[[int], st.SearchStrategy[Any]],
            check: Callable[[Any], list[str]], seeds: list[Any]) -> None:
        """One category: the seeds, then examples of PER_EXAMPLE inputs each, until the
        category has had inputs_wanted() of them; a failure (shrunk) is kept, not raised."""
        per = PER_EXAMPLE[category]

        def one(example: Any) -> None:
            problems = check(example)
            assert not problems, "\n".join([*problems[:20], f"the inputs: {shown(example, 3000)}"])

        for seed in reversed(seeds):
            one = hypothesis_example(example=seed)(one)
        one = given(example=examples_of(per))(one)
        one = settings(max_examples=math.ceil(inputs_wanted() / per), deadline=None, database=None,
                       suppress_health_check=list(HealthCheck), print_blob=True)(one)

        started = time.monotonic()
        self.category = category
        try:
            one()
        except Exception as exc:
            self.tally.failures[category] = f"{type(exc).__name__}: {shown(str(exc), 6000)}"
            if not isinstance(exc, AssertionError):
                self.tally.failures[category] += "\n" + traceback.format_exc()[-3000:]
        finally:
            self.tally.seconds[category] = time.monotonic() - started


def batch_of(strategy: st.SearchStrategy[Any], unique_by: Callable[[Any], Any] | None = None
             ) -> Callable[[int], st.SearchStrategy[Any]]:
    return lambda per: st.lists(strategy, min_size=per, max_size=per, unique_by=unique_by)


def inputs_wanted() -> int:
    return max(MIN_PER_CATEGORY, settings.default.max_examples // len(CATEGORIES))


def chosen_categories() -> tuple[str, ...]:
    # E2E_SURFACES_CATEGORIES=task,notify narrows a run while working on a failure; CI leaves it unset.
    chosen = tuple(c for c in os.environ.get("E2E_SURFACES_CATEGORIES", "").split(",") if c)
    return chosen or CATEGORIES


def private_redis_url() -> str:
    """The broker's Redis server, a database of this test's own (15; 14 if the broker uses 15)."""
    url = django_settings.CELERY_BROKER_URL
    if not url.startswith("redis://"):
        pytest.skip("needs the production layout's Redis broker")
    parts = urlsplit(url)
    own = "14" if parts.path.strip("/") == "15" else "15"
    return urlunsplit(parts._replace(path=f"/{own}"))


@pytest.fixture
def surfaces(service: Service, superuser: Any, settings: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    redis_url = private_redis_url()
    # A failing category is shrunk for SHRINK_SECONDS at most (hypothesis's own bound is five
    # minutes), so that a run with several failing categories still ends in reasonable time.
    monkeypatch.setattr(hypothesis_engine, "MAX_SHRINKING_SECONDS", SHRINK_SECONDS, raising=False)
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {"user": None})
    settings.SCHEDULER_TARGET_ALLOWLIST = []
    settings.SCHEDULER_NOTIFY_ALLOWLIST = []  # set per example below, over this fixture's override
    settings.SCHEDULER_TARGET_CONCURRENCY = 1000
    settings.SCHEDULER_BREAKER_FAILURES = 1000
    beat_owner, code_owner = Service("beat-owner"), Service(code_app.OWNER)
    for name in (service.user.username, beat_owner.user.username, code_owner.user.username):
        call_command("grant_tasks", name, GRANTED, stdout=StringIO())
    staff = Client()
    staff.force_login(superuser)
    found = Surfaces(service, beat_owner, code_owner, staff, redis_url)
    found.seed_redis()
    schedules = code_app.SCHEDULES
    try:
        yield found
    finally:
        code_app.SCHEDULES = schedules
        found.redis.flushdb()
        found.redis.close()


def test_hostile_input_on_every_other_way_in_is_refused_or_made_into_a_valid_job(
    surfaces: Surfaces, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chosen = chosen_categories()
    try:
        if "task" in chosen:
            surfaces.run("task", batch_of(task_inputs()), surfaces.check_task, in_batches(TASK_SEEDS, 2))
        if "notify" in chosen:
            # The allow-list set for about half the examples, empty for the rest.
            surfaces.run("notify", lambda per: st.tuples(batch_of(notify_inputs())(per), st.booleans()),
                         surfaces.check_notify, [(NOTIFY_SEEDS, True), (NOTIFY_SEEDS, False)])
            django_settings.SCHEDULER_NOTIFY_ALLOWLIST = []
        if "admin_form" in chosen:
            surfaces.run("admin_form", batch_of(admin_inputs()), surfaces.check_admin, in_batches(ADMIN_SEEDS, 1))
        if "import_beat" in chosen:
            surfaces.run("import_beat", batch_of(beat_inputs(), lambda row: row.name), surfaces.check_beat,
                         in_batches(BEAT_SEEDS, 1))
        if "sync_jobs" in chosen:
            with override_settings(INSTALLED_APPS=[*django_settings.INSTALLED_APPS, "tests.codejobs"]):
                surfaces.run("sync_jobs", batch_of(sync_inputs()), surfaces.check_sync, in_batches(SYNC_SEEDS, 1))
    finally:
        report = {k: v for k, v in surfaces.tally.as_json().items() if k in chosen}
        out = tmp_path / "e2e_fuzz_surfaces_counts.json"
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False))
        with capsys.disabled():
            print(f"\ne2e fuzz of the other surfaces: {sum(c['tried'] for c in report.values())} inputs; "
                  f"counts in {out}")
            print(f"{'category':12} {'tried':>6} {'refused':>8} {'accepted':>9} {'problems':>9} {'seconds':>8}")
            for category, c in report.items():
                print(f"{category:12} {c['tried']:>6} {c['refused']:>8} {c['accepted']:>9} {c['problems']:>9} "
                      f"{c['seconds']:>8}")
            for category, c in report.items():
                for line in c["problems_of_each_kind"]:
                    print(f"  {category} problem: {line[:400]}")
            if os.environ.get("E2E_SURFACES_REFUSALS"):  # while working on the generators
                for category, c in report.items():
                    for line in c["common_refusals"]:
                        print(f"  {category} refused: {line}")
    failed = {k: v["failure"] or v["problems_of_each_kind"] for k, v in report.items() if v["problems"] or v["failure"]}
    assert not failed, "\n\n".join(f"{k}:\n{v}" for k, v in failed.items())
    short = {k: v["tried"] for k, v in report.items() if v["tried"] < inputs_wanted()}
    assert not short, f"categories with fewer than {inputs_wanted()} inputs: {short}"
