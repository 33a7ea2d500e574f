"""What runs beside your tasks: the ``celery singleton`` command (``cli.py``), Prometheus
metrics (``metrics.py``, also ``celery_singleton_lock.tools.metrics``) and the pytest plugin
(``testing.py``, also ``celery_singleton_lock.tools.testing``)."""
