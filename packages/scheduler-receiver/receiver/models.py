from __future__ import annotations

from django.db import models


class Delivery(models.Model):
    """What a target has seen of one run: the highest fence, and the stored answer once applied."""

    key = models.CharField(max_length=200, primary_key=True)  # the Idempotency-Key
    highest_fence = models.BigIntegerField(default=0)
    applied = models.BooleanField(default=False)
    status = models.PositiveSmallIntegerField(null=True)
    body = models.BinaryField(default=b"")
    content_type = models.CharField(max_length=100, blank=True)
    calls = models.PositiveIntegerField(default=0)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    applied_at = models.DateTimeField(null=True)

    class Meta:
        db_table = "receiver_deliveries"
        verbose_name_plural = "deliveries"

    def __str__(self) -> str:
        return self.key
