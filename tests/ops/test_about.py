"""The version in its three places, and `about`'s view of the settings in use."""
from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import call_command
from django.test import override_settings
from rest_framework.test import APIClient

from scheduler_project.version import VERSION

pytestmark = [pytest.mark.django_db, pytest.mark.embedded]


def test_the_version_shows_in_about_the_api_index_and_the_admin_footer(admin_client) -> None:
    out = StringIO()
    call_command("about", stdout=out)
    assert out.getvalue().splitlines()[0] == f"django-job-scheduler {VERSION}"
    assert APIClient().get("/api/").json()["version"] == VERSION
    page = admin_client.get("/admin/").content.decode()
    assert f"Scheduler {VERSION}" in page and 'id="footer"' in page


@override_settings(ZOOKEEPER_HOSTS="zk1.internal:2181,zk2.internal:2181",
                   CELERY_BROKER_URL="redis://:s3cret@redis.internal:6379/0",
                   SCHEDULER_TASK_BROKER_URL="amqp://tasks:pa55@mq.internal:5672//")
def test_about_names_the_coordinator_broker_and_store_without_passwords() -> None:
    out = StringIO()
    call_command("about", stdout=out)
    text = out.getvalue()
    assert "coordinator  zookeeper zk1.internal:2181,zk2.internal:2181" in text
    assert "redis.internal:6379/0" in text and "mq.internal:5672" in text
    assert "s3cret" not in text and "pa55" not in text
    assert "store" in text and "django" in text
