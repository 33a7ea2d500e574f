"""Benchmarks of celery-singleton-lock against plain Celery and the competing libraries.

Run everything with ``python -m benchmarks.run`` (``--quick`` for a smoke run); see
docs/performance.md. Every section starts its own private Redis server, so server-wide
commands (``CONFIG RESETSTAT``, ``INFO commandstats``) never touch a shared one.
"""
