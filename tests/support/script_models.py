"""What the model-based tests of the Lua scripts share (hypothesis stateful machines run
against the test Redis): the size of a run, the lock ttl of the models' runs, and a machine on
a private prefix.

``SINGLETON_MODEL_EXAMPLES`` (default 15 examples) and ``SINGLETON_MODEL_STEPS`` (30 steps)
size every model's run; test_protocol_model.py shows a nightly-sized one.
"""

from __future__ import annotations

import os
import uuid

import redis
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine

from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore
from tests.support.prefixes import delete_prefix

__test__ = False

#: the lock ttl of the models' runs: no lock expires by itself during an example
TTL_MS = 30_000
EXAMPLES = int(os.environ.get("SINGLETON_MODEL_EXAMPLES", "15"))
STEPS = int(os.environ.get("SINGLETON_MODEL_STEPS", "30"))
#: the hypothesis settings of every model's run
SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class OnRedis(RuleBasedStateMachine):
    """A private prefix on the test Redis, deleted at the end of each example."""

    def __init__(self, redis_url: str, permits: int = 1) -> None:
        super().__init__()
        self.client = redis.Redis.from_url(redis_url)
        self.namespace = f"cslt:{uuid.uuid4().hex[:8]}:"
        self.store = LockStore(self.client)
        self.keys = lock_keys(self.namespace, "m.model", b"k").with_permits(permits)

    def teardown(self) -> None:
        delete_prefix(self.client, self.namespace)
        self.client.close()
