"""The settings table: every setting's name, default, check and documentation.

Settings are read at use time from ``app.conf`` (``singleton_<name>``; with
``namespace="CELERY"`` Celery maps ``CELERY_SINGLETON_<NAME>`` onto the same key). A task
option ``singleton_<name>`` on the task overrides the app-wide value. Nothing here is
written into ``app.conf``: ``add_defaults`` would override what the user configured.

Knows nothing of Celery's classes: it reads any mapping with ``get``.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .compat import legacy_options
from .core.keys import MAX_PERMITS, check_prefix
from .core.urls import (
    DEFAULT_WAIT_TIMEOUT_S,
    URL_KINDS,
    parse_lock_url,
    query_names,
    redact_url,
    repr_without_password,
    url_scheme,
)
from .errors import SingletonConfigError

__all__ = [
    "COMPLETION_MARGIN_S",
    "DEFAULT_COMPLETION_TTL_S",
    "LOCK_ON",
    "POLICIES",
    "SETTINGS",
    "BeatOptions",
    "Options",
    "Setting",
    "default_completion_ttl",
    "read_beat_options",
    "read_options",
    "resolve_redis_url",
]

POLICIES = ("skip", "retry", "raise", "coalesce")
LOCK_ON = ("execute", "publish", "both")
REDIS_ERROR_POLICIES = ("fail", "run")
BEAT_MODES = ("active", "leader")
DEFAULT_REDIS_URL = "redis://localhost:6379/0"

#: Added to the broker's visibility timeout: a message left unacked is restored by a sweep
#: that runs every few seconds, then waits in the queue behind others.
COMPLETION_MARGIN_S = 300.0
#: For brokers that redeliver when a connection is lost (RabbitMQ): the copy comes at once,
#: unless it waits in a long queue.
DEFAULT_COMPLETION_TTL_S = 3600.0
#: kombu's default visibility timeouts, by transport
_VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}


class ConfLike(Protocol):
    def get(self, key: str, default: Any = None) -> Any: ...


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise SingletonConfigError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise SingletonConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _optional_positive(name: str, value: Any) -> float | None:
    return None if value is None else _positive(name, value)


def _optional_non_negative(name: str, value: Any) -> float | None:
    return None if value is None else _non_negative(name, value)


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    """A check that accepts one of ``choices``."""

    def check(name: str, value: Any) -> str:
        if value not in choices:
            listed = ", ".join(repr(c) for c in choices)
            raise SingletonConfigError(f"{name} must be one of {listed}, got {value!r}")
        return str(value)

    return check


def _prefix(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise SingletonConfigError(f"{name} must be a string, got {value!r}")
    try:
        check_prefix(value)
    except SingletonConfigError as exc:
        raise SingletonConfigError(f"{name}: {exc}") from exc
    return value


def _key_args(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise SingletonConfigError(f"{name} must be a sequence of argument names, got {value!r}")
    return tuple(value)


def _scope(name: str, value: Any) -> str | None:
    """A scope name: what the keys of its tasks show in place of the task name."""
    if value is None:
        return None
    if not isinstance(value, str) or not _SCOPE.fullmatch(value):
        raise SingletonConfigError(
            f"{name} must be a name of letters, digits, '_', '.' or '-' (at most 64), got {value!r}"
        )
    return value


_SCOPE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _key_fn(name: str, value: Any) -> Callable[..., str] | None:
    """A callable that can be called as ``key(args, kwargs)`` (checked on its signature)."""
    if value is None:
        return None
    if not callable(value):
        raise SingletonConfigError(f"{name} must be a callable(args, kwargs) -> str, got {value!r}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        return value  # type: ignore[no-any-return]
    try:
        signature.bind(None, None)
    except TypeError as exc:
        raise SingletonConfigError(
            f"{name} must be a callable(args, kwargs) -> str; "
            f"{getattr(value, '__qualname__', value)!s}{signature} cannot be called so: {exc}"
        ) from None
    return value  # type: ignore[no-any-return]


def _task_option(task: object, name: str) -> Any:
    """The task's option ``name``; a function given as one comes back unbound.

    Celery turns a task option into a class attribute (``@app.task(singleton_key=f)``), and a
    plain function that is a class attribute is bound to the task when read: the option is
    the function, not that method.
    """
    value = getattr(task, name, None)
    if inspect.ismethod(value) and value.__self__ is task:
        return value.__func__
    return value


def _non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SingletonConfigError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _permits(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PERMITS:
        raise SingletonConfigError(
            f"{name} must be an integer from 1 to {MAX_PERMITS}, got {value!r}"
        )
    return value


def _url(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or url_scheme(value) not in URL_KINDS:
        shown = redact_url(value) if isinstance(value, str) else repr(value)
        raise SingletonConfigError(
            f"{name} must be a redis://, rediss:// or unix:// URL, or a redis+sentinel://, "
            f"redis+cluster:// or redis+redlock:// one (rediss+... for TLS), got {shown}"
        )
    try:  # what redis-py would refuse at the first task: the port, the db, query options
        parse_lock_url(value)
    except ValueError as exc:
        raise SingletonConfigError(
            f"{name} is not a usable Redis URL ({exc}), got {redact_url(value)}"
        ) from None
    return value


@dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    name: str
    default: Any
    check: Callable[[str, Any], Any]
    doc: str
    task_option: bool = True
    #: False: a task reads the option from its own attribute only, never from ``app.conf``
    #: (whose key means something else there: ``lock_at_least`` is beat's app-wide)
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
            _url,
            "Redis holding the locks: redis://, rediss://, unix://, redis+sentinel://, "
            "redis+cluster:// or redis+redlock:// (several independent masters). Default: "
            "`broker_url` when it is redis:// or rediss://, else redis://localhost:6379/0.",
            task_option=False,
        ),
        Setting(
            "wait_replicas",
            0,
            _non_negative_int,
            "After each acquire, wait (WAIT) until this many replicas have the lock, at most "
            "`wait_timeout` seconds. 0: do not wait. Narrows the window in which a failover "
            "loses a lock just taken; does not close it.",
            task_option=False,
        ),
        Setting(
            "wait_timeout",
            DEFAULT_WAIT_TIMEOUT_S,
            _positive,
            "The longest an acquire waits for `wait_replicas` replicas, in seconds.",
            task_option=False,
        ),
        Setting(
            "key_prefix",
            "singleton:",
            _prefix,
            "Prefix of every key the library writes.",
            task_option=False,
        ),
        Setting(
            "on_duplicate",
            "skip",
            _choice(POLICIES),
            'What a duplicate run does: "skip" (finish at once, result marked skipped), '
            '"retry" (requeue every `retry_countdown` seconds until it can run), '
            '"raise" (fail with DuplicateTaskError) or "coalesce" (finish at once like a skip; '
            "all duplicates met while one run holds the lock collapse into one follow-up run "
            "with the latest duplicate's arguments, published when the lock is released).",
        ),
        Setting(
            "on_redis_error",
            "fail",
            _choice(REDIS_ERROR_POLICIES),
            'What a run does when Redis cannot be asked at acquire: "fail" (it does not run; it '
            "is requeued after `retry_countdown` seconds, and fails if even that cannot be "
            'published) or "run" (it runs without the lock, and logs so).',
        ),
        Setting(
            "key_args",
            None,
            _key_args,
            "Names of the arguments that make up the key; None means all of them.",
        ),
        Setting(
            "key",
            None,
            _key_fn,
            "A callable(args, kwargs) -> str giving the key's identity instead of the arguments.",
        ),
        Setting(
            "scope",
            None,
            _scope,
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
            '`on_duplicate`. Not with redis+redlock:// URLs, nor with lock_on "publish"/"both".',
        ),
        Setting("ttl", 30, _positive, "Lock time-to-live in seconds; renewed every ttl/3."),
        Setting(
            "retry_countdown",
            5,
            _non_negative,
            'Seconds between tries of a duplicate under "retry", and after a Redis error.',
        ),
        Setting(
            "max_hold",
            None,
            _optional_positive,
            "Stop renewing a lock this many seconds after it was taken (a hung task then "
            "loses it after one more ttl). None: renew for as long as the task runs.",
        ),
        Setting(
            "completion_ttl",
            None,
            _optional_non_negative,
            "Seconds a finished run's completion is kept beside its lock: a redelivered copy "
            "of its message (same task id and retries count) is then dropped, not run again. "
            "0: record nothing. None: for tasks acked late, the broker's visibility_timeout + "
            f"{COMPLETION_MARGIN_S:g} s with a Redis or SQS broker, else "
            f"{DEFAULT_COMPLETION_TTL_S:g} s; 0 for tasks acked early (their message is acked "
            "before the run, so it is not redelivered after it).",
        ),
        Setting(
            "lock_on",
            "execute",
            _choice(LOCK_ON),
            'Where duplicates are stopped: "execute" (on the worker, right before the body '
            'runs) or "publish"/"both" (also when the task is published: a duplicate '
            "`delay()`/`apply_async()` returns the AsyncResult of the queued or running "
            "holder; the run still takes its lock on the worker).",
        ),
        Setting(
            "publish_ttl",
            300,
            _positive,
            'Under lock_on "publish"/"both": seconds a queued marker lives (after its '
            "countdown or eta) if its message never starts (purged, lost). Past it a new "
            "call is published again; the lock on the worker still guards the run.",
        ),
        Setting(
            "beat_mode",
            "active",
            _choice(BEAT_MODES),
            'How SingletonScheduler instances share the schedule: "active" (every instance '
            'runs and claims each run before publishing it) or "leader" (one instance '
            "publishes under a renewed lease, the others stand by).",
            task_option=False,
        ),
        Setting(
            "beat_skew",
            1.0,
            _non_negative,
            "The largest clock difference between beat instances, in seconds. Claims are "
            "kept long enough that an instance this far behind still finds them.",
            task_option=False,
        ),
        Setting(
            "lock_at_least",
            0,
            _non_negative,
            "App-wide: keep each scheduled run's claim at least this many seconds after it was "
            "published (the claim is otherwise kept for two schedule periods). As a task "
            "option (read from the task only): keep the task's key blocked until this many "
            "seconds after each run took its lock, on the Redis server's clock.",
            app_fallback=False,
        ),
        Setting(
            "beat_lease",
            10,
            _positive,
            'Leader lease ttl in seconds under beat_mode "leader": a standby takes over at '
            "most this long after the leader's last renewal.",
            task_option=False,
        ),
    )
}


@dataclass(frozen=True)
class BeatOptions:
    """The checked settings of SingletonScheduler."""

    __repr__ = repr_without_password

    redis_url: str
    key_prefix: str
    mode: str
    skew: float
    lock_at_least: float
    lease: float


def read_beat_options(conf: ConfLike) -> BeatOptions:
    """Check the settings SingletonScheduler uses."""
    values = {
        name: SETTINGS[name].check(SETTINGS[name].conf_key, _conf_value(conf, name))
        for name in ("key_prefix", "beat_mode", "beat_skew", "lock_at_least", "beat_lease")
    }
    return BeatOptions(
        redis_url=resolve_redis_url(conf),
        key_prefix=values["key_prefix"],
        mode=values["beat_mode"],
        skew=values["beat_skew"],
        lock_at_least=values["lock_at_least"],
        lease=values["beat_lease"],
    )


def _conf_value(conf: ConfLike, name: str) -> Any:
    value = conf.get(SETTINGS[name].conf_key)
    return SETTINGS[name].default if value is None else value


@dataclass(frozen=True)
class Options:
    """The checked settings that apply to one task."""

    __repr__ = repr_without_password

    # the field names below are the settings read_options checks

    redis_url: str
    key_prefix: str
    on_duplicate: str
    on_redis_error: str
    key_args: tuple[str, ...] | None
    key: Callable[..., str] | None
    ttl: float
    retry_countdown: float
    max_hold: float | None
    lock_on: str = "execute"
    publish_ttl: float = 300.0
    scope: str | None = None
    permits: int = 1

    #: None when read without a task (the banner): it depends on the task's acks_late
    completion_ttl: float | None = None
    #: the task's at-least window (0: none); never the app-wide (beat's) value
    lock_at_least: float = 0.0

    @functools.cached_property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))


_TASK_SETTINGS = frozenset(Options.__dataclass_fields__)


def resolve_redis_url(conf: ConfLike) -> str:
    """``singleton_redis_url``, else a Redis broker URL, else the local default.

    ``singleton_wait_replicas`` and ``singleton_wait_timeout`` are folded into the URL's query
    (``wait_replicas=``, ``wait_timeout=``) unless it names them already, so the URL alone
    describes the lock store of a process.
    """
    url = _url("singleton_redis_url", conf.get("singleton_redis_url"))
    if not url:
        broker = conf.get("broker_url")
        if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
            url = broker.split(";", 1)[0]
        else:
            url = DEFAULT_REDIS_URL
    present = query_names(url)
    extra: list[str] = []
    replicas = _conf_checked(conf, "wait_replicas")
    if replicas and "wait_replicas" not in present:
        extra.append(f"wait_replicas={replicas}")
    timeout = _conf_checked(conf, "wait_timeout")
    if timeout != DEFAULT_WAIT_TIMEOUT_S and "wait_timeout" not in present:
        extra.append(f"wait_timeout={timeout:g}")
    if extra:
        url = f"{url}{'&' if '?' in url else '?'}{'&'.join(extra)}"
        _url("singleton_redis_url (with singleton_wait_replicas/wait_timeout)", url)
    return url


def _conf_checked(conf: ConfLike, name: str) -> Any:
    return SETTINGS[name].check(SETTINGS[name].conf_key, _conf_value(conf, name))


def read_options(conf: ConfLike, task: object | None = None) -> Options:
    """Check and merge the app-wide settings with the task's ``singleton_*`` attributes."""
    task_name = getattr(task, "name", None)
    legacy = {} if task is None else legacy_options(task)
    values: dict[str, Any] = {}
    for setting in SETTINGS.values():
        if setting.name not in _TASK_SETTINGS:
            continue
        value = None
        where = setting.conf_key
        if setting.task_option and task is not None:
            value = _task_option(task, setting.conf_key)
            where = f"{setting.conf_key} (task {task_name})"
            if setting.name in legacy:
                if value is not None:
                    raise SingletonConfigError(
                        f"task {task_name}: {setting.conf_key} and its old spelling are both "
                        "set; keep the new one"
                    )
                value = legacy[setting.name]
        if value is None and setting.app_fallback:
            value = conf.get(setting.conf_key)
            where = setting.conf_key
        if value is None:
            value = setting.default
        values[setting.name] = setting.check(where, value)
    values["redis_url"] = resolve_redis_url(conf)
    if values["completion_ttl"] is None and task is not None:
        values["completion_ttl"] = default_completion_ttl(conf, task)
    if values["key_args"] is not None and values["key"] is not None:
        raise SingletonConfigError(
            f"task {task_name}: set singleton_key_args or singleton_key, not both"
        )
    if values["on_duplicate"] == "coalesce" and values["lock_on"] != "execute":
        raise SingletonConfigError(
            f"{_where_policy(task_name)}: singleton_on_duplicate 'coalesce' needs "
            "singleton_lock_on 'execute' (a duplicate is coalesced where it runs)"
        )
    if values["on_duplicate"] == "coalesce" and values["lock_at_least"] > 0:
        raise SingletonConfigError(
            f"{_where_policy(task_name)}: singleton_on_duplicate 'coalesce' does not go with "
            "singleton_lock_at_least (a burst met in the window would give two runs after it, "
            "not one follow-up); use 'skip' or 'retry' with a window, or coalesce without one"
        )
    if values["permits"] > 1:
        _check_permits(task_name, values)
    return Options(**values)


def _where_policy(task_name: str | None) -> str:
    return "app settings" if task_name is None else f"task {task_name}"


def _check_permits(task_name: str | None, values: Mapping[str, Any]) -> None:
    """Refuse what permits > 1 does not support: Redlock, publish-time dedup, coalesce."""
    where = "singleton_permits" if task_name is None else f"task {task_name}: singleton_permits"
    if URL_KINDS.get(url_scheme(values["redis_url"]).lower()) == "redlock":
        raise SingletonConfigError(
            f"{where} > 1 is not supported with a redis+redlock:// URL (a permit slot would "
            "need a majority of its own on every master); use 1 permit, or one server, "
            "Sentinel or Cluster"
        )
    if values["lock_on"] != "execute":
        raise SingletonConfigError(
            f'{where} > 1 needs singleton_lock_on "execute": a queued marker stands for one '
            f"run, got lock_on {values['lock_on']!r}"
        )
    if values["on_duplicate"] == "coalesce":
        raise SingletonConfigError(
            f"{where} > 1 does not go with singleton_on_duplicate 'coalesce' (a follow-up "
            "waits beside one lock, not beside N slots)"
        )


def describe(options: Options, conf: ConfLike | None = None) -> Mapping[str, str]:
    """The settings as shown in start-up banners (password hidden); ``conf`` gives the broker
    the default ``completion_ttl`` is derived from."""
    conf = {} if conf is None else conf
    return {
        "redis": redact_url(options.redis_url),
        "prefix": options.key_prefix,
        "ttl": f"{options.ttl:g}s",
        "on_duplicate": options.on_duplicate,
        "on_redis_error": options.on_redis_error,
        "retry_countdown": f"{options.retry_countdown:g}s",
        "max_hold": "none" if options.max_hold is None else f"{options.max_hold:g}s",
        "lock_on": options.lock_on,
        "publish_ttl": f"{options.publish_ttl:g}s",
        "completion_ttl": (
            f"{options.completion_ttl:g}s"
            if options.completion_ttl is not None
            else f"acks_late tasks: {describe_default_completion_ttl(conf)}"
        ),
    }


def _broker_visibility(conf: ConfLike) -> float | None:
    """The broker's visibility timeout (Redis, SQS), or None for a broker without one."""
    broker = conf.get("broker_url")
    scheme = broker.split("://", 1)[0].lower() if isinstance(broker, str) else ""
    scheme = scheme.split("+", 1)[0]
    if scheme not in _VISIBILITY_DEFAULTS:
        return None
    options = conf.get("broker_transport_options") or {}
    value = options.get("visibility_timeout") if isinstance(options, Mapping) else None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return _VISIBILITY_DEFAULTS[scheme]


def default_completion_ttl(conf: ConfLike, task: object) -> float:
    """``completion_ttl`` when not set: 0 for a task acked early; else the broker's visibility
    timeout + :data:`COMPLETION_MARGIN_S`, or :data:`DEFAULT_COMPLETION_TTL_S`."""
    acks_late = getattr(task, "acks_late", None)
    if acks_late is None:
        acks_late = conf.get("task_acks_late")
    if not acks_late:
        return 0.0
    visibility = _broker_visibility(conf)
    return DEFAULT_COMPLETION_TTL_S if visibility is None else visibility + COMPLETION_MARGIN_S


def describe_default_completion_ttl(conf: ConfLike) -> str:
    """The default ``completion_ttl`` of a task acked late, as the banner shows it."""
    visibility = _broker_visibility(conf)
    if visibility is None:
        return f"{DEFAULT_COMPLETION_TTL_S:g}s"
    return f"{visibility + COMPLETION_MARGIN_S:g}s (visibility_timeout + {COMPLETION_MARGIN_S:g}s)"
