"""The settings table: every setting's name, default, check (of its value alone) and documentation.

Settings are read at use time from ``app.conf`` (``singleton_<name>``; with
``namespace="CELERY"`` Celery maps ``CELERY_SINGLETON_<NAME>`` onto the same key). A task
option ``singleton_<name>`` on the task overrides the app-wide value. Nothing here is
written into ``app.conf``: ``add_defaults`` would override what the user configured.
:mod:`.options` reads the table: a task's :class:`~.options.Options`, beat's
:class:`~.options.BeatOptions`, and the rules that span several settings.

Knows nothing of Celery's classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.backend import FENCE_MARGIN_MS
from ..core.keys import MAX_PERMITS
from ..core.urls import (
    DEFAULT_WAIT_TIMEOUT_S,
)
from ..errors import SingletonConfigError
from .checks import (
    choice,
    key_args,
    key_fn,
    non_negative,
    non_negative_int,
    optional_non_negative,
    optional_positive,
    positive,
    prefix,
    rate,
    scope,
    shown,
    url,
)
from .legacy import renamed

__all__ = [
    "COMPLETION_MARGIN_S",
    "DEFAULT_COMPLETION_TTL_S",
    "LOCK_ON",
    "LOCK_ON_RENAMED",
    "POLICIES",
    "SETTINGS",
    "UNLIMITED",
    "Setting",
    "permits_text",
]

POLICIES = ("skip", "retry", "raise", "coalesce", "join", "queue", "cancel")
LOCK_ON = ("execute", "publish")
#: Old values of ``lock_on`` -> the value each is read as (with a DeprecationWarning): "both"
#: never differed from "publish" (the run takes its lock on the worker under both)
LOCK_ON_RENAMED = {"both": "publish"}
REDIS_ERROR_POLICIES = ("fail", "run")
BEAT_MODES = ("active", "leader")
#: The named choices of ``singleton_beat_catch_up`` (else a number of seconds).
CATCH_UP_CHOICES = ("none", "latest")
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: ``singleton_permits``: no limit on runs at once (a rate alone); read as 0 permits
UNLIMITED = "unlimited"

#: Added to the broker's visibility timeout: a message left unacked is restored by a sweep
#: that runs every few seconds, then waits in the queue behind others.
COMPLETION_MARGIN_S = 300.0
#: For brokers that redeliver when a connection is lost (RabbitMQ): the copy comes at once,
#: unless it waits in a long queue.
DEFAULT_COMPLETION_TTL_S = 3600.0


def catch_up(name: str, value: Any) -> str | float:
    """One of :data:`CATCH_UP_CHOICES`, or a window: a finite number of seconds > 0."""
    if isinstance(value, str):
        return choice(CATCH_UP_CHOICES)(name, value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return positive(name, value)
    raise SingletonConfigError(
        f'{name} must be "none", "latest" or a number of seconds > 0, got {shown(value)}'
    )


def _lock_on(name: str, value: Any) -> str:
    """One of :data:`LOCK_ON`; an old value of :data:`LOCK_ON_RENAMED` is read as its new one."""
    if isinstance(value, str) and value in LOCK_ON_RENAMED:
        renamed(name, repr(value), repr(LOCK_ON_RENAMED[value]))
        value = LOCK_ON_RENAMED[value]
    return choice(LOCK_ON)(name, value)


#: The largest ``singleton_queue_max``.
MAX_QUEUE = 1_000_000


def _queue_max(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUEUE:
        raise SingletonConfigError(
            f"{name} must be an integer from 1 to {MAX_QUEUE:,}, got {shown(value)}"
        )
    return value


def _permits(name: str, value: Any) -> int:
    """1 to :data:`MAX_PERMITS` runs of a key at once, or :data:`UNLIMITED` (read as 0)."""
    if isinstance(value, str) and value == UNLIMITED:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PERMITS:
        raise SingletonConfigError(
            f"{name} must be an integer from 1 to {MAX_PERMITS} or {UNLIMITED!r}, "
            f"got {shown(value)}"
        )
    return value


def permits_text(permits: int) -> str:
    """A checked ``permits`` as the settings spell it: 0 is :data:`UNLIMITED`."""
    return UNLIMITED if permits == 0 else str(permits)


@dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    name: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str
    task_option: bool = True
    #: False: a task reads the option from its own attribute only, never from ``app.conf``
    #: (whose ``singleton_lock_at_least`` is beat's old spelling of ``beat_lock_at_least``)
    app_fallback: bool = True

    @property
    def conf_key(self) -> str:
        return f"singleton_{self.name}"


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "redis_url",
            None,
            url,
            "Redis holding the locks: redis://, rediss://, unix://, redis+sentinel://, "
            "redis+cluster:// or redis+redlock:// (several independent masters). Default: "
            "the broker's URL as Celery resolves it (CELERY_BROKER_URL in the environment, else "
            "`broker_url`; the first URL of a failover list) when it is redis:// or rediss://, "
            "else redis://localhost:6379/0.",
            task_option=False,
        ),
        Setting(
            "wait_replicas",
            0,
            non_negative_int,
            "After each acquire, wait (WAIT) until this many replicas have the lock, at most "
            "`wait_timeout` seconds. 0: do not wait. Narrows the window in which a failover "
            "loses a lock just taken; does not close it.",
            task_option=False,
        ),
        Setting(
            "wait_timeout",
            DEFAULT_WAIT_TIMEOUT_S,
            positive,
            "The longest an acquire waits for `wait_replicas` replicas, in seconds.",
            task_option=False,
        ),
        Setting(
            "fence_margin",
            FENCE_MARGIN_MS / 1000,
            non_negative,
            "Seconds a lock's fencing counter outlives the lock's ttl: the counter, the last "
            "key a finished run leaves, expires ttl + this after the acquire. Fencing tokens "
            "stay increasing through a backward step of the Redis server's clock of up to ttl "
            "+ this (docs/how-it-works.md, Fencing tokens).",
            task_option=False,
        ),
        Setting(
            "key_prefix",
            "singleton:",
            prefix,
            "Prefix of every key the library writes.",
            task_option=False,
        ),
        Setting(
            "on_duplicate",
            "skip",
            choice(POLICIES),
            'What a duplicate run does: "skip" (finish at once, result marked skipped), '
            '"retry" (requeue every `retry_countdown` seconds until it can run), '
            '"raise" (fail with DuplicateTaskError), "coalesce" (finish at once like a skip; '
            "all duplicates met while one run holds the lock collapse into one follow-up run "
            "with the latest duplicate's arguments, published when the lock is released), "
            '"join" (finish with the outcome of the run it met: its value, or its failure), '
            '"queue" (wait in line, in no worker slot: every call runs, one at a time, in the '
            'order it reached the key; each release hands the key to the next) or "cancel" '
            "(latest wins: ask the running holder to stop, and run after its release; older "
            "waiting calls end as skips naming the newest).",
        ),
        Setting(
            "queue_max",
            1000,
            _queue_max,
            'Under "queue": the most calls one key\'s queue holds. A call over it is refused as '
            '"raise" refuses a duplicate (DuplicateTaskError: the queue is full).',
        ),
        Setting(
            "cancel_grace",
            None,
            optional_positive,
            'Under "cancel": seconds after a holder was asked to stop until it is ended with '
            "Celery's revoke(terminate=True), if it has not stopped (prefork, gevent and eventlet "
            "pools; a solo or threads worker refuses it at start). None: the holder is only "
            "asked (self.singleton.cancelled), never ended.",
        ),
        Setting(
            "on_redis_error",
            "fail",
            choice(REDIS_ERROR_POLICIES),
            'What a run does when Redis cannot be asked at acquire: "fail" (it does not run; it '
            "is requeued after `retry_countdown` seconds, and fails if even that cannot be "
            'published) or "run" (it runs without the lock, and logs so).',
        ),
        Setting(
            "key_args",
            None,
            key_args,
            "Names of the arguments that make up the key; None means all of them.",
        ),
        Setting(
            "key",
            None,
            key_fn,
            "A callable(args, kwargs) -> str giving the key's identity instead of the arguments.",
        ),
        Setting(
            "scope",
            None,
            scope,
            "A lock shared by several tasks: tasks naming the same scope and the same key "
            "arguments exclude each other (their keys carry the scope instead of the task "
            "name). Tasks sharing a scope must key on the same argument names, or all on a "
            "`key` callable; a worker refuses to start otherwise.",
        ),
        Setting(
            "permits",
            1,
            _permits,
            "How many runs of one key may run at once (each holds a permit slot of its own: "
            "renewed, released and fenced like a single lock); the next one meets "
            '`on_duplicate`. Not with redis+redlock:// URLs, nor with lock_on "publish". '
            '"unlimited", with `rate_limit`: no limit on runs at once (only the rate applies; a '
            "run holds no lock). None given on a task is the deprecated spelling of "
            '"unlimited".',
        ),
        Setting(
            "rate_limit",
            None,
            rate,
            'At most N runs of one key start within any window of a second, minute or hour ("N/s", '
            '"N/m", "N/h"; a sliding window, counted across the whole cluster); a run over it '
            "meets `on_duplicate`. None: no rate limit. Not with redis+redlock:// URLs, nor with "
            'lock_on "publish".',
        ),
        Setting("ttl", 30, positive, "Lock time-to-live in seconds; renewed every ttl/3."),
        Setting(
            "retry_countdown",
            5,
            non_negative,
            'Seconds between tries of a duplicate under "retry", and after a Redis error.',
        ),
        Setting(
            "max_hold",
            None,
            optional_positive,
            "Stop renewing a lock this many seconds after it was taken (a hung task then "
            "loses it after one more ttl). None: renew for as long as the task runs.",
        ),
        Setting(
            "completion_ttl",
            None,
            optional_non_negative,
            "Seconds a finished run's completion is kept beside its lock: a redelivered copy "
            "of its message (same task id and retries count) is then dropped, not run again. "
            "0: record nothing. None: for tasks acked late, the broker's visibility_timeout + "
            f"{COMPLETION_MARGIN_S:g} s with a Redis or SQS broker, else "
            f"{DEFAULT_COMPLETION_TTL_S:g} s; 0 for tasks acked early (their message is acked "
            "before the run, so it is not redelivered after it).",
        ),
        Setting(
            "lock_at_least",
            0,
            non_negative,
            "Keep the task's key blocked until this many seconds after each run took its lock, "
            "on the Redis server's clock. A task option read from the task only: the app-wide "
            "`singleton_lock_at_least` is beat's old spelling of `beat_lock_at_least`.",
            app_fallback=False,
        ),
        Setting(
            "lock_on",
            "execute",
            _lock_on,
            'Where duplicates are stopped: "execute" (on the worker, right before the body '
            'runs) or "publish" (also when the task is published: a duplicate '
            "`delay()`/`apply_async()` returns the AsyncResult of the queued or running "
            'holder; the run still takes its lock on the worker). "both" is the deprecated '
            'spelling of "publish".',
        ),
        Setting(
            "publish_ttl",
            300,
            positive,
            'Under lock_on "publish": seconds a queued marker lives (after its '
            "countdown or eta) if its message never starts (purged, lost). Past it a new "
            "call is published again; the lock on the worker still guards the run.",
        ),
        Setting(
            "debounce",
            None,
            optional_positive,
            "Seconds: calls of one key made within this long of each other form a burst, "
            "which runs once, this long after its last call, with that call's arguments; the "
            "earlier calls end as skipped duplicates. The calls wait as countdown messages, "
            'in no worker slot. Needs lock_on "execute". None: off.',
        ),
        Setting(
            "debounce_max",
            None,
            optional_positive,
            "Seconds: under `debounce`, a burst that keeps going runs at the latest this long "
            "after its first call (>= `debounce`). None: no cap.",
        ),
        Setting(
            "beat_mode",
            "active",
            choice(BEAT_MODES),
            'How SingletonScheduler instances share the schedule: "active" (every instance '
            'runs and claims each run before publishing it) or "leader" (one instance '
            "publishes under a renewed lease, the others stand by).",
            task_option=False,
        ),
        Setting(
            "beat_skew",
            1.0,
            non_negative,
            "The largest clock difference between beat instances, in seconds. Claims are "
            "kept long enough that an instance this far behind still finds them.",
            task_option=False,
        ),
        Setting(
            "beat_lock_at_least",
            0,
            non_negative,
            "Keep each scheduled run's claim at least this many seconds after it was published "
            "(the claim is otherwise kept for two schedule periods + 2 x beat_skew + 60 s). "
            "Formerly the app-wide `singleton_lock_at_least`, still read as this with a "
            "DeprecationWarning.",
            task_option=False,
        ),
        Setting(
            "beat_catch_up",
            "latest",
            catch_up,
            "What a beat publishes for an entry's runs whose time passed while no beat "
            'published (every beat down, or none could reach Redis): "none" (they are '
            'dropped; the next run comes on time), "latest" (one run at once, the latest '
            "of them) or a number of seconds (each of them within that long before now, "
            "oldest first). An entry overrides it with the message header "
            "`singleton_beat_catch_up` in its options.",
            task_option=False,
        ),
        Setting(
            "beat_lease",
            10,
            positive,
            'Leader lease ttl in seconds under beat_mode "leader": a standby takes over at '
            "most this long after the leader's last renewal. Beat's Redis calls time out after "
            "a quarter of it (at most 5 s) unless the lock URL sets socket_timeout and "
            "socket_connect_timeout, which may not be longer.",
            task_option=False,
        ),
    )
}
