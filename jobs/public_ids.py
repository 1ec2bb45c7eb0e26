"""Public ids: `job_88213`, `run_5521`. The database keys are plain integers."""
from __future__ import annotations


def format_id(prefix: str, pk: int) -> str:
    return f"{prefix}_{pk}"


def parse_id(prefix: str, value: str | int) -> int | None:
    """`job_12`, `12` or 12 -> 12; anything else -> None (the caller answers 404)."""
    text = str(value)
    if text.startswith(prefix + "_"):
        text = text[len(prefix) + 1 :]
    # isascii(): str.isdigit() is also true of "¹" or "٣", which int() refuses.
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        return None
    return int(text)
