"""Private Redis deployments for tests: TLS, a unix socket, ACL users, Sentinel, Cluster.

Everything runs from the binary :func:`tests.support.servers.find_server_binary` picks, on free
loopback ports, in private temporary directories, and is killed by ``close()`` (and at
interpreter exit, through :class:`RedisServer`'s registry). Nothing here touches the shared
Redis.

- :func:`make_tls_files`: a throw-away CA, a server certificate for 127.0.0.1 and a client
  certificate, made with the ``openssl`` command line tool.
- :class:`TlsServer`: a server with a TLS port next to its plain one (which only the
  start-up PING uses).
- :class:`PasswordServer`: a server with ``requirepass`` (and ``masterauth``, so it can be a
  replica of another such server).
- :class:`SentinelSet`: one master, one replica and three sentinels with short timeouts.
- :class:`Cluster`: three masters, no replicas, all 16384 slots assigned.
- :func:`sentinels_and_cluster`: one of each, started side by side.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import redis

from tests.support.servers import RedisServer, find_server_binary, free_port
from tests.support.waiting import wait_for

__all__ = [
    "Cluster",
    "PasswordServer",
    "SentinelServer",
    "SentinelSet",
    "TlsFiles",
    "TlsServer",
    "TlsUnsupported",
    "make_tls_files",
    "sentinels_and_cluster",
    "server_info",
    "wait_until",
]

SLOTS = 16384

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str) -> T:
    """:func:`~tests.support.waiting.wait_for` every 50 ms, any exception counting as "not
    yet" (servers restart and fail over meanwhile; the last one is named on timeout)."""
    return wait_for(condition, timeout, what, interval=0.05, ignore=(Exception,))


def server_info(client: redis.Redis, section: str | None = None) -> dict[str, Any]:
    """``INFO`` (or one section of it) as a dict."""
    info: dict[str, Any] = client.info(section) if section else client.info()
    return info


# -- TLS ------------------------------------------------------------------------------------------


class TlsUnsupported(RuntimeError):
    """The server binary was built without TLS, or no openssl tool is installed."""


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a test CA and of the server and client certificates it signed."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (EC keys)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsUnsupported("the openssl command line tool is not installed")
    directory.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=directory, check=True, capture_output=True, timeout=60)

    key_args = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run(
        "req",
        "-x509",
        *key_args,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=cslt test CA",
    )
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n"
    )
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        run(
            "req",
            "-new",
            *key_args,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=cslt test {name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return TlsFiles(
        ca_cert=directory / "ca.crt",
        server_cert=directory / "server.crt",
        server_key=directory / "server.key",
        client_cert=directory / "client.crt",
        client_key=directory / "client.key",
    )


class TlsServer(RedisServer):
    """A private server that also listens with TLS on :attr:`tls_port`.

    ``auth_clients``: whether the server demands a client certificate signed by the CA.
    Raises :class:`TlsUnsupported` when the binary was built without TLS.
    """

    def __init__(self, files: TlsFiles, auth_clients: bool = True) -> None:
        self.files = files
        self.tls_port = free_port()
        args = (
            "--tls-port",
            str(self.tls_port),
            "--tls-cert-file",
            str(files.server_cert),
            "--tls-key-file",
            str(files.server_key),
            "--tls-ca-cert-file",
            str(files.ca_cert),
            "--tls-auth-clients",
            "yes" if auth_clients else "no",
        )
        super().__init__(extra_args=args, start=False)
        try:
            self.start()
        except RuntimeError:
            said = [line for line in self._log_tail(5).splitlines() if "tls" in line.lower()]
            self.close()
            if said:
                reason = said[-1].split(" # ", 1)[-1]
                raise TlsUnsupported(f"{self.binary} was built without TLS ({reason})") from None
            raise

    def tls_url(self, *, client_cert: bool = True, ca: bool = True, **query: str) -> str:
        """``rediss://127.0.0.1:<tls port>/0`` with the certificate options as URL query."""
        options: dict[str, str] = {}
        if ca:
            options["ssl_ca_certs"] = str(self.files.ca_cert)
            options["ssl_cert_reqs"] = "required"
        if client_cert:
            options["ssl_certfile"] = str(self.files.client_cert)
            options["ssl_keyfile"] = str(self.files.client_key)
        options.update(query)
        text = "&".join(f"{k}={v}" for k, v in options.items())
        return f"rediss://127.0.0.1:{self.tls_port}/0" + (f"?{text}" if text else "")


# -- password, replicas, Sentinel -----------------------------------------------------------------


class PasswordServer(RedisServer):
    """A private server with ``requirepass``; its :attr:`url` carries the password."""

    def __init__(
        self, password: str, extra_args: tuple[str, ...] = (), binary: str | None = None
    ) -> None:
        self.password = password
        super().__init__(
            binary=binary,
            extra_args=("--requirepass", password, "--masterauth", password, *extra_args),
        )

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"


class SentinelServer(RedisServer):
    """A sentinel (``<server binary> sentinel.conf --sentinel``) watching one master."""

    def __init__(
        self,
        master_port: int,
        service: str,
        *,
        password: str | None,
        sentinel_password: str | None,
        down_after_ms: int,
        failover_timeout_ms: int,
        binary: str | None = None,
    ) -> None:
        self.master_port = master_port
        self.service = service
        self.password = password
        self.sentinel_password = sentinel_password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        super().__init__(binary=binary)

    def _command(self) -> list[str]:
        name = self.service
        lines = [
            f"port {self.port}",
            "bind 127.0.0.1",
            f'dir "{self.dir}"',
            f"sentinel monitor {name} 127.0.0.1 {self.master_port} 2",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {name} {self.password}")
        if self.sentinel_password:
            lines += [
                f"requirepass {self.sentinel_password}",
                f"sentinel sentinel-pass {self.sentinel_password}",
            ]
        conf = self.dir / "sentinel.conf"
        conf.write_text("\n".join(lines) + "\n")
        return [self.binary, str(conf), "--sentinel"]

    @property
    def url(self) -> str:
        auth = f":{self.sentinel_password}@" if self.sentinel_password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"


class SentinelSet:
    """One master, one replica and three sentinels (quorum 2) on loopback.

    ``down_after_ms`` and ``failover_timeout_ms`` are short, so a killed master is replaced
    within a few seconds. The data nodes require ``password``; the sentinels require
    ``sentinel_password`` when it is given.
    """

    def __init__(
        self,
        *,
        service: str = "cslt",
        password: str = "data-Pw-4a1",
        sentinel_password: str | None = "sent-Pw-9c2",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        binary: str | None = None,
    ) -> None:
        self.service = service
        self.password = password
        self.sentinel_password = sentinel_password
        self.binary = binary or find_server_binary()
        self.data: list[PasswordServer] = []
        self.sentinels: list[SentinelServer] = []
        try:
            # a replica's full sync starts at once, not after the default 5 s diskless-sync
            # delay (which waits for more replicas to share one transfer); the same on the
            # replica, which becomes the master of the old one after a failover
            no_delay = ("--repl-diskless-sync-delay", "0")
            master = PasswordServer(password, no_delay, binary=self.binary)
            self.data.append(master)
            replica_args = (*no_delay, "--replicaof", "127.0.0.1", str(master.port))
            self.data.append(PasswordServer(password, replica_args, binary=self.binary))
            for _ in range(3):
                self.sentinels.append(
                    SentinelServer(
                        master.port,
                        service,
                        password=password,
                        sentinel_password=sentinel_password,
                        down_after_ms=down_after_ms,
                        failover_timeout_ms=failover_timeout_ms,
                        binary=self.binary,
                    )
                )
            self.wait_ready()
        except BaseException:
            self.close()
            raise

    # -- addresses --------------------------------------------------------------------------

    def url(self, *, with_sentinel_password: bool = True, query: str = "") -> str:
        """``redis+sentinel://:<password>@h:p,h:p,h:p/<service>/0[?...]``."""
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        options = [query] if query else []
        if self.sentinel_password and with_sentinel_password:
            options.insert(0, f"sentinel_password={self.sentinel_password}")
        text = f"?{'&'.join(options)}" if options else ""
        return f"redis+sentinel://:{self.password}@{hosts}/{self.service}/0{text}"

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return redis.Redis.from_url(self.sentinels[index].url, socket_timeout=2)

    def master_port(self) -> int:
        """The master's port as the first sentinel that answers reports it."""
        for index in range(len(self.sentinels)):
            if not self.sentinels[index].is_running():
                continue
            client = self.sentinel_client(index)
            try:
                _host, port = client.sentinel_get_master_addr_by_name(self.service)
                return int(port)
            except (redis.RedisError, TypeError):
                continue
            finally:
                client.close()
        raise RuntimeError("no sentinel answered")

    def server(self, port: int) -> PasswordServer:
        """The data node listening on ``port``."""
        (server,) = [s for s in self.data if s.port == port]
        return server

    def master(self) -> PasswordServer:
        return self.server(self.master_port())

    def replica(self) -> PasswordServer:
        port = self.master_port()
        (server,) = [s for s in self.data if s.port != port and s.is_running()]
        return server

    # -- readiness and failover -------------------------------------------------------------

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Replication up, and every sentinel knows the replica and the two other sentinels."""
        replica = self.data[1].client(socket_timeout=2)
        try:
            wait_until(
                lambda: server_info(replica, "replication").get("master_link_status") == "up",
                timeout,
                "the replica to sync",
            )
        finally:
            replica.close()
        for index in range(len(self.sentinels)):
            client = self.sentinel_client(index)
            try:

                def known(client: redis.Redis = client) -> bool:
                    state = client.sentinel_master(self.service)
                    return (
                        int(state["num-other-sentinels"]) == len(self.sentinels) - 1
                        and int(state["num-slaves"]) == 1
                    )

                wait_until(known, timeout, f"sentinel {index} to see the whole set")
            finally:
                client.close()

    def kill_master(self) -> int:
        """SIGKILL the current master; return its port."""
        port = self.master_port()
        self.server(port).kill()
        return port

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the sentinels name another master and it accepts writes; its port."""
        port: int = wait_until(
            lambda: (p := self.master_port()) != old_port and p,
            timeout,
            "the sentinels to promote the replica",
        )
        client = self.server(port).client(socket_timeout=2)
        try:
            wait_until(
                lambda: server_info(client, "replication").get("role") == "master",
                timeout,
                "the new master to take writes",
            )
        finally:
            client.close()
        return port

    def close(self) -> None:
        for server in [*self.sentinels, *self.data]:
            with contextlib.suppress(Exception):
                server.close()

    def __enter__(self) -> SentinelSet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# -- Cluster --------------------------------------------------------------------------------------


class Cluster:
    """Three cluster-enabled masters, no replicas, slots split in three even ranges.

    Built by hand (``CLUSTER ADDSLOTSRANGE``, ``SET-CONFIG-EPOCH``, ``MEET``) through redis-py,
    so no ``redis-cli`` is needed. Each node gets an explicit cluster bus port.
    """

    def __init__(self, size: int = 3, binary: str | None = None, node_timeout_ms: int = 2000):
        self.binary = binary or find_server_binary()
        self.nodes: list[RedisServer] = []
        self.bus_ports: dict[int, int] = {}
        try:
            for _ in range(size):
                node = RedisServer(binary=self.binary, start=False)
                bus = free_port()
                node.extra_args = (
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    str(node.dir / "nodes.conf"),
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    "--cluster-port",
                    str(bus),
                )
                self.nodes.append(node)
                node.start()
                self.bus_ports[node.port] = bus
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self, timeout: float = 30.0) -> None:
        size = len(self.nodes)
        bounds = [round(i * SLOTS / size) for i in range(size + 1)]
        clients = [node.client(socket_timeout=2) for node in self.nodes]
        try:
            for index, client in enumerate(clients):
                client.execute_command("CLUSTER", "SET-CONFIG-EPOCH", index + 1)
                client.execute_command(
                    "CLUSTER", "ADDSLOTSRANGE", bounds[index], bounds[index + 1] - 1
                )
            for node in self.nodes[1:]:
                clients[0].execute_command(
                    "CLUSTER", "MEET", "127.0.0.1", node.port, self.bus_ports[node.port]
                )

            def ready() -> bool:
                for client in clients:
                    info = client.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
                    if (
                        fields.get("cluster_state") != "ok"
                        or int(fields.get("cluster_known_nodes", 0)) != size
                        or int(fields.get("cluster_slots_ok", 0)) != SLOTS
                    ):
                        return False
                return True

            wait_until(ready, timeout, "the cluster to form")
        finally:
            for client in clients:
                client.close()

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<p1>,127.0.0.1:<p2>,...``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def node_clients(self) -> dict[int, redis.Redis]:
        """A plain client per node (by port), for INFO and CONFIG on that node only."""
        return {node.port: node.client(socket_timeout=2) for node in self.nodes}

    def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                node.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def short_tempdir(prefix: str = "cslt-") -> Path:
    """A new directory with a short path (unix socket paths are limited to ~100 bytes)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


@contextlib.contextmanager
def sentinels_and_cluster() -> Iterator[tuple[SentinelSet, Cluster]]:
    """A :class:`SentinelSet` and a :class:`Cluster` started side by side (each mostly waits
    for its gossip, ~2 s), both closed on leaving (the one started too if the other failed)."""
    with ThreadPoolExecutor(2) as pool:
        sentinels, cluster = pool.submit(SentinelSet), pool.submit(Cluster)
    with contextlib.ExitStack() as stack:
        for future in (sentinels, cluster):
            if future.exception() is None:
                stack.enter_context(future.result())
        yield sentinels.result(), cluster.result()
