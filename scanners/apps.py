from django.apps import AppConfig


class ScannersConfig(AppConfig):
    name = "scanners"
    verbose_name = "Scanners"
