from django.apps import AppConfig


class ReceiverConfig(AppConfig):
    name = "receiver"
    verbose_name = "Receiver (target side)"
    default_auto_field = "django.db.models.BigAutoField"
