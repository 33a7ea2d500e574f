"""Compare-and-delete of a string key: the server's own command where it has one, else Lua.

Newer servers delete a string key only if it holds a given value in one command: Valkey 9's
``DELIFEQ key value`` and Redis 8.4's ``DELEX key IFEQ value`` (both reply 1 if deleted, else
0). :func:`delete_if_equal` asks the server once per client, with ``COMMAND INFO``, which of
them it has (the answer is cached per client) and uses it; on older servers (Redis 7, Valkey
8), or when the check or the command is refused (an ACL user without ``+command`` or
``+delifeq``, a failover to an older server), it answers None and the caller runs its Lua
script instead, as it always did.

Only string keys qualify: a lock is a hash whose release compares the owner *and* the
generation, which neither command can express (see docs/deployments.md). The run claims'
``unclaim`` is such a compare-and-delete. Knows nothing of Celery.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import redis
from redis.cluster import RedisCluster

from .backend import Client

__all__ = ["delete_if_equal", "native_command"]

logger = logging.getLogger(__name__)

#: The commands, in the order they are looked for, and the arguments each takes after the key.
_COMMANDS: dict[str, tuple[str, ...]] = {"DELIFEQ": (), "DELEX": ("IFEQ",)}

_mutex = threading.Lock()
#: client -> the command it has ("" for none); weak, so a dropped client takes its entry along
_found: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def native_command(client: Client) -> str:
    """``"DELIFEQ"``, ``"DELEX"`` or ``""``: the compare-and-delete ``client``'s server has.

    Asked once per client (``COMMAND INFO delifeq delex``, one round trip) and cached; a
    server that cannot be asked, or refuses the question, counts as having neither this time
    and is asked again on the next call.
    """
    with _mutex:
        found = _found.get(client)
    if found is not None:
        return found
    try:
        reply = _command_info(client)
    except redis.ResponseError as exc:  # e.g. NOPERM: an ACL user without +command
        logger.info("singleton: compare-and-delete check refused, using Lua: %s", exc)
        found = ""
    else:
        found = next((name for name, entry in zip(_COMMANDS, reply, strict=False) if entry), "")
    with _mutex:
        _found[client] = found
    return found


def _command_info(client: Client) -> list[Any]:
    names = [name.lower() for name in _COMMANDS]
    if isinstance(client, RedisCluster):  # the nodes of a cluster run one version: ask any
        node = client.get_random_node()  # type: ignore[no-untyped-call]
        reply = client.execute_command(  # type: ignore[no-untyped-call]
            "COMMAND INFO", *names, target_nodes=node
        )
    else:
        # "COMMAND INFO" as one name: redis-py's parser for "COMMAND" fails on the nil
        # entries an older server sends for a command it does not have
        reply = client.execute_command("COMMAND INFO", *names)  # type: ignore[no-untyped-call]
    return list(reply or [])


def delete_if_equal(client: Client, key: str, value: str) -> bool | None:
    """Delete ``key`` if it holds ``value``, with the server's command; None if it has none.

    True deleted, False not (another value, or no key). Raises what the client raises for a
    server that cannot be asked (``lock.REDIS_ERRORS``); a server that refuses the command (unknown
    after a failover, or not allowed by the ACL) is remembered as having none, and None is
    returned so that the caller's Lua script runs instead.
    """
    name = native_command(client)
    if not name:
        return None
    try:
        reply = client.execute_command(name, key, *_COMMANDS[name], value)  # type: ignore[no-untyped-call]
    except redis.ResponseError as exc:
        text = str(exc).lower()
        if "unknown command" not in text and "noperm" not in text and "no permissions" not in text:
            raise
        logger.info(
            "singleton: compare-and-delete refused, using Lua from now on: %s: %s", name, exc
        )
        with _mutex:
            _found[client] = ""
        return None
    return bool(int(reply))
