"""The settings table: every setting's name, default, check and documentation.

Settings are read at use time from ``app.conf`` (``singleton_<name>``; with
``namespace="CELERY"`` Celery maps ``CELERY_SINGLETON_<NAME>`` onto the same key). A task
option ``singleton_<name>`` on the task overrides the app-wide value. Nothing here is
written into ``app.conf``: ``add_defaults`` would override what the user configured.

Knows nothing of Celery's classes: it reads any mapping with ``get``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

from .compat import legacy_options
from .errors import SingletonConfigError
from .keys import check_prefix

__all__ = [
    "LOCK_ON",
    "POLICIES",
    "SETTINGS",
    "BeatOptions",
    "LockUrl",
    "Options",
    "Setting",
    "parse_lock_url",
    "read_beat_options",
    "read_options",
    "redact_url",
    "repr_without_password",
    "resolve_redis_url",
]

POLICIES = ("skip", "retry", "raise")
LOCK_ON = ("execute", "publish", "both")
REDIS_ERROR_POLICIES = ("fail", "run")
BEAT_MODES = ("active", "leader")
DEFAULT_REDIS_URL = "redis://localhost:6379/0"
#: Schemes of singleton_redis_url, by the kind of deployment they reach.
URL_KINDS = {
    "redis": "single",
    "rediss": "single",
    "unix": "single",
    "redis+sentinel": "sentinel",
    "rediss+sentinel": "sentinel",
    "redis+cluster": "cluster",
    "rediss+cluster": "cluster",
    "redis+redlock": "redlock",
    "rediss+redlock": "redlock",
}
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_CLUSTER_PORT = 6379
DEFAULT_WAIT_TIMEOUT_S = 1.0
#: Fewest masters a redis+redlock:// URL may list: with 2 the lock survives no failure at all.
MIN_REDLOCK_MASTERS = 3


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
    if not isinstance(value, str) or _scheme(value) not in URL_KINDS:
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


def repr_without_password(obj: Any) -> str:
    """A dataclass's repr with its ``redis_url`` field through :func:`redact_url`.

    Objects that keep the lock store URL use it as their ``__repr__``: reprs end up in logs and
    in the frame locals error trackers capture.
    """
    shown = []
    for item in dataclasses.fields(obj):
        if item.repr:
            value = getattr(obj, item.name)
            if item.name == "redis_url" and isinstance(value, str):
                value = redact_url(value)
            shown.append(f"{item.name}={value!r}")
    return f"{type(obj).__qualname__}({', '.join(shown)})"


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
    present = _query_names(url)
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


#: A password in a URL's query (``password=``, ``sentinel_password=``, ``ssl_password=``, the
#: key file's): the value is group 2.
_QUERY_SECRET = re.compile(r"([?&;](?:sentinel_|ssl_)?password=)([^&;#]*)", re.IGNORECASE)


def _query_secrets(url: str) -> list[str]:
    return [m.group(2) for m in _QUERY_SECRET.finditer(url)]


def redact_url(url: str) -> str:
    """The URL with any password replaced by ``***``; never raises.

    Hides the password of the user info (also before a comma-separated host list) and the
    values of the ``password``, ``sentinel_password`` and ``ssl_password`` query options.
    """
    start, password = _split_password(url)
    if password is not None:
        url = f"{start}***{url[len(start) + len(password) :]}"
    return _QUERY_SECRET.sub(lambda m: f"{m.group(1)}***", url)


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


# -- lock store URLs ------------------------------------------------------------------------------

#: Query options of this library, removed before redis-py sees the URL.
_WAIT_OPTIONS = ("wait_replicas", "wait_timeout")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_REDLOCK_OPTIONS = ("master_timeout",)
#: Query options redis-py takes as strings (the typed ones are in URL_QUERY_ARGUMENT_PARSERS).
_STRING_OPTIONS = (
    "username",
    "password",
    "client_name",
    "ssl_cert_reqs",
    "ssl_ca_certs",
    "ssl_ca_path",
    "ssl_ca_data",
    "ssl_certfile",
    "ssl_keyfile",
    "ssl_password",
)
_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]*")


@dataclass(frozen=True)
class LockUrl:
    """A parsed ``singleton_redis_url``: which deployment, and how to connect to it.

    ``kind`` is ``"single"`` (``redis://``, ``rediss://``, ``unix://``: one server, reached
    by redis-py's own URL parser with ``redis_url``), ``"sentinel"``, ``"cluster"`` or
    ``"redlock"`` (``nodes`` are the sentinels, the cluster's seed nodes or the independent
    masters, ``options`` the connection keywords of the data nodes, ``sentinel_options`` those
    of the sentinels; ``master_timeout_s`` is a Redlock URL's ``master_timeout``, None when
    not given). Passwords are kept out of ``repr``.
    """

    kind: str
    redis_url: str = field(default="", repr=False)
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    tls: bool = False
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    sentinel_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    wait_replicas: int = 0
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    master_timeout_s: float | None = None


def parse_lock_url(url: str) -> LockUrl:
    """Parse a lock store URL; ``ValueError`` with a reason that never shows the password.

    - ``redis://``, ``rediss://``, ``unix://``: as redis-py parses them;
    - ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db][?opts]``
      (default port 26379; ``sentinel_username``/``sentinel_password`` authenticate to the
      sentinels themselves);
    - ``redis+cluster://[[user]:password@]host[:port][,host[:port]...][/0][?opts]``
      (default port 6379; any listed node serves to discover the cluster);
    - ``redis+redlock://[[user]:password@]host[:port],host[:port],host[:port][...][/db][?opts]``
      (default port 6379): at least 3 independent masters, all with the same credentials,
      database and options; ``master_timeout=<seconds>`` is how long a call waits for them;
    - ``rediss+sentinel://``, ``rediss+cluster://`` and ``rediss+redlock://``: the same over TLS.

    Every kind but Redlock takes ``wait_replicas=<n>`` and ``wait_timeout=<seconds>`` in its
    query, and every kind redis-py's connection options (``socket_timeout``, ...).
    """
    try:
        return _parse_lock_url(url)
    except ValueError as exc:
        raise ValueError(_safe_reason(url, str(exc))) from None


def _safe_reason(url: str, reason: str) -> str:
    """``reason``, or "malformed" when it shows a piece of a password in ``url``."""
    secrets = [s for s in (_split_password(url)[1], *_query_secrets(url)) if s]
    pieces = [p for s in secrets for p in re.split(r"[/?#@:\[\],&=]", s) if p]
    if any(piece in reason for piece in pieces):
        return "malformed"  # a parser split the password: its reason would show part
    return reason


def _parse_lock_url(url: str) -> LockUrl:
    scheme = _scheme(url)
    kind = URL_KINDS.get(scheme)
    if kind is None:
        raise ValueError("unknown scheme")
    rest, own = _take_options(url, _WAIT_OPTIONS + _SENTINEL_OPTIONS + _REDLOCK_OPTIONS)
    if kind != "redlock" and "master_timeout" in own:
        raise ValueError("master_timeout needs a redis+redlock:// URL")
    wait_replicas, wait_timeout = _wait_options(own)
    if kind == "single":
        if any(name in own for name in _SENTINEL_OPTIONS):
            raise ValueError("sentinel_username/sentinel_password need a redis+sentinel:// URL")
        parse_url(rest)  # type: ignore[no-untyped-call]
        return LockUrl(
            kind, redis_url=rest, wait_replicas=wait_replicas, wait_timeout_s=wait_timeout
        )
    tls = scheme.startswith("rediss")
    body = rest.split("://", 1)[1]
    body, _, query = body.partition("?")
    userinfo, _, hostpart = body.rpartition("@")
    hosts, _, path = hostpart.partition("/")
    default_port = DEFAULT_SENTINEL_PORT if kind == "sentinel" else DEFAULT_CLUSTER_PORT
    nodes = _nodes(hosts, default_port)
    if kind == "redlock":
        return _redlock_url(nodes, userinfo, query, path, tls, own)
    options: dict[str, Any] = _userinfo(userinfo)
    options.update(_query_options(query, tls))
    if tls:
        options["ssl"] = True
    service = ""
    if kind == "sentinel":
        service, db = _sentinel_path(path)
        options.setdefault("db", db)
        if any(name in own and not own[name] for name in _SENTINEL_OPTIONS):
            raise ValueError("sentinel_username/sentinel_password must not be empty")
    else:
        if path.strip("/") not in ("", "0") or options.pop("db", 0) != 0:
            raise ValueError("a cluster has only database 0")
        if any(name in own for name in _SENTINEL_OPTIONS):
            raise ValueError("sentinel_username/sentinel_password need a redis+sentinel:// URL")
    sentinel_options: dict[str, Any] = {}
    if kind == "sentinel":
        sentinel_options = {k: v for k, v in options.items() if k.startswith(("socket_", "ssl"))}
        if "sentinel_username" in own:
            sentinel_options["username"] = own["sentinel_username"]
        if "sentinel_password" in own:
            sentinel_options["password"] = own["sentinel_password"]
    return LockUrl(
        kind,
        nodes=nodes,
        service=service,
        tls=tls,
        options=options,
        sentinel_options=sentinel_options,
        wait_replicas=wait_replicas,
        wait_timeout_s=wait_timeout,
    )


def _redlock_url(  # noqa: PLR0917 - the pieces _parse_lock_url split the URL into
    nodes: tuple[tuple[str, int], ...],
    userinfo: str,
    query: str,
    path: str,
    tls: bool,
    own: Mapping[str, str],
) -> LockUrl:
    """The masters of a ``redis+redlock://`` URL: at least 3, each listed once."""
    if len(nodes) < MIN_REDLOCK_MASTERS:
        raise ValueError(
            f"Redlock needs at least {MIN_REDLOCK_MASTERS} masters, got {len(nodes)} "
            "(with 2 a majority is both, so it survives no failure; use an odd number)"
        )
    if len(set(nodes)) != len(nodes):
        raise ValueError("a master is listed twice in the host list")
    if any(name in own for name in (*_WAIT_OPTIONS, *_SENTINEL_OPTIONS)):
        raise ValueError(
            "wait_replicas/wait_timeout and sentinel_* do not apply to redis+redlock:// "
            "(its masters are independent: a lock is safe once a majority has it)"
        )
    options: dict[str, Any] = _userinfo(userinfo)
    options.update(_query_options(query, tls))
    if tls:
        options["ssl"] = True
    db = path.strip("/") or "0"
    if not db.isdigit():
        raise ValueError("the database must be a number")
    options.setdefault("db", int(db))
    master_timeout = _seconds(own, "master_timeout") if "master_timeout" in own else None
    return LockUrl(
        "redlock", nodes=nodes, tls=tls, options=options, master_timeout_s=master_timeout
    )


def _query_names(url: str) -> set[str]:
    query = url.partition("?")[2].partition("#")[0]
    return {unquote_plus(part.partition("=")[0]) for part in query.split("&") if part}


def _take_options(url: str, names: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """The URL without the query options ``names``, and their (decoded) values."""
    base, question, query = url.partition("?")
    if not question:
        return url, {}
    kept: list[str] = []
    taken: dict[str, str] = {}
    for part in query.split("&"):
        name, _, value = part.partition("=")
        if unquote_plus(name) in names:
            taken[unquote_plus(name)] = unquote_plus(value)
        elif part:
            kept.append(part)
    return (f"{base}?{'&'.join(kept)}" if kept else base), taken


def _wait_options(own: Mapping[str, str]) -> tuple[int, float]:
    replicas, timeout = 0, DEFAULT_WAIT_TIMEOUT_S
    if "wait_replicas" in own:
        text = own["wait_replicas"]
        if not text.isdigit():
            raise ValueError("wait_replicas must be an integer >= 0")
        replicas = int(text)
    if "wait_timeout" in own:
        timeout = _seconds(own, "wait_timeout")
    return replicas, timeout


def _seconds(own: Mapping[str, str], name: str) -> float:
    """The query option ``name``: a finite number of seconds > 0."""
    try:
        value = float(own[name])
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0")
    return value


def _nodes(hosts: str, default_port: int) -> tuple[tuple[str, int], ...]:
    nodes: list[tuple[str, int]] = []
    for entry in hosts.split(","):
        item = entry.strip()
        if item.startswith("["):
            host, bracket, port = item[1:].partition("]")
            if not bracket or (port and not port.startswith(":")):
                raise ValueError("malformed IPv6 address in the host list")
            port = port[1:]
        else:
            host, _, port = item.partition(":")
        if not host:
            raise ValueError("empty host in the host list")
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ValueError("invalid port in the host list")
        nodes.append((unquote(host), int(port) if port else default_port))
    return tuple(nodes)


def _userinfo(userinfo: str) -> dict[str, Any]:
    user, colon, password = userinfo.partition(":")
    options: dict[str, Any] = {}
    if user:
        options["username"] = unquote(user)
    if colon and password:
        options["password"] = unquote(password)
    return options


def _query_options(query: str, tls: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, values in parse_qs(query).items():
        value = values[0]
        parser = cast("Callable[[str], Any] | None", URL_QUERY_ARGUMENT_PARSERS.get(name))
        if parser is not None:
            try:
                options[name] = parser(value)
            except (TypeError, ValueError):
                raise ValueError(f"invalid value for {name!r}") from None
        elif name in _STRING_OPTIONS:
            options[name] = value
        else:
            shown = repr(name) if _OPTION_NAME.fullmatch(name) else "in the query"
            raise ValueError(f"unknown option {shown}")
        if name.startswith("ssl") and not tls:
            raise ValueError(f"{name} needs TLS: use a rediss+... URL")
    return options


def _sentinel_path(path: str) -> tuple[str, int]:
    parts = path.strip("/").split("/") if path.strip("/") else []
    if not parts or not parts[0]:
        raise ValueError("no service name: redis+sentinel://host:port/<service name>[/db]")
    if len(parts) > 2:
        raise ValueError("the path is /<service name>[/<db>]")
    db = 0
    if len(parts) == 2:
        if not parts[1].isdigit():
            raise ValueError("the database must be a number")
        db = int(parts[1])
    return unquote(parts[0]), db
