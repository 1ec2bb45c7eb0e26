"""Guessing is slowed: repeated admin login failures lock the user and the address out
(django-axes); repeated bad API tokens from one address get 429 with Retry-After."""
from __future__ import annotations

from typing import Any

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.conftest import Service

pytestmark = pytest.mark.django_db

RIGHT = "a long password 123"  # the superuser fixture's


@pytest.fixture(autouse=True)
def _quick_password_hashing(settings: Any) -> None:
    # Autouse: set before the superuser fixture hashes its password. Each of the 60
    # attempts checks a password; PBKDF2's cost is not what these tests are about.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def login(username: str, password: str, addr: str = "203.0.113.7") -> Client:
    client = Client(REMOTE_ADDR=addr)
    client.post("/admin/login/?next=/admin/", {"username": username, "password": password})
    return client


def logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session and client.get("/admin/").status_code == 200


def test_thirty_wrong_admin_passwords_lock_the_account_so_the_right_one_is_refused(superuser: Any) -> None:
    assert logged_in(login(superuser.username, RIGHT))  # the right password works at first

    for i in range(30):
        assert not logged_in(login(superuser.username, f"wrong-{i}"))

    refused = Client(REMOTE_ADDR="203.0.113.7")
    response = refused.post("/admin/login/?next=/admin/", {"username": superuser.username, "password": RIGHT})
    assert response.status_code == 429 and "locked" in response.content.decode().lower()
    assert not logged_in(refused)
    # Per user: another address cannot log in as that user either, while the lock lasts.
    assert not logged_in(login(superuser.username, RIGHT, addr="198.51.100.9"))


def test_an_address_guessing_many_users_is_locked_out_for_every_user(superuser: Any) -> None:
    for i in range(30):
        assert not logged_in(login(f"guess-{i}", "whatever", addr="203.0.113.50"))

    assert not logged_in(login(superuser.username, RIGHT, addr="203.0.113.50"))
    assert logged_in(login(superuser.username, RIGHT, addr="198.51.100.9"))  # the user is not locked


def test_650_bad_tokens_from_one_address_get_429s_with_retry_after(service: Service) -> None:
    statuses: list[int] = []
    retry_after: set[str] = set()
    guesser = APIClient(REMOTE_ADDR="203.0.113.66")  # one client: making one loads every middleware
    for i in range(650):
        response = guesser.get("/api/jobs/", HTTP_AUTHORIZATION=f"Token guess-{i:04d}-{'x' * 36}")
        statuses.append(response.status_code)
        if response.status_code == 429:
            retry_after.add(response["Retry-After"])

    refused = statuses.index(429)
    assert set(statuses[:refused]) == {401} and set(statuses[refused:]) == {429}
    assert 0 < refused <= 50  # guessing stops early...
    assert all(0 < int(value) <= 300 for value in retry_after)  # ...and is told for how long

    # The guessing address is refused even with a good token (no oracle while locked)...
    same = APIClient(REMOTE_ADDR="203.0.113.66")
    same.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")
    locked = same.get("/api/jobs/")
    assert locked.status_code == 429 and int(locked["Retry-After"]) > 0
    # ...while the service, from its own address, goes on.
    mine = APIClient(REMOTE_ADDR="198.51.100.20")
    mine.credentials(HTTP_AUTHORIZATION=f"Token {service.token}")
    assert mine.get("/api/jobs/").json()["count"] == 0


def test_good_tokens_do_not_count_towards_the_throttle_of_failures(service: Service) -> None:
    for _ in range(60):
        assert service.get("/api/jobs/").status_code == 200
    bad = APIClient()
    bad.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    assert bad.get("/api/jobs/").status_code == 401
