"""Service tokens stored hashed (jobs.tokens). Every DRF authtoken key becomes a
hashed row, so existing tokens keep working, and the table that held the keys in
clear is dropped (rest_framework.authtoken is no longer installed)."""

import hashlib

import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models

LEGACY_TABLE = "authtoken_token"


def hash_legacy_keys(apps, schema_editor):
    connection = schema_editor.connection
    if LEGACY_TABLE not in connection.introspection.table_names():
        return  # a fresh database: nothing was ever stored in clear
    quote = connection.ops.quote_name
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {quote('key')}, user_id, created FROM {quote(LEGACY_TABLE)}")
        legacy = cursor.fetchall()
    ServiceToken = apps.get_model("jobs", "ServiceToken")
    ServiceToken.objects.bulk_create(
        ServiceToken(user_id=user_id, prefix=key[:8], digest=hashlib.sha256(key.encode()).hexdigest())
        for key, user_id, _ in legacy
    )
    # auto_now_add set created_at to now; keep when each key was really made.
    for key, _, created in legacy:
        ServiceToken.objects.filter(digest=hashlib.sha256(key.encode()).hexdigest()).update(created_at=created)
    schema_editor.execute(f"DROP TABLE {quote(LEGACY_TABLE)}")


class Migration(migrations.Migration):

    dependencies = [
        ("jobs", "0004_job_timing_changed_at"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.CreateModel(
            name="ServiceToken",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("prefix", models.CharField(max_length=8)),
                ("digest", models.CharField(max_length=64, unique=True)),
                ("created_at", models.DateTimeField(auto_now_add=True)),
                ("last_used_at", models.DateTimeField(blank=True, null=True)),
                ("revoked_at", models.DateTimeField(blank=True, null=True)),
                (
                    "user",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="service_tokens",
                        to=settings.AUTH_USER_MODEL,
                    ),
                ),
            ],
            options={"db_table": "service_tokens", "ordering": ["-created_at", "-id"]},
        ),
        # Irreversible on purpose: the keys in clear are gone, and must stay gone.
        migrations.RunPython(hash_legacy_keys, migrations.RunPython.noop),
    ]
