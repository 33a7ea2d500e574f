"""Script calls written to Redis now, their replies read later, on one connection.

A release does not need to wait for its reply: Redis runs it as soon as it reads it, so a
run's lock is free the moment the release is written. What the reply says (released, or
already gone, or taken by someone else) only feeds a log line and a signal. :class:`SendAhead`
writes such calls on a connection of its own, keeps a note of each, and reads their replies
later, with the next call that does need its reply (the process's next acquire, which is then
ordered after them on the same connection) or when the owner asks (:meth:`SendAhead.collect`).

Knows nothing of Celery or of what the scripts do: a call is a script, its arguments
(numkeys first) and a ``tag`` the caller gets back with the reply.
"""

from __future__ import annotations

import select
import threading
from collections.abc import Sequence
from typing import Any

import redis
from redis.connection import Connection
from redis.exceptions import NoScriptError, ResponseError

from . import _wire
from ._pid import current_pid
from ._wire import Script

__all__ = ["SendAhead"]

#: a call written ahead whose reply is not read yet: (script, args, tag)
_Pending = tuple[Script, Sequence[Any], Any]


class SendAhead:
    """One connection of ``client``'s pool, kept for calls whose replies are read later.

    Thread-safe. Replies come back as ``(tag, reply)`` pairs, where ``reply`` is what the
    script returned or the exception that stands for it: a ``redis.RedisError`` when the call
    could not be written or its reply not read (the call may or may not have run).
    """

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._mutex = threading.Lock()
        self._connection: Connection | None = None
        self._pid = current_pid()
        self._pending: list[_Pending] = []  # written, reply still on the wire
        self._done: list[tuple[Any, Any]] = []  # read, not yet handed out by collect()

    def __len__(self) -> int:
        """How many calls were written ahead and not yet collected."""
        return len(self._pending) + len(self._done)

    def send(self, script: Script, args: Sequence[Any], tag: Any) -> None:
        """Write one call now; its reply comes back later, from :meth:`collect`.

        Raises ``redis.RedisError`` if it could not be written (it did not run then, unless
        the connection broke halfway through the write).
        """
        with self._mutex:
            self._write(_eval(script, args))
            self._pending.append((script, args, tag))

    def call(self, calls: Sequence[tuple[Script, Sequence[Any]]]) -> list[Any]:
        """Write ``calls`` after everything sent ahead, then read every reply.

        Returns the replies of ``calls`` (each a value or its exception, as
        :meth:`collect`); those of the calls sent ahead are kept for :meth:`collect`. The
        last call goes as ``EVALSHA``: if the server lacks its script (new, restarted or
        flushed) it is loaded and the call made again, once, through the client's pool; the
        others go as ``EVAL`` (see :func:`_eval`).
        """
        commands = [_eval(each, arguments) for each, arguments in calls[:-1]]
        script, args = calls[-1]
        commands.append(("EVALSHA", script.sha, *args))
        with self._mutex:
            self._write(*commands)
            self._pending += [(each, arguments, None) for each, arguments in calls]
            self._read_all()  # the replies of the calls sent ahead stay in _done, before ours
            done = self._done
            mine = done[-len(calls) :]
            del done[-len(calls) :]
        return [reply for _, reply in mine]

    def call_one(self, script: Script, args: Sequence[Any]) -> Any:
        """:meth:`call` of one call (``EVALSHA``): its reply, a value or its exception."""
        with self._mutex:
            self._write(("EVALSHA", script.sha, *args))
            self._pending.append((script, args, None))
            self._read_all()
            return self._done.pop()[1]  # the last reply read: the others were sent ahead

    def collect(self) -> list[tuple[Any, Any]]:
        """Every ``(tag, reply)`` of the calls written ahead so far, reading what is left."""
        if not self._pending and not self._done:
            return []
        with self._mutex:
            if self._pid != current_pid():
                self._forget()
            if self._pending:
                self._read_all()
            done, self._done = self._done, []
            return done

    def close(self) -> None:
        """Disconnect every connection of the client's pool, this one's included (and, through
        a Sentinel, those to the sentinels)."""
        with self._mutex:
            self._connection = None
            self._pending = []
        _wire.disconnect(self._client)

    # -- the connection ------------------------------------------------------------------------

    def _connect(self) -> Connection:
        """This process's connection, checked as the pool checks one it hands out.

        Taken from the client's pool and kept (it counts against ``max_connections``, and
        closing the client closes it); a new one after a fork (the parent keeps its own).
        With no reply pending, a connection that can be read from is stale (the server closed
        it, or a reply nobody waits for is left on it): it is dropped and connected again.
        """
        if self._pid != current_pid():
            self._forget()
        connection = self._connection
        if connection is None:
            connection = self._connection = self._client.connection_pool.get_connection()
        elif not self._pending and _readable(connection):
            connection.disconnect()  # type: ignore[no-untyped-call]
            connection.connect()  # type: ignore[no-untyped-call]
        return connection

    def _write(self, *commands: Sequence[Any]) -> None:
        """Send ``commands`` on this process's connection, dropped if that fails (raises)."""
        try:
            connection = self._connect()
            if len(commands) == 1:
                packed = connection.pack_command(*commands[0])  # type: ignore[no-untyped-call]
            else:
                packed = connection.pack_commands(commands)  # type: ignore[no-untyped-call]
            # no health check: it would read a reply that is not its own
            connection.send_packed_command(packed, check_health=False)  # type: ignore[no-untyped-call]
        except redis.RedisError as exc:
            self._broken(exc)
            raise

    def _forget(self) -> None:
        """After a fork: the calls and the connection are the parent's."""
        self._pid = current_pid()
        self._connection = None
        self._pending = []
        self._done = []

    def _read_all(self) -> None:
        """Read the reply of every pending call, in order, into ``_done``; a missing script
        (only the last call of a batch uses ``EVALSHA``) is loaded and its call made again."""
        pending, self._pending = self._pending, []
        connection = self._connection
        assert connection is not None
        done = self._done
        read = len(done)
        for script, args, tag in pending:
            try:
                reply: Any = connection.read_response()
            except NoScriptError:
                reply = self._again(script, args)
            except ResponseError as exc:  # the script's own error: the connection is fine
                reply = exc
            except redis.RedisError as exc:  # the connection is gone, with every later reply
                self._broken(exc)
                done += [(each, exc) for _, _, each in pending[len(done) - read :]]
                break
            done.append((tag, reply))

    def _again(self, script: Script, args: Sequence[Any]) -> Any:
        """A call that did not run (no such script on the server): load it, run it now."""
        try:
            return _wire.evalsha(self._client, script, args)
        except redis.RedisError as exc:
            return exc

    def _broken(self, exc: redis.RedisError) -> None:
        """The connection failed: drop it; every reply still on it is lost with it."""
        connection, self._connection = self._connection, None
        lost, self._pending = self._pending, []
        self._done += [(tag, exc) for _, _, tag in lost]
        if connection is not None:
            connection.disconnect()  # type: ignore[no-untyped-call]
            self._client.connection_pool.release(connection)


def _eval(script: Script, args: Sequence[Any]) -> tuple[Any, ...]:
    """``EVAL`` with the script's text, for a call that other calls follow on the connection.

    ``EVALSHA`` of a script the server does not have (new, restarted, flushed) fails without
    running, and the calls written after it would run before it is sent again: an acquire
    would find the lock a release ahead of it was to free. ``EVAL`` always runs, in order (the
    server caches the script by its digest). Only the last call of a batch, which nothing
    follows, may use ``EVALSHA`` and be sent again.
    """
    return ("EVAL", script.text, *args)


def _readable(connection: Connection) -> bool:
    """Whether the server sent something (or closed) while no reply was due: one ``select``
    on the socket, the check redis-py's pool makes with ``can_read`` (a third of its cost)."""
    sock = getattr(connection, "_sock", None)
    if sock is None:
        return False  # not connected: the write connects
    try:
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):  # closed under us
        return True
