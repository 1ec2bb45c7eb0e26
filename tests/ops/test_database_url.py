"""DATABASE_URL in libpq's multi-host form (a primary and its standbys), which
dj-database-url alone cannot parse: the hosts and ports reach libpq as its lists,
the query string (target_session_attrs) as connection options."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from scheduler_project.settings import database_from_url, database_link_options

ROOT = Path(__file__).resolve().parents[2]


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


# --- Bounds on a silent link (database_link_options): libpq's keepalives,
# tcp_user_timeout and connect_timeout, from SCHEDULER_DB_TCP_TIMEOUT and
# SCHEDULER_DB_CONNECT_TIMEOUT; the URL's own query string wins.

def test_a_postgresql_url_gets_keepalives_and_tcp_user_timeout_that_end_a_silent_link_within_the_timeout() -> None:
    config = database_link_options(database_from_url("postgres://sched@db1:5432/sched"),
                                   tcp_timeout=30, connect_timeout=10)

    options = config["OPTIONS"]
    assert options == {"keepalives": 1, "keepalives_idle": 15, "keepalives_interval": 5, "keepalives_count": 3,
                       "tcp_user_timeout": 30000, "connect_timeout": 10}
    # The last probe goes unanswered no later than the timeout.
    idle, interval, count = options["keepalives_idle"], options["keepalives_interval"], options["keepalives_count"]
    assert idle + interval * count <= 30


def test_a_short_timeout_still_gives_whole_second_keepalives_of_at_least_one_second() -> None:
    options = database_link_options(database_from_url("postgres://sched@db1/sched"), tcp_timeout=4,
                                    connect_timeout=2)["OPTIONS"]

    assert (options["keepalives_idle"], options["keepalives_interval"], options["tcp_user_timeout"]) == (1, 1, 4000)
    assert options["connect_timeout"] == 2


def test_values_in_the_urls_query_string_win_over_the_settings() -> None:
    url = "postgres://sched@db1:5432/sched?keepalives_idle=7&tcp_user_timeout=9000&connect_timeout=3"
    options = database_link_options(database_from_url(url), tcp_timeout=30, connect_timeout=10)["OPTIONS"]

    assert (options["keepalives_idle"], options["tcp_user_timeout"], options["connect_timeout"]) == (7, 9000, 3)
    assert (options["keepalives_interval"], options["keepalives_count"]) == (5, 3)


def test_the_two_host_failover_url_keeps_its_hosts_and_options_and_gets_the_bounds_too() -> None:
    url = "postgres://sched@pg1:5432,pg2:5432/sched?target_session_attrs=read-write&connect_timeout=3"
    config = database_link_options(database_from_url(url), tcp_timeout=30, connect_timeout=10)

    assert (config["HOST"], config["PORT"]) == ("pg1,pg2", "5432,5432")
    assert config["OPTIONS"]["target_session_attrs"] == "read-write"
    assert config["OPTIONS"]["connect_timeout"] == 3 and config["OPTIONS"]["tcp_user_timeout"] == 30000


def test_zero_leaves_each_bound_to_libpq_and_a_non_postgresql_database_is_left_alone() -> None:
    off = database_link_options(database_from_url("postgres://sched@db1/sched"), tcp_timeout=0, connect_timeout=0)
    sqlite = database_link_options(database_from_url("sqlite:////tmp/x.sqlite3"), tcp_timeout=30, connect_timeout=10)

    assert off["OPTIONS"] == {}
    assert sqlite.get("OPTIONS", {}) == {}


@pytest.mark.parametrize("name", ["SCHEDULER_DB_TCP_TIMEOUT", "SCHEDULER_DB_CONNECT_TIMEOUT"])
def test_a_negative_or_non_numeric_link_timeout_is_refused_naming_the_setting(name: str) -> None:
    for bad, words in (("-1", "0 or more seconds"), ("soon", "whole number")):
        result = subprocess.run(
            [sys.executable, "manage.py", "check"], cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "DATABASE_URL": "postgres://sched@127.0.0.1:5432/sched", "SECRET_KEY": "x" * 50,
                 name: bad},
        )

        assert result.returncode != 0
        assert name in result.stderr.strip().splitlines()[-1] and words in result.stderr, result.stderr[-500:]


def test_the_production_layouts_connection_carries_the_bounds_to_libpq() -> None:
    # The settings as a process reads them from its environment, and what Django hands libpq.
    code = ("from django.db import connection; p = connection.get_connection_params(); "
            "print(p['keepalives'], p['keepalives_idle'], p['tcp_user_timeout'], p['connect_timeout'])")
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DATABASE_URL": "postgres://sched@127.0.0.1:5432/sched?connect_timeout=4",
             "SECRET_KEY": "x" * 50, "SCHEDULER_DB_TCP_TIMEOUT": "12"},
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].split() == ["1", "6", "12000", "4"]
