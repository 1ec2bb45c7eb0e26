"""Settings, read from the environment (see README's settings table).

With no DATABASE_URL the project runs on its embedded defaults: a SQLite file,
a file-system Celery broker and a single-node coordinator, all under var/.
Setting DATABASE_URL means the production layout, where SECRET_KEY is required
and DEBUG is refused.
"""
from __future__ import annotations

import os
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("SCHEDULER_DATA_DIR", BASE_DIR / "var"))


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {raw!r}") from exc


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ImproperlyConfigured(f"{name} must be 1 or 0, not {raw!r}")


def env_list(name: str, default: str = "") -> list[str]:
    return [part.strip() for part in env_str(name, default).split(",") if part.strip()]


def private_file(path: Path) -> Path:
    """Make `path` (if missing) readable and writable by this account only, from its
    first byte: created 0600, not written and then narrowed. An old one is narrowed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    path.chmod(0o600)
    return path


def embedded_secret_key() -> str:
    # The embedded mode makes one secret and keeps it, so sessions survive restarts.
    path = DATA_DIR / "secret_key"
    if not path.exists() or not path.read_text().strip():
        private_file(path).write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


def embedded_database() -> Path:
    # SQLite makes the -wal and -shm files with the database file's own mode, so a
    # private database file keeps its journal private too (tokens' hashes, secrets).
    path = private_file(DATA_DIR / "scheduler.sqlite3")
    for journal in ("scheduler.sqlite3-wal", "scheduler.sqlite3-shm"):
        if (DATA_DIR / journal).exists():
            (DATA_DIR / journal).chmod(0o600)
    return path


def database_from_url(url: str) -> dict:
    """dj-database-url's reading of DATABASE_URL, plus libpq's multi-host form, which it
    cannot parse: `postgres://user@h1:p1,h2:p2/db?target_session_attrs=read-write`
    becomes HOST "h1,h2" and PORT "p1,p2", handed to libpq as its host and port lists
    (it tries them in order and keeps the first that matches target_session_attrs)."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if "," not in hostlist:
        return dj_database_url.parse(url, conn_max_age=60, conn_health_checks=True)
    hosts, ports = [], []
    for item in hostlist.split(","):
        if item.startswith("["):  # [::1]:5432
            host, _, rest = item[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        if not host or (port and not port.isdigit()):
            raise ImproperlyConfigured(f"DATABASE_URL: {item!r} is not a host[:port] in its host list")
        hosts.append(host)
        ports.append(port or "5432")
    first = hostlist.split(",")[0]
    config = dj_database_url.parse(parts._replace(netloc=f"{userinfo}{at}{first}").geturl(), conn_max_age=60, conn_health_checks=True)
    config["HOST"], config["PORT"] = ",".join(hosts), ",".join(ports)
    return config


def database_link_options(config: dict, *, tcp_timeout: int, connect_timeout: int) -> dict:
    """libpq's bounds on a silent link, for a PostgreSQL config (database_from_url's):
    without them a process whose database host vanishes without a word (a partition,
    a dead host: no reset, no end of file) waits in its statement, or its connect,
    for the kernel's defaults, minutes to hours.

    - `tcp_user_timeout` (ms): bytes sent and not acknowledged for this long end the
      connection (a statement, a commit, a connect's handshake on a dead link).
    - TCP keepalives: a connection waiting for an answer, or idle in the pool, with
      nothing arriving for `tcp_timeout` seconds is probed, and ended when the
      probes go unanswered (with tcp_user_timeout set, Linux ends it once that much
      time has passed since the last byte came in). A long statement is not cut: the
      server's kernel answers the probes while the server works.
    - `connect_timeout` (s): the longest one try at a host may take (each host of a
      multi-host URL gets its own).

    A value in the URL's own query string wins (dj-database-url put it in OPTIONS).
    `tcp_timeout` 0 leaves keepalives and tcp_user_timeout to libpq's defaults;
    `connect_timeout` 0 leaves that one to libpq (no limit)."""
    if config.get("ENGINE") != "django.db.backends.postgresql":
        return config
    options = config.setdefault("OPTIONS", {})
    if tcp_timeout > 0:
        count = 3
        interval = max(1, tcp_timeout // 6)
        for key, value in (("keepalives", 1), ("keepalives_idle", max(1, tcp_timeout - count * interval)),
                           ("keepalives_interval", interval), ("keepalives_count", count),
                           ("tcp_user_timeout", tcp_timeout * 1000)):
            options.setdefault(key, value)
    if connect_timeout > 0:
        options.setdefault("connect_timeout", connect_timeout)
    return config


def env_seconds(name: str, default: int) -> int:
    value = env_int(name, default)
    if value < 0:
        raise ImproperlyConfigured(f"{name} must be 0 or more seconds, not {value}")
    return value


EMBEDDED = not env_str("DATABASE_URL")
# A database host that goes silent costs a statement at most this long, not the
# kernel's minutes (database_link_options; docs/deploy.md, "A silent database link").
SCHEDULER_DB_TCP_TIMEOUT = env_seconds("SCHEDULER_DB_TCP_TIMEOUT", 30)
SCHEDULER_DB_CONNECT_TIMEOUT = env_seconds("SCHEDULER_DB_CONNECT_TIMEOUT", 10)


if EMBEDDED:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": embedded_database(),
            "OPTIONS": {
                # Several processes share the file: wait for locks, take the
                # write lock up front, and let readers go on while one writes.
                "timeout": 30,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # The embedded tests' database is a file beside it, as the one they stand
            # for: Django's default in-memory one shares a cache between connections,
            # where a read while another thread writes is refused at once ("database
            # table is locked") instead of waiting as the file's readers and writers do.
            "TEST": {"NAME": str(DATA_DIR / "test_scheduler.sqlite3")},
        }
    }
    SECRET_KEY = env_str("SECRET_KEY") or embedded_secret_key()
else:
    DATABASES = {"default": database_link_options(database_from_url(env_str("DATABASE_URL")),
                                                  tcp_timeout=SCHEDULER_DB_TCP_TIMEOUT,
                                                  connect_timeout=SCHEDULER_DB_CONNECT_TIMEOUT)}
    if env_str("SCHEDULER_DB_APPLICATION_NAME"):
        # Names this process's connections in pg_stat_activity (the soak finds a worker's by it).
        DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = env_str("SCHEDULER_DB_APPLICATION_NAME")
    SECRET_KEY = env_str("SECRET_KEY")
    if not SECRET_KEY:
        raise ImproperlyConfigured(
            "SECRET_KEY is required when DATABASE_URL is set (the production layout)."
        )

DEBUG = env_str("DEBUG") == "1"
if DEBUG and not EMBEDDED:
    raise ImproperlyConfigured("DEBUG=1 is refused in the production layout (DATABASE_URL is set).")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]")
if not ALLOWED_HOSTS and not EMBEDDED:
    raise ImproperlyConfigured("ALLOWED_HOSTS must not be empty in the production layout.")

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "axes",  # admin login lockout (docs/security.md)
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI's assets, served locally: /api/docs/ works offline
    "jobs",
    "runs",
    "scanners",
    "receiver",  # the target-side helper; the built-in echo target uses it
    # django-celery-beat's tables, so `import_beat` can read a team's periodic tasks from
    # this database (docs/from-celery-beat.md); its admin pages come with it.
    "django_celery_beat",
]

MIDDLEWARE = [
    "scheduler_project.middleware.BodySizeLimitMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # admin and API docs assets, no web server needed
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "jobs.audit.AuditContextMiddleware",  # the caller's address, for audit entries
    "csp.middleware.CSPMiddleware",  # Content-Security-Policy (below)
    "scheduler_project.middleware.StoreUnavailableMiddleware",  # 503, not 500, while the store is down
    "axes.middleware.AxesMiddleware",  # last: answers a locked-out login attempt
]

# --- Login guessing (docs/security.md). The admin login: django-axes locks out a
# username, and separately an address, after SCHEDULER_LOGIN_FAILURES failed logins,
# for SCHEDULER_LOGIN_LOCKOUT seconds (a success resets the user's count). API tokens:
# jobs.authentication locks out an address after SCHEDULER_TOKEN_FAILURES bad tokens
# for SCHEDULER_TOKEN_LOCKOUT seconds (429 with Retry-After), counted in the cache.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
SCHEDULER_LOGIN_FAILURES = env_int("SCHEDULER_LOGIN_FAILURES", 10)
SCHEDULER_LOGIN_LOCKOUT = env_int("SCHEDULER_LOGIN_LOCKOUT", 900)
AXES_FAILURE_LIMIT = SCHEDULER_LOGIN_FAILURES
AXES_COOLOFF_TIME = timedelta(seconds=SCHEDULER_LOGIN_LOCKOUT)
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]  # each on its own: a user, and an address
AXES_RESET_ON_SUCCESS = True
AXES_CLIENT_IP_CALLABLE = "jobs.audit.client_address"  # the audit log's idea of the caller's address
AXES_VERBOSE = False
SCHEDULER_TOKEN_FAILURES = env_int("SCHEDULER_TOKEN_FAILURES", 20)
SCHEDULER_TOKEN_LOCKOUT = env_int("SCHEDULER_TOKEN_LOCKOUT", 300)

# --- Content-Security-Policy (django-csp) on every page: the admin and /api/docs/ load
# scripts, styles, images and fonts from the scheduler itself only; nothing inline may
# run (the docs page's start-up script is a separate request: urls.py), nothing may
# frame a page, no plug-ins. Styles allow 'unsafe-inline' because Swagger UI sets
# style attributes from its scripts (a style cannot run code).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'", "'unsafe-inline'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'self'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}

# --- Transport security (docs/security.md). The production layout is safe by default:
# secure cookies and HSTS; `check --deploy` is clean once TLS is in front
# (SCHEDULER_BEHIND_TLS_PROXY=1, or SCHEDULER_SSL_REDIRECT=1 when gunicorn itself
# serves TLS). Plain-http redirects stay off otherwise, so the test client and the
# embedded mode (one machine, http on loopback) keep working.
SCHEDULER_BEHIND_TLS_PROXY = env_bool("SCHEDULER_BEHIND_TLS_PROXY", False)
if SCHEDULER_BEHIND_TLS_PROXY:
    # Only trustworthy when the proxy sets (overwrites) X-Forwarded-Proto itself.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env_bool("SCHEDULER_SSL_REDIRECT", SCHEDULER_BEHIND_TLS_PROXY)
if not EMBEDDED:
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = env_bool("SCHEDULER_SECURE_COOKIES", True)
    SECURE_HSTS_SECONDS = env_int("SCHEDULER_HSTS_SECONDS", 365 * 24 * 3600)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SCHEDULER_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SCHEDULER_HSTS_PRELOAD", True)
X_FRAME_OPTIONS = "DENY"
# A failed CSRF check says why when Secure cookies meet plain http (scheduler_project/csrf.py).
CSRF_FAILURE_VIEW = "scheduler_project.csrf.csrf_failure"

ROOT_URLCONF = "scheduler_project.urls"
WSGI_APPLICATION = "scheduler_project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "scheduler_project.version.version_context",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"  # stored times are UTC; a job's zone lives on the job
FORMAT_MODULE_PATH = ["scheduler_project.formats"]  # the admin shows times as 2026-10-28T20:30:00Z
USE_I18N = True
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"
# Without collectstatic (the embedded mode, tests), serve assets straight from the apps.
WHITENOISE_USE_FINDERS = True
try:
    STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every start without it
except OSError:
    pass
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# One request body may be 1 MiB; the middleware answers 413 past that.
MAX_REQUEST_BODY_BYTES = 1024 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = MAX_REQUEST_BODY_BYTES
MAX_PAYLOAD_BYTES = 256 * 1024

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["jobs.authentication.ServiceTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_PAGINATION_CLASS": "jobs.pagination.StrictPageNumberPagination",  # ?page=x is a 400, not page 1
    "PAGE_SIZE": 50,
    "DEFAULT_THROTTLE_CLASSES": ["rest_framework.throttling.UserRateThrottle"],
    "DEFAULT_THROTTLE_RATES": {"user": env_str("SCHEDULER_API_THROTTLE", "600/min")},
    # drf-spectacular's, plus the 401/404/429... every operation can answer (jobs.api).
    "DEFAULT_SCHEMA_CLASS": "jobs.api.ApiSchema",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Job scheduler API",
    "DESCRIPTION": "Create jobs, read their runs. See docs/targets.md for what a target receives.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Self-contained assets (drf-spectacular-sidecar) instead of a CDN.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# The throttle counts requests per token in the cache; a shared cache in production.
REDIS_CACHE_URL = env_str("SCHEDULER_CACHE_URL")
CACHES = {
    "default": (
        {"BACKEND": "django.core.cache.backends.redis.RedisCache", "LOCATION": REDIS_CACHE_URL}
        if REDIS_CACHE_URL
        else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}
    )
}

# Celery: Redis in production, a file-system broker (no server) when embedded.
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL") or "filesystem://"
if CELERY_BROKER_URL == "filesystem://":
    _broker_dir = DATA_DIR / "broker"
    for _sub in ("in", "processed", "control"):
        (_broker_dir / _sub).mkdir(parents=True, exist_ok=True)
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_broker_dir / "in"),
        "data_folder_out": str(_broker_dir / "in"),
        "processed_folder": str(_broker_dir / "processed"),
        "control_folder": str(_broker_dir / "control"),
        "store_processed": False,
    }
if CELERY_BROKER_URL.startswith(("amqp", "pyamqp")):
    # RabbitMQ: a publish returns once the broker has taken the message (publisher
    # confirms), so a message the broker never took is an error the scanner sees (its
    # run stays queued and is published again), not a message lost without a word.
    CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
if CELERY_BROKER_URL.startswith("redis://"):
    # Kombu's Redis transport with a failed ack freeing its prefetch slot: without it a
    # Redis restart under load can leave a worker consuming nothing, for good
    # (scheduler_project/redis_transport.py).
    CELERY_BROKER_TRANSPORT = "scheduler_project.redis_transport:Transport"
CELERY_TASK_IGNORE_RESULT = True
# Celery's Django fix-up closes every database connection before and after each task
# unless this is set (it ignores CONN_MAX_AGE): each run message cost a worker child a
# new PostgreSQL backend, 23 a second in the soak at 155 runs/s (2026-12-02). Never
# recycled by count: scheduler_project/celery.py applies Django's own rule at each
# task's start and end instead (CONN_MAX_AGE, a connection that failed is dropped).
CELERY_DB_REUSE_MAX = 10**9
CELERY_TASK_ACKS_LATE = False  # the store, not the broker, decides who runs a run
CELERY_WORKER_PREFETCH_MULTIPLIER = 4
CELERY_TASK_DEFAULT_QUEUE = env_str("SCHEDULER_RUN_QUEUE", "runs")
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A worker that loses its broker connection keeps its calls in flight: the run tasks
# ack on receipt (above), and only late-acked tasks are cancelled. Celery 6's default,
# said here so that a connection loss does not warn about it.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
# No remote control (`celery inspect` / `celery control`, the pidbox): the project never
# broadcasts (a worker's heartbeat is a row, runs.workers), and on Redis the pidbox's
# channel is what made a worker exit when the broker restarted while it held prefetched
# messages (Celery 5.7 / kombu 5.7: "Unrecoverable error: AttributeError ... 'hostname'";
# tests/reliability/test_restarts.py). One Redis connection per worker fewer, too.
CELERY_WORKER_ENABLE_REMOTE_CONTROL = False
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# Celery task targets (runs.publishing): where a task job's run publishes its task.
# By default the scheduler's own broker; the embedded file-system broker works too,
# for a target worker on the same machine reading the same folder.
SCHEDULER_TASK_BROKER_URL = env_str("SCHEDULER_TASK_BROKER_URL") or CELERY_BROKER_URL
SCHEDULER_TASK_BROKER_TRANSPORT_OPTIONS = (
    dict(CELERY_BROKER_TRANSPORT_OPTIONS)
    if SCHEDULER_TASK_BROKER_URL == CELERY_BROKER_URL == "filesystem://"
    else {}
)

ZOOKEEPER_HOSTS = env_str("ZOOKEEPER_HOSTS")

# The store is a SQLite file (the embedded layout, or a sqlite:// DATABASE_URL): one
# writer, so its workers wait in the child, with no waiter threads, and the look-ahead
# that goes with them is shorter.
STORE_IS_SQLITE = DATABASES["default"]["ENGINE"].endswith("sqlite3")

# The scheduler's own knobs (the settings table in docs/reference.md).
SCHEDULER_LEASE_SECONDS = env_int("SCHEDULER_LEASE_SECONDS", 60)
SCHEDULER_SCAN_INTERVAL = float(env_str("SCHEDULER_SCAN_INTERVAL", "1") or 1)
# Seconds ahead of its due time a run may be queued and published: the scan, the
# publish, the broker and the worker's pickup happen before the run is due, and the
# worker waits for the due time, then claims it (the claim refuses a run not yet
# due by the store's clock). It also sets a steady stream's message size (a scan
# slices runs not yet due by half of it), and so what each run pays of a message's
# fixed cost. 0.5 on PostgreSQL, whose workers wait on waiter threads
# (SCHEDULER_WORKER_WAITERS): at about half the bench's highest rate, 0.1 made
# messages of a few dozen runs, and the scanner spent 2.7 times and PostgreSQL 1.5
# times the CPU a run they spend with 0.5 (docs/performance.md, "Where the time goes").
# 0.1 on the embedded SQLite file, where a waiting message holds its worker child.
# 0: off.
SCHEDULER_LOOKAHEAD = float(env_str("SCHEDULER_LOOKAHEAD", "0.1" if STORE_IS_SQLITE else "0.5") or 0)
if SCHEDULER_LOOKAHEAD < 0:
    raise ImproperlyConfigured(f"SCHEDULER_LOOKAHEAD must be 0 or more seconds, not {SCHEDULER_LOOKAHEAD}")
SCHEDULER_MISFIRE_GRACE = env_int("SCHEDULER_MISFIRE_GRACE", 60)
SCHEDULER_TARGET_ALLOWLIST = env_list("SCHEDULER_TARGET_ALLOWLIST")
SCHEDULER_API_THROTTLE = env_str("SCHEDULER_API_THROTTLE", "600/min")
SCHEDULER_TARGET_CONCURRENCY = env_int("SCHEDULER_TARGET_CONCURRENCY", 10)
# A run over the bulkhead waits about this many seconds (jittered) before it tries again.
SCHEDULER_BULKHEAD_WAIT = float(env_str("SCHEDULER_BULKHEAD_WAIT", "1") or 1)
# Where the bulkhead's slots live: `redis` (default when the broker is Redis: one
# round trip per batch) or `database` (rows in target_slots; the embedded default).
SCHEDULER_BULKHEAD = env_str("SCHEDULER_BULKHEAD") or ("redis" if CELERY_BROKER_URL.startswith("redis") else "database")
if SCHEDULER_BULKHEAD not in ("redis", "database"):
    raise ImproperlyConfigured(f"SCHEDULER_BULKHEAD must be redis or database, not {SCHEDULER_BULKHEAD!r}")
SCHEDULER_BULKHEAD_REDIS_URL = env_str("SCHEDULER_BULKHEAD_REDIS_URL") or CELERY_BROKER_URL
SCHEDULER_BULKHEAD_PREFIX = env_str("SCHEDULER_BULKHEAD_PREFIX") or "scheduler:bulkhead:"
# A target host's breaker opens after this many failed calls in a row, and lets one
# probe through after the cooldown (seconds, jittered).
SCHEDULER_BREAKER_FAILURES = env_int("SCHEDULER_BREAKER_FAILURES", 5)
SCHEDULER_BREAKER_COOLDOWN = env_int("SCHEDULER_BREAKER_COOLDOWN", 30)
# A timeout counts towards the host's breaker only when the job waited at least this
# long (seconds): a shorter `timeout` is the job's own choice, and must not open the
# breaker for the other services calling that host. The job's default timeout.
SCHEDULER_BREAKER_MIN_TIMEOUT = env_int("SCHEDULER_BREAKER_MIN_TIMEOUT", 30)
SCHEDULER_SIGNING_OVERLAP = env_str("SCHEDULER_SIGNING_OVERLAP", "24h")
# Limits (docs/security.md): jobs a service may have (deleted ones do not count), and
# the shortest gap a cron schedule may have between two runs ("1m": any 5-field cron).
SCHEDULER_MAX_JOBS_PER_SERVICE = env_int("SCHEDULER_MAX_JOBS_PER_SERVICE", 10000)
SCHEDULER_MIN_INTERVAL = env_str("SCHEDULER_MIN_INTERVAL", "1m")
# Ours: partitions are fixed for a deployment (a run's partition is stored on it).
SCHEDULER_PARTITIONS = env_int("SCHEDULER_PARTITIONS", 16)
# The runs history's partitions by time (PostgreSQL; runs.partitions): each spans
# SCHEDULER_RUN_PARTITION_WIDTH, the scanner holding partition 0 makes the one of now
# and SCHEDULER_RUN_PARTITIONS_AHEAD more ahead, and drops (with every other finished
# run and its events) what finished longer than SCHEDULER_RUN_RETENTION ago ("off":
# never; prune_runs by hand still works).
SCHEDULER_RUN_PARTITION_WIDTH = env_str("SCHEDULER_RUN_PARTITION_WIDTH", "1d")
SCHEDULER_RUN_PARTITIONS_AHEAD = env_int("SCHEDULER_RUN_PARTITIONS_AHEAD", 3)
SCHEDULER_RUN_RETENTION = env_str("SCHEDULER_RUN_RETENTION", "90d")
SCHEDULER_SCAN_BATCH = env_int("SCHEDULER_SCAN_BATCH", 500)
# Runs per run-queue message (at most SCHEDULER_TARGET_CONCURRENCY: one message's
# runs go to one host): a worker claims, calls and records them together.
SCHEDULER_DISPATCH_BATCH = env_int("SCHEDULER_DISPATCH_BATCH", 200)
# Calls one worker process keeps in flight at once (threads of its call pool, made
# as needed). As many as a batch holds, so that a batch to a slow host goes out in
# one round, not in several (docs/performance.md, "Slow targets, and a slow endpoint
# beside a fast one").
SCHEDULER_WORKER_CALLS = env_int("SCHEDULER_WORKER_CALLS", SCHEDULER_DISPATCH_BATCH)
# 1: a worker child that has waited 0.25 s for its batch's calls hands those still in
# flight to its process's writer thread and goes back for its next message, so a target
# that hangs never holds a child (runs.flights). Off by default: at the highest rate on
# a 2-core VM it cost about a third of the throughput (docs/reliability.md).
SCHEDULER_WORKER_DETACH = env_str("SCHEDULER_WORKER_DETACH", "0") == "1"
# Detached workers only: calls one service may have in flight for over 2 s in one worker process (runs.flights):
# past it, that service's further runs wait a moment (`service_share_wait`, no try spent)
# while other services' runs are called; quick calls never count. 0: half of
# SCHEDULER_WORKER_CALLS.
SCHEDULER_SERVICE_CALLS = env_int("SCHEDULER_SERVICE_CALLS", 0)
if SCHEDULER_SERVICE_CALLS < 0:
    raise ImproperlyConfigured(f"SCHEDULER_SERVICE_CALLS must be 0 or more, not {SCHEDULER_SERVICE_CALLS}")
# Threads a worker process gives the run messages that must wait for their due times
# (the look-ahead), so that the process takes its next message meanwhile
# (runs.waiters). Each has its own database connection. 0: the process waits itself;
# the default on SQLite, whose one writer gains nothing from more threads. 1 on
# PostgreSQL: Celery's prefork parent gives each message to the first child that is
# not busy, and a child that hands its message off is not busy, so with more waiters
# one child took nearly every message and its process ran most batches under one GIL
# (77 to 88% of the worker's CPU at 900 runs/s); with one, a child whose waiter is
# busy works its next message itself, and the one after goes to another child
# (docs/performance.md, "Settings that tune throughput").
SCHEDULER_WORKER_WAITERS = env_int(
    "SCHEDULER_WORKER_WAITERS", 0 if STORE_IS_SQLITE else 1)
if SCHEDULER_WORKER_WAITERS < 0:
    raise ImproperlyConfigured(f"SCHEDULER_WORKER_WAITERS must be 0 or more, not {SCHEDULER_WORKER_WAITERS}")
# Seconds between the GIL's hand-overs in a worker child (sys.setswitchinterval;
# CPython's default is 0.005): a waiter thread whose wave is due waits at most about
# this long for a thread running Python (scheduler_project/celery.py). 0: CPython's.
SCHEDULER_WORKER_SWITCH_INTERVAL = float(env_str("SCHEDULER_WORKER_SWITCH_INTERVAL", "0.001") or 0)
if SCHEDULER_WORKER_SWITCH_INTERVAL < 0:
    raise ImproperlyConfigured("SCHEDULER_WORKER_SWITCH_INTERVAL must be 0 or more seconds, "
                               f"not {SCHEDULER_WORKER_SWITCH_INTERVAL}")
# A scanner stops queueing while this many of its partitions' runs wait queued and
# unclaimed: due runs stay `scheduled` in the store (the truth) instead of piling up
# in the broker, where they would be published again after SCHEDULER_REQUEUE_AFTER.
SCHEDULER_MAX_QUEUED = env_int("SCHEDULER_MAX_QUEUED", 5000)
# Of those, one service's (the jobs of one owner) at most this many, give or take a
# scan batch: past it the scanner steps over that service's due runs and queues other
# services' (scanners.scan.scan_once), so one service's burst of due runs waits in the
# store, behind its own runs, not in the broker ahead of everyone's. A service's runs
# queued past its first SCHEDULER_DISPATCH_BATCH (or this, if less) go on the run
# queue's slow lane (a broker priority: Redis), behind other services' messages.
# 0: no share and one lane (one service may fill SCHEDULER_MAX_QUEUED).
SCHEDULER_SERVICE_QUEUED = env_int("SCHEDULER_SERVICE_QUEUED", 1000)
if SCHEDULER_SERVICE_QUEUED < 0:
    raise ImproperlyConfigured(f"SCHEDULER_SERVICE_QUEUED must be 0 or more, not {SCHEDULER_SERVICE_QUEUED}")
# A queued run no worker has claimed after this long is published again
# (its message may have been lost: Redis keeps nothing on disk).
SCHEDULER_REQUEUE_AFTER = env_int("SCHEDULER_REQUEUE_AFTER", 30)
# The scanner holding partition 0 runs `VACUUM (SKIP_LOCKED) runs_open` once this many
# runs have been queued since the last one (or a tenth of the open runs, if that is
# more), on a connection of its own: the dead entries every run leaves in the open
# runs' due index are what the scanner's due reads step over (scanners.vacuum). 0
# leaves the table to autovacuum alone. PostgreSQL only.
SCHEDULER_OPEN_RUNS_VACUUM_AFTER = env_int("SCHEDULER_OPEN_RUNS_VACUUM_AFTER", 10000)
# Seconds between a worker's heartbeats (runs.workers); three missed ones show it as gone.
SCHEDULER_WORKER_HEARTBEAT = env_int("SCHEDULER_WORKER_HEARTBEAT", 5)
SCHEDULER_ZK_ROOT = env_str("SCHEDULER_ZK_ROOT", "/scheduler")
SCHEDULER_ZK_SESSION_TIMEOUT = float(env_str("SCHEDULER_ZK_SESSION_TIMEOUT", "10") or 10)
# Accepted and ignored: the coordinator no longer waits for the membership to
# settle (scanners/coordination.py); kept so old environments still start.
SCHEDULER_ZK_TIME_BOUNDARY = float(env_str("SCHEDULER_ZK_TIME_BOUNDARY", "2") or 2)
SCHEDULER_BACKFILL_MAX_RUNS = env_int("SCHEDULER_BACKFILL_MAX_RUNS", 10000)
SCHEDULER_MISFIRE_MAX_SKIPPED = env_int("SCHEDULER_MISFIRE_MAX_SKIPPED", 1000)
# Most `skipped` rows (reason `excluded`) one next-run decision writes for the times on
# a job's excluded dates; the rest are counted on the last one's event (docs/architecture.md).
SCHEDULER_EXCLUDE_MAX_SKIPPED = env_int("SCHEDULER_EXCLUDE_MAX_SKIPPED", 100)
SCHEDULER_ENCRYPTION_KEY = env_str("SCHEDULER_ENCRYPTION_KEY")
# Set: GET /metrics needs "Authorization: Bearer <token>"; unset: /metrics is open.
SCHEDULER_METRICS_TOKEN = env_str("SCHEDULER_METRICS_TOKEN")

# The receiver helper (target side, receiver.views.idempotent_run): when secrets are
# set it refuses calls without a valid X-Signature (two during a rotation).
RECEIVER_SIGNING_SECRETS = env_list("RECEIVER_SIGNING_SECRETS")
RECEIVER_SIGNATURE_TOLERANCE = env_int("RECEIVER_SIGNATURE_TOLERANCE", 300)



def email_settings(url: str) -> dict[str, object]:
    """EMAIL_URL -> Django's EMAIL_* settings.

        smtp://user:pass@host:587          plain SMTP (port 25 by default)
        smtp://user:pass@host:587?tls=1    STARTTLS after connecting
        smtps://user:pass@host             TLS from the first byte (port 465 by default)
        ...?timeout=10                     seconds per SMTP operation (default 10)

    The user and password are percent-decoded (`p%40ss` is `p@ss`). Hand-written
    (urllib.parse): dj-email-url reads `smtps://` as STARTTLS and deprecates it.
    """
    from urllib.parse import parse_qs, unquote, urlsplit

    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("smtp", "smtps"):
        raise ImproperlyConfigured(f"EMAIL_URL must start with smtp:// or smtps://, not {scheme or 'nothing'}://")
    try:
        port = parts.port
    except ValueError as exc:
        raise ImproperlyConfigured("EMAIL_URL has a port that is not a number from 1 to 65535") from exc
    if not parts.hostname:
        raise ImproperlyConfigured("EMAIL_URL names no host, e.g. smtp://user:pass@mail.internal:587")
    query = {key.lower(): values[-1].strip().lower() for key, values in parse_qs(parts.query).items()}
    for key in query:
        if key not in ("tls", "timeout"):
            raise ImproperlyConfigured(f"EMAIL_URL has an unknown option {key!r}: only tls and timeout are read")
    tls = query.get("tls", "0") in ("1", "true", "yes", "on")
    timeout = query.get("timeout", "10")
    if not timeout.isdigit() or int(timeout) < 1:
        raise ImproperlyConfigured("EMAIL_URL's timeout must be a whole number of seconds, at least 1")
    return {
        "EMAIL_BACKEND": "django.core.mail.backends.smtp.EmailBackend",
        "EMAIL_HOST": parts.hostname,
        "EMAIL_PORT": port or (465 if scheme == "smtps" else 25),
        "EMAIL_HOST_USER": unquote(parts.username or ""),
        "EMAIL_HOST_PASSWORD": unquote(parts.password or ""),
        "EMAIL_USE_SSL": scheme == "smtps",
        "EMAIL_USE_TLS": scheme == "smtp" and tls,
        "EMAIL_TIMEOUT": int(timeout),
    }


# Dead-run (and skipped-run) notices by e-mail: on when EMAIL_URL (or, as before,
# EMAIL_BACKEND) is set; off otherwise, and an e-mail notice is only logged.
EMAIL_URL = env_str("EMAIL_URL")
if EMAIL_URL:
    globals().update(email_settings(EMAIL_URL))
else:
    EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
SCHEDULER_EMAIL_ENABLED = bool(EMAIL_URL or env_str("EMAIL_BACKEND"))
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "scheduler@localhost")
# Notices (runs.notices): one per job per SCHEDULER_NOTIFY_DIGEST at most, listing
# the runs since the last one; a notice that fails is tried again with backoff
# (from SCHEDULER_NOTIFY_RETRY_BASE, doubling, up to 1h) SCHEDULER_NOTIFY_TRIES times.
SCHEDULER_NOTIFY_DIGEST = env_str("SCHEDULER_NOTIFY_DIGEST", "5m")
SCHEDULER_NOTIFY_RETRY_BASE = env_str("SCHEDULER_NOTIFY_RETRY_BASE", "30s")
SCHEDULER_NOTIFY_TRIES = env_int("SCHEDULER_NOTIFY_TRIES", 10)
SCHEDULER_NOTIFY_TIMEOUT = env_int("SCHEDULER_NOTIFY_TIMEOUT", 10)
# Where a `notify` may point: e-mail domains and webhook host patterns (fnmatch, like
# SCHEDULER_TARGET_ALLOWLIST), checked when a job is saved and when a notice is sent.
# Empty: any. And how many notices (digests) one service may have sent in an hour;
# past it they wait, counted (/metrics: scheduler_notices_held_total).
SCHEDULER_NOTIFY_ALLOWLIST = env_list("SCHEDULER_NOTIFY_ALLOWLIST")
SCHEDULER_NOTIFY_PER_HOUR = env_int("SCHEDULER_NOTIFY_PER_HOUR", 60)
# Extra CA certificates (a PEM file) trusted for https targets and webhooks, besides
# certifi's: an internal CA. Unset: certifi's only.
SCHEDULER_TLS_CA_FILE = env_str("SCHEDULER_TLS_CA_FILE")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "scheduler": {"handlers": ["console"], "level": env_str("SCHEDULER_LOG_LEVEL", "INFO")},
    },
}

# Benches only (bench/run.py beat): the side-by-side with celery beat's DatabaseScheduler.
if env_str("SCHEDULER_BENCH_BEAT") == "1":
    CELERY_IMPORTS = ["bench.beat_tasks"]
