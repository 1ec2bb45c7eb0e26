"""Signals other code can hook."""
from django.dispatch import Signal

# Sent (after commit) when a run goes to the dead list: sender=Run, run=Run, reason=str.
run_dead = Signal()

# Sent (after commit) when a job pauses itself (pause_after_failures): sender=Job, job=Job, reason=str.
job_paused = Signal()
