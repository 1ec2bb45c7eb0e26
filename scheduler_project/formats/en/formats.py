"""One time format everywhere in the admin: ISO 8601 in UTC with seconds (TIME_ZONE is
UTC, checks.py), the way the API and the Idempotency-Key write times."""

DATETIME_FORMAT = r"Y-m-d\TH:i:s\Z"
SHORT_DATETIME_FORMAT = r"Y-m-d\TH:i:s\Z"
DATE_FORMAT = "Y-m-d"
SHORT_DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
