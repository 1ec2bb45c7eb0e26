"""DATABASE_URL in libpq's multi-host form (a primary and its standbys), which
dj-database-url alone cannot parse: the hosts and ports reach libpq as its lists,
the query string (target_session_attrs) as connection options."""
from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from scheduler_project.settings import database_from_url


def test_a_url_naming_two_hosts_gives_libpq_both_hosts_and_ports_and_target_session_attrs() -> None:
    config = database_from_url("postgres://sched:pw@10.0.0.1:5433,10.0.0.2:5434/sched"
                               "?target_session_attrs=read-write&connect_timeout=3")

    assert (config["HOST"], config["PORT"]) == ("10.0.0.1,10.0.0.2", "5433,5434")
    assert (config["USER"], config["PASSWORD"], config["NAME"]) == ("sched", "pw", "sched")
    assert config["OPTIONS"] == {"target_session_attrs": "read-write", "connect_timeout": 3}
    assert config["ENGINE"] == "django.db.backends.postgresql" and config["CONN_MAX_AGE"] == 60


def test_a_host_without_a_port_in_the_list_gets_the_default_port_and_ipv6_hosts_keep_their_brackets_off() -> None:
    config = database_from_url("postgres://sched@[::1]:5433,db2.internal/sched")

    assert (config["HOST"], config["PORT"]) == ("::1,db2.internal", "5433,5432")


def test_a_single_host_url_reads_as_dj_database_url_reads_it() -> None:
    config = database_from_url("postgres://postgres@127.0.0.1:5432/sched?target_session_attrs=read-write")

    assert (config["HOST"], config["PORT"], config["NAME"]) == ("127.0.0.1", 5432, "sched")
    assert config["OPTIONS"] == {"target_session_attrs": "read-write"}


def test_a_host_list_with_a_bad_port_is_refused_naming_it() -> None:
    with pytest.raises(ImproperlyConfigured, match="'db2:five' is not a host"):
        database_from_url("postgres://sched@db1:5432,db2:five/sched")
