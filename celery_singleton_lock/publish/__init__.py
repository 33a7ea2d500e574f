"""Publish-time dedup (``singleton_lock_on="publish"``): a call is turned away by
``delay()``/``apply_async()`` while its key is queued or running (``dedup.py``)."""
