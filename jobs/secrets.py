"""Secret job headers, encrypted at rest with Fernet.

The key comes from SCHEDULER_ENCRYPTION_KEY (a Fernet key) or, when that is not
set, is derived from SECRET_KEY, so the embedded mode needs no set-up.
"""
from __future__ import annotations

import base64
import hashlib
import json
from functools import lru_cache

from cryptography.fernet import Fernet
from django.conf import settings

# Headers that carry credentials whatever the caller says. (Proxy-Authorization is
# not among them: like every Proxy-* header it is refused at creation,
# jobs.validators.validate_header.)
ALWAYS_SECRET = frozenset({"authorization", "cookie"})
REDACTED = "***"


@lru_cache(maxsize=4)
def _fernet(key_material: str) -> Fernet:
    if getattr(settings, "SCHEDULER_ENCRYPTION_KEY", ""):
        return Fernet(settings.SCHEDULER_ENCRYPTION_KEY.encode())
    digest = hashlib.sha256(b"scheduler-secret-headers:" + key_material.encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def fernet() -> Fernet:
    return _fernet(settings.SECRET_KEY + getattr(settings, "SCHEDULER_ENCRYPTION_KEY", ""))


def is_secret(name: str, marked: list[str] | tuple[str, ...]) -> bool:
    lowered = name.lower()
    return lowered in ALWAYS_SECRET or lowered in {m.lower() for m in marked}


def split_headers(headers: dict[str, str], marked: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(plain, secret) by name."""
    plain = {k: v for k, v in headers.items() if not is_secret(k, marked)}
    secret = {k: v for k, v in headers.items() if is_secret(k, marked)}
    return plain, secret


def encrypt_headers(secret: dict[str, str]) -> str:
    if not secret:
        return ""
    return fernet().encrypt(json.dumps(secret).encode()).decode()


def decrypt_headers(token: str) -> dict[str, str]:
    if not token:
        return {}
    return json.loads(fernet().decrypt(token.encode()))


def redacted_names(token: str) -> list[str]:
    return sorted(decrypt_headers(token))
