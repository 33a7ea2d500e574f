"""Runnable examples of celery_singleton_lock (``python -m examples.demo``)."""
