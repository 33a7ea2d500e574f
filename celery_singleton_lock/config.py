"""The settings table: every setting's name, default, check and documentation.

Settings are read at use time from ``app.conf`` (``singleton_<name>``; with
``namespace="CELERY"`` Celery maps ``CELERY_SINGLETON_<NAME>`` onto the same key). A task
option ``singleton_<name>`` on the task overrides the app-wide value. Nothing here is
written into ``app.conf``: ``add_defaults`` would override what the user configured.

Knows nothing of Celery's classes: it reads any mapping with ``get``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from redis.connection import parse_url

from .errors import SingletonConfigError
from .keys import check_prefix

__all__ = [
    "POLICIES",
    "SETTINGS",
    "BeatOptions",
    "Options",
    "Setting",
    "read_beat_options",
    "read_options",
    "redact_url",
    "resolve_redis_url",
]

POLICIES = ("skip", "retry", "raise")
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
    if value is not None and not callable(value):
        raise SingletonConfigError(f"{name} must be a callable(args, kwargs) -> str, got {value!r}")
    return value  # type: ignore[no-any-return]


def _url(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or _scheme(value) not in ("redis", "rediss", "unix"):
        shown = redact_url(value) if isinstance(value, str) else repr(value)
        raise SingletonConfigError(
            f"{name} must be a redis://, rediss:// or unix:// URL, got {shown}"
        )
    try:  # what redis-py would refuse at the first task: the port, the db, query options
        parse_url(value)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        reason = str(exc)
        password = _split_password(value)[1] or ""
        if any(part and part in reason for part in re.split(r"[/?#@:\[\]]", password)):
            reason = "malformed"  # the parser split the password: its reason would show part
        raise SingletonConfigError(
            f"{name} is not a usable Redis URL ({reason}), got {redact_url(value)}"
        ) from None
    return value


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return ""


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
            "Redis holding the locks. Default: `broker_url` when it is redis:// or "
            "rediss://, else redis://localhost:6379/0.",
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

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))


_TASK_SETTINGS = frozenset(Options.__dataclass_fields__)


def resolve_redis_url(conf: ConfLike) -> str:
    """``singleton_redis_url``, else a Redis broker URL, else the local default."""
    url = _url("singleton_redis_url", conf.get("singleton_redis_url"))
    if url:
        return url
    broker = conf.get("broker_url")
    if isinstance(broker, str) and broker.split("://", 1)[0] in ("redis", "rediss"):
        return broker.split(";", 1)[0]
    return DEFAULT_REDIS_URL


def read_options(conf: ConfLike, task: object | None = None) -> Options:
    """Check and merge the app-wide settings with the task's ``singleton_*`` attributes."""
    task_name = getattr(task, "name", None)
    values: dict[str, Any] = {}
    for setting in SETTINGS.values():
        if setting.name not in _TASK_SETTINGS:
            continue
        value = None
        where = setting.conf_key
        if setting.task_option and task is not None:
            value = getattr(task, setting.conf_key, None)
            where = f"{setting.conf_key} (task {task_name})"
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


#: A URL's scheme and the slashes after it ("redis://", also the malformed "redis:/").
_SCHEME_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/+")


def _split_password(url: str) -> tuple[str, str | None]:
    """``(url up to the password, the password or None)``; never raises.

    Everything between the scheme and the *last* ``@`` is taken as the user info, so a
    password with an unescaped ``/``, ``?`` or ``#`` (which URL parsers split wrongly) is
    found too; a URL without a password gives ``(url, None)``.
    """
    head, at, _hostinfo = url.rpartition("@")
    match = _SCHEME_PREFIX.match(head)
    prefix = match.group(0) if match else ""
    user, colon, password = head[len(prefix) :].partition(":")
    if not at or not colon:
        return url, None
    return f"{prefix}{user}:", password


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``; never raises."""
    start, password = _split_password(url)
    if password is None:
        return url
    return f"{start}***{url[len(start) + len(password) :]}"


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
    }
