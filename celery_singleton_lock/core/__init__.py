"""The lock core: Redis and the standard library only, never Celery (tests/unit/test_layers.py)."""
