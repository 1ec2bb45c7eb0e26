"""The receiver helper: for target services, so a run's effect happens once.

Add "receiver" to INSTALLED_APPS, migrate, and decorate the view the scheduler
calls with `receiver.idempotent_run`. See docs/targets.md.
"""
