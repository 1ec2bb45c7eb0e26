"""scheduler-receiver: the target-side helper of the job scheduler, so that a run's
effect happens once and only the scheduler's calls get in.

- Django: add "receiver" to INSTALLED_APPS, migrate, decorate the view the job calls
  with `receiver.views.idempotent_run` (settings: RECEIVER_SIGNING_SECRETS,
  RECEIVER_SIGNATURE_TOLERANCE).
- Plain Python, WSGI, ASGI (no Django needed): `receiver.signing.verify_signature`,
  `receiver.rules` (the idempotency rule, and `Deliveries` for a DB-API connection),
  `receiver.wsgi.SignedOnly`, `receiver.asgi.SignedOnly`.

See docs/targets.md in the scheduler project.
"""
__version__ = "1.0.0"
