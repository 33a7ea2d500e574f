"""Lua scripts on the wire: the one script registry, the one ``EVALSHA``, the one NOSCRIPT
recovery.

Every script of the package lives in ``lua/`` and is read once, by :func:`script`; every
call of one goes out as ``EVALSHA`` with its digest. A server that does not have the script
(new, restarted, flushed, a promoted replica) answers NOSCRIPT without running the call;
:func:`reloading` then loads the script and sends those calls again, once, and never sends a
call that ran twice. :func:`evalsha` (one call through a client), :func:`pipeline` (calls in
one pipeline) and :func:`send_then_read` (calls packed while the previous ones are written)
all recover through it. The client kind is the caller's business: a ``RedisCluster`` routes
``EVALSHA`` by its first key, a single-server client sends it to its server.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis
from redis.exceptions import NoScriptError

__all__ = [
    "Script",
    "as_text",
    "bulk",
    "disconnect",
    "evalsha",
    "pipeline",
    "pipeline_then",
    "reloading",
    "script",
    "send_then_read",
]


@dataclass(frozen=True)
class Script:
    """One Lua script of ``lua/``: its file name, text and SHA1 digest."""

    name: str
    text: str
    sha: str


@functools.cache
def script(name: str) -> Script:
    """The script ``lua/<name>``, read once per process."""
    text = resources.files(__package__).joinpath("lua").joinpath(name).read_text(encoding="utf-8")
    return Script(name, text, hashlib.sha1(text.encode()).hexdigest())


def reloading(
    count: int,
    send: Callable[[list[int]], list[Any]],
    load: Callable[[list[int]], object],
) -> list[Any]:
    """Replies of ``count`` script calls sent as a batch by ``send(indexes)``, each reply or its
    error, in order. Calls that found their script missing (``NOSCRIPT``: they did not run)
    get it loaded by ``load(indexes)`` and are sent again, once; calls that ran are never sent
    twice."""
    replies: list[Any] = [None] * count
    todo = list(range(count))
    for attempt in (1, 2):
        for index, reply in zip(todo, send(todo), strict=True):
            replies[index] = reply
        todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
        if not todo or attempt == 2:
            break
        load(todo)
    return replies


def evalsha(client: Any, lua: Script, args: Sequence[Any]) -> Any:
    """One call of ``lua`` through ``client`` (``args`` starts with numkeys); raises its error.

    ``client`` is a ``redis.Redis``, a ``RedisCluster`` (which routes the call by its key and
    loads a missing script on every primary) or one node's client.
    """

    def send(_todo: list[int]) -> list[Any]:
        try:
            return [client.execute_command("EVALSHA", lua.sha, *args)]
        except NoScriptError as exc:
            return [exc]

    (reply,) = reloading(1, send, lambda _todo: client.script_load(lua.text))
    if isinstance(reply, Exception):
        raise reply
    return reply


def pipeline(client: redis.Redis, calls: Sequence[tuple[Script, Sequence[Any]]]) -> list[Any]:
    """Script calls in one pipeline of a single server's client (or one cluster node's); each
    reply or its error, in order."""

    def send(todo: list[int]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        for index in todo:
            lua, args = calls[index]
            pipe.execute_command("EVALSHA", lua.sha, *args)  # type: ignore[no-untyped-call]
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    def load(todo: list[int]) -> None:
        for lua in {calls[i][0].name: calls[i][0] for i in todo}.values():
            client.script_load(lua.text)

    return reloading(len(calls), send, load)


def pipeline_then(
    client: redis.Redis, call: tuple[Script, Sequence[Any]], command: Sequence[Any]
) -> list[Any]:
    """A script call and one plain ``command`` after it, in one pipeline of ``client``; both
    replies (or errors). A missing script is loaded and both are sent again, once."""
    lua, args = call
    after: list[Any] = []

    def send(_todo: list[int]) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("EVALSHA", lua.sha, *args)  # type: ignore[no-untyped-call]
        pipe.execute_command(*command)  # type: ignore[no-untyped-call]
        first, second = pipe.execute(raise_on_error=False)
        after[:] = [second]
        return [first]

    (reply,) = reloading(1, send, lambda _todo: client.script_load(lua.text))
    return [reply, after[0]]


def send_then_read(
    client: redis.Redis, lua: Script, calls: Sequence[Callable[[], bytes]]
) -> list[Any]:
    """``EVALSHA`` calls of ``lua`` (single server), each packed by ``call()`` and written as
    soon as the previous one is written; the replies are read once all are: one round trip of
    waiting, and the server runs a call while the next one is being packed. Each reply or its
    error, in order; NOSCRIPT as :func:`reloading`.

    On one pooled connection, retried as redis-py retries a pipeline (the calls must be safe to
    run twice). A connection that fails, or whose replies are not all read, is disconnected
    before it goes back to the pool, so no later command reads a reply meant for these.
    """
    return reloading(
        len(calls),
        lambda todo: _write_then_read(client, [calls[i] for i in todo]),
        lambda _todo: client.script_load(lua.text),
    )


def _write_then_read(client: redis.Redis, calls: Sequence[Callable[[], bytes]]) -> list[Any]:
    pool = client.connection_pool
    connection: Any = pool.get_connection()  # redis-py's connections are untyped

    def write_then_read() -> list[Any]:
        try:
            for count, call in enumerate(calls):
                connection.send_packed_command([call()], check_health=count == 0)
            replies: list[Any] = []
            for _ in calls:
                try:
                    replies.append(client.parse_response(connection, "EVALSHA"))  # type: ignore[no-untyped-call]
                except redis.ResponseError as exc:  # this call's error (NOSCRIPT, ...)
                    replies.append(exc)
        except BaseException:
            connection.disconnect()
            raise
        return replies

    try:
        replies: list[Any] = connection.retry.call_with_retry(
            write_then_read, lambda _error: connection.disconnect()
        )
        return replies
    finally:
        pool.release(connection)


def bulk(value: str | int) -> bytes:
    """``value`` as a RESP bulk string, as redis-py packs it (UTF-8; an int in decimal)."""
    data = value.encode() if isinstance(value, str) else b"%d" % value
    return b"$%d\r\n%s\r\n" % (len(data), data)


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def disconnect(client: redis.Redis) -> None:
    """Close every connection ``client`` holds: its pool's and, for the master's client of a
    Sentinel, the ones to the sentinels (redis-py's ``Sentinel`` keeps a client per sentinel,
    which closing the master's client leaves open)."""
    pool = client.connection_pool
    pool.disconnect()
    for sentinel in getattr(getattr(pool, "sentinel_manager", None), "sentinels", ()):
        sentinel.connection_pool.disconnect()
