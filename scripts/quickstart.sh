#!/usr/bin/env bash
# The scheduler on its embedded defaults, on a fresh machine: `bash scripts/quickstart.sh [--port N]`.
# Makes .venv, installs requirements.txt, then runs `python manage.py embedded`
# (API + admin, a scanner and a worker on SQLite, a file broker and a single-node
# coordinator), which shows a demo run go from schedule to done. Ctrl-C stops it;
# the processes' own output goes to var/embedded.log.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.runtime-requirements.sha
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.txt
  echo "$want" >"$stamp"
fi
# The embedded mode is what runs without DATABASE_URL; refuse to mix it with a production setting.
unset DATABASE_URL CELERY_BROKER_URL ZOOKEEPER_HOSTS
exec .venv/bin/python manage.py embedded "$@"
