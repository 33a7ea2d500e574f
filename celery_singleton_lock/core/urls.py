"""Lock store URLs: which deployment a ``singleton_redis_url`` reaches, and its password hidden.

:func:`parse_lock_url` turns a URL into a :class:`LockUrl` (the kind of deployment and how to
connect to it); :func:`redact_url` and :func:`repr_without_password` keep the password out of
everything a user or a tool can see. Redis and the standard library only.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qs, unquote, unquote_plus, urlsplit

from redis.connection import URL_QUERY_ARGUMENT_PARSERS, parse_url

__all__ = [
    "DEFAULT_WAIT_TIMEOUT_S",
    "URL_KINDS",
    "LockUrl",
    "parse_lock_url",
    "query_names",
    "redact_url",
    "repr_without_password",
    "url_scheme",
]

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


def url_scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return ""


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


# -- lock store URLs ------------------------------------------------------------------------------

#: Query options of this library, removed before redis-py sees the URL.
_WAIT_OPTIONS = ("wait_replicas", "wait_timeout")
_SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
_REDLOCK_OPTIONS = ("master_timeout",)
#: every kind's: how long a fencing counter outlives its lock's ttl, seconds
_FENCE_OPTIONS = ("fence_margin",)
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
    not given). ``fence_margin_s`` is the URL's ``fence_margin`` (any kind), None when not
    given. Passwords are kept out of ``repr``.
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
    fence_margin_s: float | None = None


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
    query, every kind ``fence_margin=<seconds>`` (how long a fencing counter outlives its
    lock's ttl) and redis-py's connection options (``socket_timeout``, ...).
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
    scheme = url_scheme(url)
    kind = URL_KINDS.get(scheme)
    if kind is None:
        raise ValueError("unknown scheme")
    rest, own = _take_options(
        url, _WAIT_OPTIONS + _SENTINEL_OPTIONS + _REDLOCK_OPTIONS + _FENCE_OPTIONS
    )
    if kind != "redlock" and "master_timeout" in own:
        raise ValueError("master_timeout needs a redis+redlock:// URL")
    wait_replicas, wait_timeout = _wait_options(own)
    margin = _fence_margin(own)
    if kind == "single":
        if any(name in own for name in _SENTINEL_OPTIONS):
            raise ValueError("sentinel_username/sentinel_password need a redis+sentinel:// URL")
        parse_url(rest)  # type: ignore[no-untyped-call]
        return LockUrl(
            kind,
            redis_url=rest,
            wait_replicas=wait_replicas,
            wait_timeout_s=wait_timeout,
            fence_margin_s=margin,
        )
    tls = scheme.startswith("rediss")
    body = rest.split("://", 1)[1]
    body, _, query = body.partition("?")
    userinfo, _, hostpart = body.rpartition("@")
    hosts, _, path = hostpart.partition("/")
    default_port = DEFAULT_SENTINEL_PORT if kind == "sentinel" else DEFAULT_CLUSTER_PORT
    nodes = _nodes(hosts, default_port)
    if kind == "redlock":
        parsed = _redlock_url(nodes, userinfo, query, path, tls, own)
        return dataclasses.replace(parsed, fence_margin_s=margin)
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
        fence_margin_s=margin,
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


def query_names(url: str) -> set[str]:
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


def _fence_margin(own: Mapping[str, str]) -> float | None:
    """The query option ``fence_margin``: a finite number of seconds >= 0, None if absent."""
    if "fence_margin" not in own:
        return None
    try:
        value = float(own["fence_margin"])
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError("fence_margin must be a number of seconds >= 0")
    return value


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
