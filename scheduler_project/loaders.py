"""psycopg's own C loaders for the values Django would decode in Python.

Django 5.2 registers, on every PostgreSQL connection, a loader of its own for
`timestamptz` (a subclass of psycopg's pure-Python loader, so that times carry the
connection's `tzinfo` object) and psycopg's pure-Python text loader for `jsonb`.
Every time and JSON value read from the store was then parsed in Python: about
7 µs a time against 1 µs with psycopg's C loader, and a run message reads tens of
them a run (its runs and their jobs, the claim's times, the outcome's job locks).

The store's connections are in UTC (settings.TIME_ZONE, and Django sets the
session's TimeZone to it), and for a UTC session psycopg's C loader gives
`datetime.timezone.utc`, the very `tzinfo` Django's loader would put there. So on a
new connection whose Django time zone is UTC, the C loaders are registered in
Django's place; any other (a site that set a database TIME_ZONE) keeps Django's.
"""
from __future__ import annotations

import datetime
from typing import Any

TIMESTAMPTZ = "timestamptz"
_LOADERS: dict[str, type] | None = None  # set by connect()


def fast_loaders() -> dict[str, type] | None:
    """{type name: loader class} to register, or None without psycopg's C module."""
    import psycopg
    from psycopg.pq import Format

    if psycopg.pq.__impl__ == "python":
        return None
    types = psycopg.postgres.types
    c_time = psycopg.adapters.get_loader(types[TIMESTAMPTZ].oid, Format.TEXT)
    c_text = psycopg.adapters.get_loader(types["text"].oid, Format.TEXT)
    if c_time is None or c_text is None:
        return None

    class UtcTimestamptzLoader:
        """The C loader behind Django's check: Django's create_cursor compares its
        connection's time zone with the registered loader's `timezone` and puts its
        own back on the cursor when they differ. A C class cannot be subclassed, so
        this holds one, and hands psycopg the C loader's bound `load` itself (no
        Python frame a value)."""

        format = Format.TEXT
        timezone = datetime.timezone.utc

        def __init__(self, oid: int, context: Any = None) -> None:
            self.load = c_time(oid, context).load

    return {TIMESTAMPTZ: UtcTimestamptzLoader, "jsonb": c_text}


def register(sender: Any, connection: Any, **kwargs: Any) -> None:
    """connection_created: the C loaders on a new UTC PostgreSQL connection."""
    if connection.vendor != "postgresql" or connection.timezone is not datetime.timezone.utc:
        return
    if connection.connection.info.parameter_status("TimeZone") != "UTC":
        return
    for name, loader in (_LOADERS or {}).items():
        connection.connection.adapters.register_loader(name, loader)


def connect() -> None:
    global _LOADERS
    from django.db.backends.signals import connection_created

    try:
        _LOADERS = fast_loaders()
    except ImportError:  # no psycopg: the embedded SQLite layout
        _LOADERS = None
    connection_created.connect(register, weak=False, dispatch_uid="scheduler_project.loaders")

