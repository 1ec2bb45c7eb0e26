"""A Content-Security-Policy on the admin and the API docs page: scripts only from the
scheduler itself, no inline script, no framing, no plug-ins. (That the pages still
render under it in a real browser is tests/ops/test_browser.py's
test_the_admin_and_the_api_docs_render_under_the_content_security_policy.)"""
from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)(?![^>]*type=\"application/json\")[^>]*>\s*\S", re.I)


def policy(response: Any) -> dict[str, list[str]]:
    header = response.get("Content-Security-Policy", "")
    directives = [part.strip().split() for part in header.split(";") if part.strip()]
    return {d[0]: d[1:] for d in directives}


def assert_strict(found: dict[str, list[str]]) -> None:
    assert found.get("default-src") == ["'self'"]
    assert found.get("script-src") == ["'self'"]  # no inline script, no eval, no CDN
    assert found.get("object-src") == ["'none'"] and found.get("frame-ancestors") == ["'none'"]
    assert found.get("base-uri") == ["'self'"] and found.get("form-action") == ["'self'"]


def test_the_admin_pages_carry_a_strict_policy(superuser: Any) -> None:
    client = Client()
    login = client.get("/admin/login/")
    assert_strict(policy(login))
    client.force_login(superuser)
    for path in ("/admin/", "/admin/jobs/job/", "/admin/jobs/job/add/", "/admin/system/"):
        response = client.get(path)
        assert response.status_code == 200, path
        assert_strict(policy(response))
        assert not INLINE_SCRIPT.search(response.content.decode()), path


def test_the_api_docs_page_carries_a_strict_policy_and_loads_its_script_from_a_url() -> None:
    page = Client().get("/api/docs/")

    assert page.status_code == 200
    assert_strict(policy(page))
    html = page.content.decode()
    assert not INLINE_SCRIPT.search(html)  # Swagger UI's start-up script is a separate request
    script = re.search(r'<script src="(/api/docs/\?[^"]*script[^"]*)"', html)
    assert script, html
    init = Client().get(script.group(1).replace("&amp;", "&"))
    assert init.status_code == 200 and "SwaggerUIBundle" in init.content.decode()
