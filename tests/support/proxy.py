"""A TCP proxy a test can cut: one client process's way to a server, refused or blackholed
while the server itself stays up for everyone else.

A private Redis that is killed or paused (``servers.py``) fails for every process that uses it.
To take the lock store away from ONE process (a beat, a worker), give that process the URL of a
:class:`TcpProxy` in front of the server instead of the server's own:

    with contextlib.closing(TcpProxy(server.port)) as proxy:
        beat = beat_factory.start(env={"SINGLETON_TEST_LOCK_URL": proxy.url()})
        proxy.cut()        # refused: connections reset, new ones reset at once
        proxy.blackhole()  # or: connections accepted and held, nothing forwarded either way
        proxy.restore()    # forwarding again

- **open** (the start, and after :meth:`restore`): every connection accepted is forwarded to
  the server over a connection of its own, bytes copied both ways as they come.
- **cut** (:meth:`cut`): every connection is reset (RST, not a clean close) and every new one is
  reset as soon as it is accepted. The listening socket stays bound, so the port cannot be taken
  by another process meanwhile and :meth:`restore` needs no new bind; a client sees its connect
  succeed and its first read fail (redis-py: ``ConnectionError: ... reset by peer``), as it
  would after a refused connect: an immediate error, no timeout.
- **blackholed** (:meth:`blackhole`): nothing is forwarded and nothing is answered; connections,
  old and new, stay open and what clients send is read and dropped, so a client waits for its
  socket timeout, as behind a network partition or a frozen server. :meth:`restore` resets the
  connections that were held (their clients gave up on them: what they sent was dropped) and
  forwards the new ones.

A thread accepts and two threads per connection copy its bytes; every socket is closed by
:meth:`close`. Each state change is recorded with its time
(:attr:`changes`, epoch seconds), so a test can compare a process's log against it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable

__all__ = ["TcpProxy"]

__test__ = False

OPEN, CUT, BLACKHOLED = "open", "cut", "blackholed"
#: how long a copying thread waits in recv before it looks at the proxy's state again
_POLL_S = 0.05


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a reset (SO_LINGER 0): the peer's next read fails at once."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Pair:
    """One client connection and, while forwarded, its connection to the server."""

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = False
        self.lock = threading.Lock()

    def close(self) -> None:
        """Reset both sides (once)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        _reset(self.client)
        if self.upstream is not None:
            _reset(self.upstream)


class TcpProxy:
    """A TCP proxy on a free loopback port to ``host:port`` (see the module's docstring)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port: int = self._listener.getsockname()[1]
        self._state = OPEN
        self._mutex = threading.Lock()
        self._pairs: set[_Pair] = set()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        #: every state change: (epoch seconds, new state)
        self.changes: list[tuple[float, str]] = [(time.time(), OPEN)]
        #: connections accepted so far
        self.accepted = 0
        self._acceptor = threading.Thread(
            target=self._accept_loop, name=f"proxy-{self.port}-accept", daemon=True
        )
        self._acceptor.start()

    # -- what a test calls -----------------------------------------------------------------------

    @property
    def state(self) -> str:
        """``"open"``, ``"cut"`` or ``"blackholed"``."""
        return self._state

    def url(self, db: int = 0, query: str = "") -> str:
        """A ``redis://`` URL of the proxy (``query`` without its ``?``)."""
        return f"redis://127.0.0.1:{self.port}/{db}" + (f"?{query}" if query else "")

    def cut(self) -> float:
        """Reset every connection and every new one from now on; the time it took effect."""
        return self._change(CUT)

    def blackhole(self) -> float:
        """Forward nothing, answer nothing, hold every connection open; the time."""
        return self._change(BLACKHOLED)

    def restore(self) -> float:
        """Forward again (connections held or cut so far are reset); the time."""
        return self._change(OPEN)

    def close(self) -> None:
        """Stop accepting, reset every connection, join the threads."""
        self._closing.set()
        self._acceptor.join(5)  # no connection is admitted from now on
        with self._mutex:
            pairs = list(self._pairs)
            self._pairs.clear()
        for pair in pairs:
            pair.close()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()

    def __repr__(self) -> str:
        return f"<TcpProxy :{self.port} -> {self.upstream[0]}:{self.upstream[1]} {self._state}>"

    # -- inside --------------------------------------------------------------------------------

    def _change(self, state: str) -> float:
        with self._mutex:
            self._state = state
            now = time.time()
            self.changes.append((now, state))
            stale = list(self._pairs)
            if state == BLACKHOLED:  # held open from now on, nothing forwarded
                stale = []
            for pair in stale:
                self._pairs.discard(pair)
        for pair in stale:  # cut: every connection; restored: the ones held or cut before
            pair.close()
        return now

    def _spawn(self, target: Callable[..., None], name: str, *args: object) -> None:
        """Start a copying thread (from the accepting one)."""
        thread = threading.Thread(
            target=target, args=args, name=f"proxy-{self.port}-{name}", daemon=True
        )
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                client, _addr = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._admit(client)

    def _admit(self, client: socket.socket) -> None:
        """Forward, hold or reset a new connection, as the state says."""
        client.settimeout(_POLL_S)
        state = self._state
        if state == CUT:
            _reset(client)
            return
        upstream = None
        if state == OPEN:
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:  # the server is down: the client sees it as a reset
                _reset(client)
                return
            upstream.settimeout(_POLL_S)
        pair = _Pair(client, upstream)
        with self._mutex:
            if self._state != state or self._closing.is_set():  # changed meanwhile
                pair.close()
                return
            self._pairs.add(pair)
        self._spawn(self._copy, "up", pair, client, upstream)
        if upstream is not None:
            self._spawn(self._copy, "down", pair, upstream, client)

    def _copy(self, pair: _Pair, source: socket.socket, sink: socket.socket | None) -> None:
        """Copy ``source`` to ``sink`` until either side ends; while blackholed, drop it."""
        while not pair.closed and not self._closing.is_set():
            try:
                data = source.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if sink is None or self._state == BLACKHOLED:
                continue  # read and dropped: the client waits for its timeout
            try:
                sink.sendall(data)
            except OSError:
                break
        pair.close()  # either side ended (or was reset): the other goes with it
        with self._mutex:
            self._pairs.discard(pair)
