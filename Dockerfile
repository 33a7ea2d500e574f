# The demo's image: the library and examples/demo_app.py. compose.yaml runs three workers and
# two beats from it against one Redis (`docker compose up`); the process demo (`./run demo`)
# runs the same commands as local processes. tests/integration/test_compose.py checks both.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app

WORKDIR /app
COPY pyproject.toml README.md ./
COPY celery_singleton_lock ./celery_singleton_lock
COPY examples ./examples
RUN pip install . && useradd --create-home demo && chown demo /app
USER demo

CMD ["celery", "-A", "examples.demo_app", "worker", "-P", "prefork", "-c", "2", "-n", "w1@%h", "--without-mingle", "--without-gossip", "--without-heartbeat", "-l", "INFO"]
