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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from .compat import legacy_options
from .core.keys import check_prefix
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
    "LOCK_ON",
    "POLICIES",
    "SETTINGS",
    "BeatOptions",
    "Options",
    "Setting",
    "read_beat_options",
    "read_options",
    "resolve_redis_url",
]

POLICIES = ("skip", "retry", "raise")
LOCK_ON = ("execute", "publish", "both")
REDIS_ERROR_POLICIES = ("fail", "run")
BEAT_MODES = ("active", "leader")
DEFAULT_REDIS_URL = "redis://localhost:6379/0"


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
            '"retry" (requeue every `retry_countdown` seconds until it can run) or '
            '"raise" (fail with DuplicateTaskError).',
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
            "Keep each scheduled run's claim at least this many seconds after it was "
            "published (the claim is otherwise kept for two schedule periods).",
            task_option=False,
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
        if value is None:
            value = conf.get(setting.conf_key)
            where = setting.conf_key
        if value is None:
            value = setting.default
        values[setting.name] = setting.check(where, value)
    values["redis_url"] = resolve_redis_url(conf)
    if values["key_args"] is not None and values["key"] is not None:
        raise SingletonConfigError(
            f"task {task_name}: set singleton_key_args or singleton_key, not both"
        )
    return Options(**values)


def describe(options: Options) -> Mapping[str, str]:
    """The settings as shown in start-up banners (password hidden)."""
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
    }
