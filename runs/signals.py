"""Signals other code can hook."""
from django.dispatch import Signal

# Sent (after commit) when a run goes to the dead list: sender=Run, run=Run, reason=str.
run_dead = Signal()
