"""A small Django project whose beats run django-celery-beat's schedule on SQLite, each run once.

``settings.py`` (SQLite, ``django_celery_beat``, the Celery settings under ``CELERY_``),
``celery.py`` (the app, as Django's Celery docs lay it out), ``tasks.py`` (the scheduled task)
and ``manage.py``. Run it (docs/django.md)::

    export DJANGO_SETTINGS_MODULE=examples.django_beat.settings
    python -m examples.django_beat.manage migrate
    celery -A examples.django_beat worker -l INFO &
    celery -A examples.django_beat beat -S singleton-django -l INFO &   # as many as you like

then add, edit, disable and delete ``PeriodicTask`` rows (the admin, the shell): every run is
published by one beat only. ``tests/integration/test_django_beat.py`` runs three such beats.
"""

from .celery import app as celery_app

__all__ = ["celery_app"]
