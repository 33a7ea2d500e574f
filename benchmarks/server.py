"""A private Redis server for the benchmarks, and its command statistics.

The server is :class:`celery_singleton_lock._dev.server.DevServer` (shared with the demo and
the tests): a throw-away server on a free loopback port, no persistence, its own session,
killed at interpreter exit; redis-server is preferred, since the figures are for Redis.
Because it is private, ``CONFIG RESETSTAT`` and ``INFO commandstats`` are fine here; never
point these helpers at a shared server.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from celery_singleton_lock._dev.server import DevServer, find_server_binary, free_port

__all__ = [
    "STATS_COMMANDS",
    "CommandStats",
    "PrivateRedis",
    "command_stats",
    "find_server_binary",
    "free_port",
]


class PrivateRedis(DevServer):
    """A Redis (or Valkey) server on a free loopback port, without persistence."""

    def __init__(self, binary: str | None = None, startup_timeout: float = 10.0) -> None:
        super().__init__(binary=binary, startup_timeout=startup_timeout)

    def start(self) -> PrivateRedis:
        super().start()
        return self

    def version(self) -> str:
        client = self.client()
        try:
            info = client.info("server")
        finally:
            client.close()
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info.get('redis_version')}"

    def __enter__(self) -> PrivateRedis:
        return self.start()


#: What reading and resetting the statistics sends (leave them out of a section's counts).
STATS_COMMANDS = frozenset({"info", "config|resetstat", "config"})


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
