"""`GET /api/breakers/`: each target host's circuit breaker, and its bulkhead use.

Breakers are per host and hosts are shared between services, so a service sees
the breakers of the hosts its own jobs call (whoever else calls them too), with
failure text (`last_error`, and in `history`) from its own runs only: a target's
answer may echo another service's request. Staff see every host and all text. A host that never failed has no breaker row: it is closed.
"""
from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.generics import ListAPIView
from rest_framework.request import Request
from rest_framework.response import Response

from runs import breakers, bulkhead, claims
from runs.models import TargetBreaker


class TransitionSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    state = serializers.CharField()
    detail = serializers.JSONField()


class BreakerSerializer(serializers.Serializer):
    host = serializers.CharField(help_text="The target host as written in job URLs, port included.")
    state = serializers.ChoiceField(choices=TargetBreaker.State.choices)
    failures = serializers.IntegerField(help_text="Failed calls in a row.")
    opened_at = serializers.DateTimeField(allow_null=True)
    next_probe_at = serializers.DateTimeField(allow_null=True, help_text="When one held run is let through as a probe.")
    last_failure_at = serializers.DateTimeField(allow_null=True)
    last_error = serializers.CharField(help_text="The last failure's text, when it was one of the caller's runs (staff: any); else empty.")
    in_flight = serializers.IntegerField(
        allow_null=True,
        help_text="Calls in flight to the host now (bulkhead slots taken); null when the slot store (Redis) "
        "did not answer.",
    )
    history = TransitionSerializer(many=True, help_text="The latest changes of state, newest first.")


class BreakerList(ListAPIView):
    serializer_class = BreakerSerializer

    def get_queryset(self) -> Any:
        if getattr(self, "swagger_fake_view", False):  # schema generation has no caller
            return TargetBreaker.objects.none()
        return breakers.breakers_for(self.request.user).prefetch_related("transitions")

    # drf-spectacular documents `get` (ListAPIView's handler), not `list`.
    @extend_schema(summary="Target hosts' circuit breakers (the caller's hosts; staff: all)")
    def get(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        return self.list(request, *args, **kwargs)

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        page = self.paginate_queryset(self.get_queryset())
        now = claims.store_now()  # slot leases and probe times are in the store's clock
        busy = bulkhead.in_flight([b.host for b in page], now=now)
        rows = [breakers.row(b, now, None if busy is None else busy.get(b.host, 0), viewer=request.user) for b in page]
        return self.get_paginated_response(BreakerSerializer(rows, many=True).data)
