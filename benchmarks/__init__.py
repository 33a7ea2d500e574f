"""Benchmarks of celery-singleton-lock against plain Celery and the competing libraries.

Run everything with ``python -m benchmarks.run`` (``--quick`` for a smoke run); see
docs/performance.md. Every section starts its own private Redis server, so server-wide
commands (``CONFIG RESETSTAT``, ``INFO commandstats``) never touch a shared one.
"""

import sys

# Every section measures the library as `pip install celery-singleton-lock` has it, without its
# optional OpenTelemetry receivers: they connect themselves (at the library's import, which
# follows this package's) where the OpenTelemetry Celery instrumentation is installed, as the
# test extra installs it, and cost a run what docs/operations.md says. A worker of
# ``benchmarks.bench_app`` imports this package first too.
sys.modules.setdefault("opentelemetry.instrumentation.celery", None)  # type: ignore[arg-type]
