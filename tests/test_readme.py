"""The README's curl example works as written against a running server."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.django_db(transaction=True)


def readme_block(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split(heading, 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def json_documents(text: str) -> list[Any]:
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


@pytest.mark.skipif(connection.vendor != "postgresql", reason="runs once, on the production layout")
def test_the_readme_curl_example_works_as_written(live_server: Any) -> None:
    db = connection.settings_dict
    env = dict(os.environ, BASE=live_server.url)
    env["DATABASE_URL"] = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_block("## Try the API")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job, run, dead = json_documents(done.stdout)
    assert job["id"].startswith("job_") and job["timezone"] == "Asia/Kolkata"
    assert job["next_run"]["scheduled_for"].endswith("T20:30:00Z")
    assert run["id"].startswith("run_") and run["status"] == "scheduled"
    assert [e["type"] for e in run["events"]] == ["scheduled"]
    assert dead["count"] == 0 and dead["results"] == []
