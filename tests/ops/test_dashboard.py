"""The dashboard at the top of /admin/: a dead run, a late run and an open breaker each
show on the next load of the page, with a link that lands on exactly those runs; the
figures come from the open runs and the rollups, in a bounded number of queries."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from runs import events
from runs.models import Run, TargetBreaker
from tests.factories import make_run
from tests.ops.conftest import ago, dead_run, new_job
from tests.ops.test_query_counts import count_queries, many_runs

pytestmark = pytest.mark.django_db
S = Run.Status


def count_on(page: str, key: str) -> tuple[int, str]:
    found = re.search(rf'<a href="([^"]+)" id="count-{key}"[^>]*>\s*<span class="n">(\d+)</span>', page)
    assert found, f"no count {key} on the dashboard"
    return int(found.group(2)), found.group(1).replace("&amp;", "&")


def listed(client: Client, url: str) -> set[str]:
    page = client.get(url).content.decode()
    return set(re.findall(r">(run_\d+)<", page))


def test_a_dead_run_a_late_run_and_an_open_breaker_show_on_the_next_load_with_links_to_exactly_them(
    operator_client: Client, owner: Any
) -> None:
    job = new_job(owner)
    page = operator_client.get("/admin/").content.decode()
    assert count_on(page, "dead")[0] == 0 and count_on(page, "late")[0] == 0 and count_on(page, "breaker")[0] == 0

    dead = dead_run(job, ago(minutes=30))
    handled = dead_run(job, ago(minutes=40))
    Run.objects.filter(pk=handled.pk).update(handled_at=timezone.now(), handled_by="olga")
    late = make_run(job, ago(minutes=20), status=S.QUEUED, is_backfill=True)
    make_run(job, ago(seconds=5), status=S.QUEUED, is_backfill=True)  # queued, not late
    down = new_job(owner, name="down", target="https://down.test:8443/hook")
    probe_at = timezone.now() + timedelta(seconds=30)
    # A worker sent this run back to wait for the breaker's probe (runs.services._defer_many)...
    waiting = Run.objects.get(job=down, status=S.SCHEDULED)
    Run.objects.filter(pk=waiting.pk).update(due_at=probe_at)
    # ...while this one, on the same host, is not due until tomorrow: not held by the breaker.
    make_run(down, timezone.now() + timedelta(days=1), is_backfill=True)
    TargetBreaker.objects.create(host="down.test:8443", state="open", failures=5, opened_at=timezone.now(),
                                 next_probe_at=probe_at)

    page = operator_client.get("/admin/").content.decode()
    n, url = count_on(page, "dead")
    assert n == 1 and listed(operator_client, url) == {dead.public_id}
    n, url = count_on(page, "late")
    assert n == 1 and listed(operator_client, url) == {late.public_id}
    n, url = count_on(page, "breaker")
    assert n == 1 and listed(operator_client, url) == {waiting.public_id}
    # The breaker's host row links to its held runs too, and says it is open.
    row = re.search(r'<tr class="breaker-open"><td><a href="([^"]+)"><code>down.test:8443</code>', page)
    assert row and listed(operator_client, row.group(1).replace("&amp;", "&")) == {waiting.public_id}
    assert '<span class="badge badge-open">open</span>' in page
    # The death is in the day's figures (from the rollup written with the `dead` event).
    assert "0 succeeded, 2 dead" in page


def test_the_running_queued_due_and_held_counts_link_to_exactly_those_runs(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    running = make_run(job, ago(minutes=1), status=S.RUNNING, is_backfill=True, started_at=ago(seconds=30))
    queued = make_run(job, ago(seconds=2), status=S.QUEUED, is_backfill=True)
    soon = make_run(job, timezone.now() + timedelta(seconds=30), is_backfill=True)
    held = make_run(job, ago(minutes=3), held=True, is_backfill=True)
    page = operator_client.get("/admin/").content.decode()
    for key, run in (("running", running), ("queued", queued), ("due", soon), ("held", held)):
        n, url = count_on(page, key)
        assert n == 1 and listed(operator_client, url) == {run.public_id}, key


def test_the_dashboard_shows_starts_and_success_rate_from_the_rollups(operator_client: Client, owner: Any) -> None:
    job = new_job(owner)
    now = timezone.now()
    runs = [make_run(job, ago(minutes=m), status=S.QUEUED, is_backfill=True) for m in (2, 3, 4)]
    events.record_many([events.event(r.pk, "claimed", now, fence=1) for r in runs], runs={r.pk: r for r in runs})
    events.record_many([events.event(r.pk, "succeeded", now) for r in runs[:2]])
    events.record_many([events.event(runs[2].pk, "dead", now, reason="x")])
    page = operator_client.get("/admin/").content.decode()
    assert "66.7%" in page and "(2 succeeded, 1 dead)" in page
    assert "runs started per minute" in page and "<svg" in page
    assert re.search(r"<title>[0-9T:-]+Z 3</title>", page)  # this minute's bar: three starts


def test_a_read_only_person_sees_the_dashboard_and_nobody_outside_the_groups_does(viewer_client: Client) -> None:
    assert 'id="dashboard"' in viewer_client.get("/admin/").content.decode()


@pytest.mark.parametrize("url", ["/admin/", "/admin/system/", "/metrics"])
def test_the_dashboard_the_system_page_and_metrics_run_a_bounded_number_of_queries(
    operator_client: Client, owner: Any, url: str
) -> None:
    many_runs(owner, 10)
    TargetBreaker.objects.create(host="host1.test:801", state="open", failures=3)
    few = count_queries(operator_client, url)
    many_runs(owner, 1000)
    many = count_queries(operator_client, url)
    print(f"{url}: {few} queries with 10 runs, {many} with 1010")
    assert many == few and many <= 15, (few, many)
