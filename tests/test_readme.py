"""The README's commands, copied exactly: "Two commands" starts the quickstart (with
`--port 8100`, or a free port when 8100 is taken), and every step of "Try the API" gives what the README says."""
from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.integration.quickstart import ROOT, Quickstart, readme_blocks, readme_section

pytestmark = [pytest.mark.integration, pytest.mark.embedded]
embedded_only = pytest.mark.skipif(
    bool(os.environ.get("DATABASE_URL")), reason="runs in the embedded pass of scripts/test.sh"
)


def json_documents(text: str) -> list[Any]:
    decoder, docs, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        doc, i = decoder.raw_decode(text, i)
        docs.append(doc)
    return docs


def said_timeline() -> list[str]:
    """The event types the README says the run's timeline holds, in its order."""
    prose = readme_section("## Try the API").split("whole timeline:", 1)[1].split(".", 1)[0]
    return re.findall(r"`(\w+)`", prose)


def readme_port() -> int | None:
    """8100, the port the issue's newcomer tried (`--port 8100`), when it is free here;
    else any free port (None), so a busy machine does not fail the test."""
    import socket

    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", 8100))
        except OSError:
            return None
    return 8100


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Quickstart]:
    if os.environ.get("DATABASE_URL"):
        pytest.skip("runs in the embedded pass of scripts/test.sh")
    here = tmp_path_factory.mktemp("quickstart")
    started = Quickstart(here / "var", here / "quickstart.log", port=readme_port())
    try:
        started.wait_running()
        yield started
    finally:
        started.stop()


@embedded_only
def test_every_step_of_try_the_api_gives_what_the_readme_says(quickstart: Quickstart) -> None:
    (block,) = readme_blocks("## Try the API")
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=ROOT, env=dict(quickstart.env, BASE=quickstart.base), capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    job, run, dead = json_documents(done.stdout)
    # The first call: the job, its id and its next run, 02:00 in Kolkata as 20:30Z the day before.
    assert job["id"].startswith("job_") and job["timezone"] == "Asia/Kolkata"
    assert job["target"] == f"{quickstart.base}/demo/echo/"
    assert job["next_run"]["scheduled_for"].endswith("T20:30:00Z")
    # The one-off's run, read once the loop saw it succeed: its whole timeline, as listed.
    assert said_timeline() == ["scheduled", "queued", "claimed", "target_answered", "succeeded"]
    assert run["id"].startswith("run_") and run["status"] == "succeeded"
    assert [e["type"] for e in run["events"]] == said_timeline()
    claimed = next(e for e in run["events"] if e["type"] == "claimed")
    assert {"fence", "worker"} <= set(claimed["detail"])
    # The dead list is empty.
    assert '"count":0' in readme_section("## Try the API")
    assert dead["count"] == 0 and dead["results"] == []


@embedded_only
def test_every_url_the_quickstart_prints_answers(quickstart: Quickstart) -> None:
    out = quickstart.output()
    urls = sorted(set(re.findall(rf"{re.escape(quickstart.base)}/[^\s)]*", out)))
    assert {f"{quickstart.base}/admin/", f"{quickstart.base}/api/", f"{quickstart.base}/api/docs/"} <= set(urls), out
    assert any(re.search(r"/admin/runs/run/\d+/change/$", u) for u in urls), out
    token = (Path(quickstart.env["SCHEDULER_DATA_DIR"]) / "api-token").read_text().strip()
    for url in urls:
        answer = requests.get(url, headers={"Authorization": f"Token {token}"}, timeout=10)
        assert answer.status_code == 200, (url, answer.status_code, answer.text[:200])


@embedded_only
def test_the_api_index_lists_working_links_and_the_root_sends_a_browser_to_the_admin(quickstart: Quickstart) -> None:
    index = requests.get(f"{quickstart.base}/api/", timeout=10)
    assert index.status_code == 200
    links = index.json()["links"]
    assert set(links) >= {"jobs", "runs", "dead_runs", "breakers", "audit", "schema", "docs"}
    token = (Path(quickstart.env["SCHEDULER_DATA_DIR"]) / "api-token").read_text().strip()
    for name, url in links.items():
        assert requests.get(url, headers={"Authorization": f"Token {token}"}, timeout=10).status_code == 200, name
    home = requests.get(f"{quickstart.base}/", allow_redirects=False, timeout=10)
    assert home.status_code == 302 and home.headers["Location"] == "/admin/"
    bearer = requests.get(f"{quickstart.base}/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert bearer.status_code == 401 and bearer.headers["WWW-Authenticate"] == "Token"
    assert bearer.json() == {"detail": "This API's scheme is Token, not Bearer: send `Authorization: Token <token>`."}
