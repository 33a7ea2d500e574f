"""Reading the settings: a task's :class:`Options` and beat's :class:`BeatOptions`.

What :mod:`.config`'s table holds, read from ``app.conf`` and merged with a task's
``singleton_*`` attributes (and their old spellings), each value checked by its row; then the
rules that span several settings (coalesce, permits), the defaults derived from other settings
(the Redis URL from the broker's, ``completion_ttl`` from ``acks_late`` and the broker's
visibility timeout) and the settings as start-up banners show them.

Knows nothing of Celery's classes: it reads any mapping with ``get`` (the broker as
:mod:`.broker` reads it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from ..core.connection import SOCKET_TIMEOUT_S
from ..core.urls import (
    DEFAULT_WAIT_TIMEOUT_S,
    URL_KINDS,
    query_names,
    redact_url,
    repr_without_password,
    url_scheme,
)
from ..errors import SingletonConfigError
from .broker import ConfLike, redis_broker_url, visibility_timeout
from .legacy import legacy_options, renamed
from .table import (
    COMPLETION_MARGIN_S,
    DEFAULT_COMPLETION_TTL_S,
    DEFAULT_REDIS_URL,
    SETTINGS,
    UNLIMITED,
)

__all__ = [
    "BeatOptions",
    "Options",
    "default_completion_ttl",
    "failure_is_final",
    "read_beat_options",
    "read_options",
    "redis_url_defaulted",
    "refuse_with",
    "resolve_redis_url",
]


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


@dataclass(frozen=True)
class BeatOptions:
    """The checked settings of SingletonScheduler."""

    __repr__ = repr_without_password

    redis_url: str
    key_prefix: str
    mode: str
    skew: float
    #: ``singleton_beat_lock_at_least``: the least time a run's claim is kept
    lock_at_least: float
    lease: float
    #: ``singleton_beat_catch_up``: "none", "latest" or a window in seconds
    catch_up: str | float = "latest"


def read_beat_options(conf: ConfLike) -> BeatOptions:
    """Check the settings SingletonScheduler uses."""
    values = {
        name: SETTINGS[name].check(SETTINGS[name].conf_key, _conf_value(conf, name))
        for name in ("key_prefix", "beat_mode", "beat_skew", "beat_lease", "beat_catch_up")
    }
    url = resolve_redis_url(conf)
    if values["beat_mode"] == "leader":
        url = _lease_timeouts(url, values["beat_lease"])
    return BeatOptions(
        redis_url=url,
        key_prefix=values["key_prefix"],
        mode=values["beat_mode"],
        skew=values["beat_skew"],
        lock_at_least=_beat_lock_at_least(conf),
        lease=values["beat_lease"],
        catch_up=values["beat_catch_up"],
    )


#: Leader mode: the longest a Redis call of a beat may wait (each socket timeout), as a part of
#: the lease. A renewal starts a third of the lease after the last one; one that hangs must
#: fail (connecting and reading: half the lease) before the leader stops trusting its lease
#: (beat/leader.py, 0.9 of it).
LEASE_TIMEOUT_PART = 0.25
_TIMEOUTS = ("socket_timeout", "socket_connect_timeout")


def _lease_timeouts(url: str, lease: float) -> str:
    """Leader mode's lock URL: socket timeouts of a quarter of the lease (at most the usual
    5 s) unless it sets its own, which may not be longer (refused). Not for Redlock, whose
    calls end after its ``master_timeout`` whatever the sockets do."""
    if URL_KINDS.get(url_scheme(url)) == "redlock":
        return url
    bound = lease * LEASE_TIMEOUT_PART
    query = parse_qs(url.partition("?")[2].partition("#")[0])
    for name in _TIMEOUTS:
        given = _seconds_or_none(query.get(name, [None])[0])
        if given is not None and given > bound:
            raise SingletonConfigError(
                f"app settings: singleton_beat_lease={lease:g} needs the lock URL's {name} at "
                f"most {bound:g}s (a quarter of the lease), got {given:g}: a renewal that hangs "
                "must fail while the leader can still trust its lease"
            )
    default = min(SOCKET_TIMEOUT_S, bound)
    extra = [f"{name}={default:g}" for name in _TIMEOUTS if name not in query]
    return f"{url}{'&' if '?' in url else '?'}{'&'.join(extra)}" if extra else url


def _seconds_or_none(value: str | None) -> float | None:
    try:
        return None if value is None else float(value)
    except ValueError:  # the URL's own check names it
        return None


def _beat_lock_at_least(conf: ConfLike) -> float:
    """``singleton_beat_lock_at_least``, or its old spelling, an app-wide
    ``singleton_lock_at_least`` (checked, then a DeprecationWarning); both: refused."""
    new, old = SETTINGS["beat_lock_at_least"].conf_key, SETTINGS["lock_at_least"].conf_key
    value = conf.get(old)
    if value is None:
        return float(_conf_checked(conf, "beat_lock_at_least"))
    if conf.get(new) is not None:
        raise SingletonConfigError(
            f"app settings: {old} and {new} are both set; keep {new} (beat reads an app-wide "
            f"{old} as its old spelling)"
        )
    checked = float(SETTINGS["beat_lock_at_least"].check(old, value))
    renamed("app settings", f"{old} (beat's claims)", f"{new}={value!r}")
    return checked


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
    #: 0: ``singleton_permits="unlimited"`` (or None given on the task, its deprecated
    #: spelling): no limit on runs at once (a rate only)
    permits: int = 1
    #: ``(limit, period_ms)``: at most ``limit`` runs of a key start within any ``period_ms``
    rate_limit: tuple[int, int] | None = None
    #: under ``"queue"``: the most calls one key's queue holds
    queue_max: int = 1000
    #: under ``"cancel"``: seconds until a holder asked to stop is terminated (None: never)
    cancel_grace: float | None = None

    #: None when read without a task (the banner): it depends on the task's acks_late
    completion_ttl: float | None = None
    #: ``completion_ttl`` for a run whose message carried an eta or countdown: such a message
    #: waits unacknowledged in the worker until its eta, acked early or not, and a Redis or
    #: SQS broker hands it out again after its visibility timeout (a RabbitMQ one after its
    #: consumer_timeout). The setting when given, else the default of a task acked late.
    delayed_completion_ttl: float | None = None
    #: the task's at-least window (0: none); never the app-wide (beat's) value
    lock_at_least: float = 0.0
    #: debounce window and its cap, seconds (duplicates/debounce.py); None: off / no cap
    debounce: float | None = None
    debounce_max: float | None = None
    #: not a setting: whether a run that ends in FAILURE ends its message (records its
    #: completion). False for a task acked late whose failures are not acknowledged
    #: (``acks_on_failure``/``acks_on_failure_or_timeout`` False): the broker may deliver the
    #: message again (SQS after its visibility timeout, a dead-letter queue routed back)
    failure_is_final: bool = True

    def completion_ttl_of(self, delayed: bool) -> float:
        """The completion ttl of a run: ``delayed``, its message carried an eta or countdown."""
        return (self.delayed_completion_ttl if delayed else self.completion_ttl) or 0.0

    @functools.cached_property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl * 1000))

    @property
    def store_kind(self) -> str | None:
        """The lock store's kind, by the URL's scheme: ``"single"``, ``"sentinel"``,
        ``"cluster"`` or ``"redlock"`` (core/urls.py)."""
        return URL_KINDS.get(url_scheme(self.redis_url).lower())


_TASK_SETTINGS = frozenset(Options.__dataclass_fields__)


def resolve_redis_url(conf: ConfLike) -> str:
    """``singleton_redis_url``, else a Redis broker's (first) URL as Celery resolves it (the
    ``CELERY_BROKER_URL`` environment variable included), else the local default.

    ``singleton_wait_replicas``, ``singleton_wait_timeout`` and ``singleton_fence_margin`` are
    folded into the URL's query (``wait_replicas=``, ``wait_timeout=``, ``fence_margin=``)
    unless it names them already, so the URL alone describes the lock store of a process.
    """
    url = _check_url("singleton_redis_url", conf.get("singleton_redis_url"))
    if not url:
        url = redis_broker_url(conf) or DEFAULT_REDIS_URL
    present = query_names(url)
    extra: list[str] = []
    replicas = _conf_checked(conf, "wait_replicas")
    if replicas and "wait_replicas" not in present:
        extra.append(f"wait_replicas={replicas}")
    timeout = _conf_checked(conf, "wait_timeout")
    if timeout != DEFAULT_WAIT_TIMEOUT_S and "wait_timeout" not in present:
        extra.append(f"wait_timeout={timeout:g}")
    margin = _conf_checked(conf, "fence_margin")
    if margin != SETTINGS["fence_margin"].default and "fence_margin" not in present:
        extra.append(f"fence_margin={margin:g}")
    if extra:
        url = f"{url}{'&' if '?' in url else '?'}{'&'.join(extra)}"
        _check_url(
            "singleton_redis_url (with singleton_wait_replicas/wait_timeout/fence_margin)", url
        )
    return url


def redis_url_defaulted(conf: ConfLike) -> bool:
    """Whether :func:`resolve_redis_url` falls back to the local default: no
    ``singleton_redis_url``, and a broker that is not Redis (a RabbitMQ or SQS one, or none)."""
    return not conf.get("singleton_redis_url") and redis_broker_url(conf) is None


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
        if value is None and setting.name == "permits" and _given_none(task, setting.conf_key):
            renamed(
                f"task {task_name}", "singleton_permits=None", f"singleton_permits={UNLIMITED!r}"
            )
            value = UNLIMITED  # None given on the task: its old spelling
        if value is None and setting.app_fallback:
            value = conf.get(setting.conf_key)
            where = setting.conf_key
        if value is None:
            value = setting.default
        values[setting.name] = setting.check(where, value)
    values["redis_url"] = resolve_redis_url(conf)
    if task is not None:
        if values["completion_ttl"] is None:  # not given: the defaults, by how it was sent
            values["completion_ttl"] = default_completion_ttl(conf, task)
            values["delayed_completion_ttl"] = default_completion_ttl(conf, task, delayed=True)
        else:
            values["delayed_completion_ttl"] = values["completion_ttl"]
        values["failure_is_final"] = failure_is_final(conf, task)
    if values["key_args"] is not None and values["key"] is not None:
        raise SingletonConfigError(
            f"task {task_name}: set singleton_key_args or singleton_key, not both"
        )
    opts = Options(**values)
    for refusal in _REFUSALS:  # what spans several settings: each part's own (duplicates/)
        reason = refusal(opts)
        if reason is not None:
            raise SingletonConfigError(f"{_where_policy(task_name)}: {reason}")
    return opts


_LIBRARY = __name__.split(".", 1)[0] + "."


def _given_none(task: object | None, name: str) -> bool:
    """Whether ``task`` was given option ``name`` as None (``@app.task(singleton_permits=None)``,
    or a class attribute of a task class of the user's), not merely left unset."""
    if task is None:
        return False
    if name in vars(task):
        return vars(task)[name] is None
    for klass in type(task).__mro__:
        if name in vars(klass):
            return vars(klass)[name] is None and not klass.__module__.startswith(_LIBRARY)
    return False


def _where_policy(task_name: str | None) -> str:
    return "app settings" if task_name is None else f"task {task_name}"


#: Why a task's settings cannot go together: one line naming both settings, or None.
Refusal = Callable[[Options], "str | None"]

#: The checks that span several settings, each given by the wing that knows them (the parts a
#: task's settings select: duplicates/policy.py); :func:`read_options` asks each in turn.
_REFUSALS: list[Refusal] = []


def refuse_with(refusal: Refusal) -> Refusal:
    """Ask ``refusal`` of every task's settings read from now on (once per process)."""
    if refusal not in _REFUSALS:
        _REFUSALS.append(refusal)
    return refusal


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


def default_completion_ttl(conf: ConfLike, task: object, *, delayed: bool = False) -> float:
    """``completion_ttl`` when not set: 0 for a task acked early, unless its message carried an
    eta or countdown (``delayed``: it waited unacknowledged); else the broker's visibility
    timeout + :data:`COMPLETION_MARGIN_S`, or :data:`DEFAULT_COMPLETION_TTL_S`."""
    if not delayed and not _task_flag(conf, task, "acks_late"):
        return 0.0
    visibility = visibility_timeout(conf)
    return DEFAULT_COMPLETION_TTL_S if visibility is None else visibility + COMPLETION_MARGIN_S


def _task_flag(conf: ConfLike, task: object, *names: str) -> Any:
    """The first of the task attributes ``names`` that is set, else the first app setting
    ``task_<name>`` that is; None when none is."""
    for name in names:
        value = getattr(task, name, None)
        if value is not None:
            return value
    for name in names:
        value = conf.get(f"task_{name}")
        if value is not None:
            return value
    return None


def failure_is_final(conf: ConfLike, task: object) -> bool:
    """Whether a ``FAILURE`` ends the task's message: yes unless the task is acked late and
    its failures are not acknowledged (Celery then rejects the message without requeueing
    it, and SQS delivers it again after its visibility timeout, RabbitMQ to a dead-letter
    exchange). ``acks_on_failure`` (Celery 5.7), else ``acks_on_failure_or_timeout``."""
    if not _task_flag(conf, task, "acks_late"):
        return True
    acked = _task_flag(conf, task, "acks_on_failure", "acks_on_failure_or_timeout")
    return acked is None or bool(acked)


def describe_default_completion_ttl(conf: ConfLike) -> str:
    """The default ``completion_ttl`` of a task acked late, as the banner shows it."""
    visibility = visibility_timeout(conf)
    if visibility is None:
        return f"{DEFAULT_COMPLETION_TTL_S:g}s"
    return f"{visibility + COMPLETION_MARGIN_S:g}s (visibility_timeout + {COMPLETION_MARGIN_S:g}s)"


def _check_url(name: str, value: Any) -> str | None:
    """The ``redis_url`` row's check (a lock store URL, or None)."""
    checked: str | None = SETTINGS["redis_url"].check(name, value)
    return checked
