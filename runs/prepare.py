"""A claimed run's call made ready: the request to its target (the address resolved and
checked where the connection goes, the body signed) or its Celery task message, or
why it must not be called (`Call.refusal`: out of tries, a refused address or task).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from django.db import DatabaseError

from jobs.validators import check_resolved_target
from runs import delivery, publishing
from runs.delivery import CallResult
from runs.outcomes import Call, _signer_for


logger = logging.getLogger("scheduler.runs")


def _prepare(calls: list[Call]) -> None:
    """Checks after the claim (tries left, the target's address now), then the request.

    What goes wrong for one run costs that run only: a request that cannot be made
    (a header that cannot be sent, a secret that cannot be decrypted, any other
    exception) is a refusal with its reason; a name that does not resolve is a
    failed call (retried). A database error is the batch's, and goes up.
    """
    resolved: dict[str, _Resolved] = {}
    signers: dict[int, delivery.Signer | None] = {}
    grants: dict[tuple[int, str], str | None] = {}
    for call in calls:
        try:
            if call.run.job.is_task:
                _prepare_task(call, grants)
            else:
                _prepare_one(call, resolved, signers)
        except DatabaseError:
            raise
        except delivery.PreparationError as exc:
            call.refusal = str(exc)
        except Exception as exc:  # its text may hold a header's value: its type only
            logger.warning("run %s: could not prepare its call: %s", call.run.public_id, type(exc).__name__)
            call.refusal = f"could not prepare the call ({type(exc).__name__})"


@dataclass(frozen=True)
class _Resolved:
    addresses: tuple[str, ...] = ()  # the checked addresses to connect to
    refusal: str = ""  # the target may not be called: why
    failure: str = ""  # the lookup failed: a failed call


def _resolve(target: str) -> _Resolved:
    """The target's name resolved once and checked: the call connects to that address."""
    try:
        return _Resolved(addresses=tuple(check_resolved_target(target)))
    except ValueError as exc:
        return _Resolved(refusal=f"target refused: {exc}")
    except OSError:  # socket.gaierror: no such name, or no answer
        return _Resolved(failure=delivery.DNS_FAILURE)


def _out_of_tries(call: Call) -> bool:
    return call.claim.attempt - call.run.attempt_base > call.run.job.retry_max + 1


def _prepare_task(call: Call, grants: dict[tuple[int, str], str | None]) -> None:
    """A Celery task target: its message (runs.publishing), its grant checked again."""
    if _out_of_tries(call):
        call.refusal = "out of tries (leases lost)"
        return
    call.message = publishing.prepare(run=call.run, job=call.run.job, claim=call.claim, grants=grants)


def _prepare_one(call: Call, resolved: dict[str, _Resolved], signers: dict[int, delivery.Signer | None]) -> None:
    job = call.run.job
    if _out_of_tries(call):
        call.refusal = "out of tries (leases lost)"
        return
    if job.target not in resolved:
        resolved[job.target] = _resolve(job.target)
    where = resolved[job.target]
    if where.refusal:
        call.refusal = where.refusal
        return
    if where.failure:
        call.result = CallResult(error=where.failure)
        return
    if job.owner_id not in signers:
        signers[job.owner_id] = _signer_for(job)
    call.request = delivery.build_request(
        run=call.run, job=job, claim=call.claim, signer=signers[job.owner_id], addresses=where.addresses
    )
