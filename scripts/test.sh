#!/usr/bin/env bash
# The whole test suite, on a fresh machine: `bash scripts/test.sh [pytest args]`.
# Makes the virtualenv, installs the pinned requirements, makes sure PostgreSQL
# and Redis are up (starts them if not), installs and starts a ZooKeeper on
# loopback, runs pytest on the production layout (PostgreSQL, Redis, ZooKeeper),
# then the `embedded` tests again on the embedded defaults (SQLite, file broker,
# single-node coordinator). Stops only the ZooKeeper it started.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

log() { printf '== %s\n' "$*"; }

# 1. Python environment.
if [ ! -x .venv/bin/python ]; then
  log "creating .venv"
  python3 -m venv .venv
fi
stamp=.venv/.requirements.sha
want=$(cat requirements.txt requirements-dev.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing requirements-dev.txt"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements-dev.txt
  echo "$want" >"$stamp"
fi

# 2. PostgreSQL and Redis (the machine's own; started here only if they are down).
if ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  log "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
  for _ in $(seq 100); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 0.2; done
fi
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  log "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
  for _ in $(seq 100); do redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && break; sleep 0.1; done
fi

# 3. Headless Chromium for the admin's browser tests (Debian's package; Playwright only drives it).
if ! command -v chromium >/dev/null; then
  log "installing chromium"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi

# 4. ZooKeeper, ours, on a port of its own.
ZK_PORT=${ZK_PORT:-21810}
export ZK_DIR=${ZK_DIR:-/tmp/scheduler-zookeeper-test-$ZK_PORT}
log "starting ZooKeeper on 127.0.0.1:$ZK_PORT"
scripts/zookeeper.sh start "$ZK_PORT" "$ZK_DIR"
cleanup() { scripts/zookeeper.sh stop "$ZK_PORT" "$ZK_DIR" || true; }
trap cleanup EXIT

# 5. The production layout.
export DATABASE_URL=${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/scheduler}
export SECRET_KEY=${SECRET_KEY:-test-only-secret-key-not-for-production-0123456789abcdef}
export CELERY_BROKER_URL=${TEST_BROKER_URL:-redis://127.0.0.1:6379/11}
export ZOOKEEPER_HOSTS=127.0.0.1:$ZK_PORT
export ZK_SCRIPT="$ROOT/scripts/zookeeper.sh" ZK_PORT
export PYTHONDONTWRITEBYTECODE=1
log "pytest: production layout (PostgreSQL, Redis, ZooKeeper)"
# The whole suite says where its time goes: the 30 slowest tests, at the end of the log.
durations=()
if [ $# -eq 0 ]; then durations=(--durations=30); fi
.venv/bin/pytest "${durations[@]}" "$@"

# 6. The embedded defaults: no DATABASE_URL, broker or coordinator settings.
embedded_dir=$(mktemp -d /tmp/scheduler-embedded-XXXXXX)
log "pytest: embedded defaults (SQLite in $embedded_dir)"
env -u DATABASE_URL -u CELERY_BROKER_URL -u ZOOKEEPER_HOSTS -u SECRET_KEY \
  SCHEDULER_DATA_DIR="$embedded_dir" .venv/bin/pytest -m embedded "$@" || rc=$?
rm -rf "$embedded_dir"
# 5 is pytest's "no tests collected": a narrowed run (a file given) may hold no embedded test.
if [ "${rc:-0}" -ne 0 ] && { [ "${rc:-0}" -ne 5 ] || [ $# -eq 0 ]; }; then exit "$rc"; fi
