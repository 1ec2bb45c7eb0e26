"""1,000 code-defined jobs for one service, each with its own minute and a few
fields in the API's words. Tests replace SCHEDULES to change or remove some."""
from __future__ import annotations

from jobs.code import Schedule, job

OWNER = "code-service"
COUNT = 1000


def definition(i: int, **changes: object) -> Schedule:
    fields: dict[str, object] = {
        "schedule": f"{i % 60} {i % 24} * * *",
        "timezone": "Europe/Paris" if i % 2 else "UTC",
        "target": f"https://reports.internal/rebuild/{i}",
        "payload": {"report": i},
        "window": "5m" if i % 3 == 0 else "0s",
        "retry": {"max": i % 5},
    }
    fields.update(changes)
    return job(f"report-{i:04d}", owner=OWNER, **fields)


SCHEDULES = [definition(i) for i in range(COUNT)]
