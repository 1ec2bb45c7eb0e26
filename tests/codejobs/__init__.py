"""A Django app for the sync_jobs tests: its schedules.py defines 1,000 jobs. It is
in INSTALLED_APPS only inside those tests (tests/jobs/test_sync_jobs.py)."""
