"""Django settings for the package's own tests: a target service that uses the helper."""
SECRET_KEY = "receiver-tests-only"
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "receiver"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
RECEIVER_SIGNING_SECRETS: list[str] = []
