from django.apps import AppConfig


class ScannersConfig(AppConfig):
    name = "scanners"
    verbose_name = "Scanners"

    def ready(self) -> None:
        from scheduler_project import statement_counter

        statement_counter.install()
