"""Real Celery worker processes for integration tests.

Each worker runs ``python -m celery -A <module> worker ...`` (this interpreter, from the repository
root, unless told otherwise): a :class:`~celery_singleton_lock._dev.process.DevProcess`, in its
own session (so its process group is its pid), with stdout+stderr in a log file. ``kill()``
SIGKILLs the whole tree; :class:`WorkerFactory` and an atexit hook make sure nothing outlives
the tests.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from celery_singleton_lock._dev.process import (
    ChildProcess,
    DevProcess,
    children_of,
    group_members,
    is_alive,
)
from tests.support import zygote
from tests.support.history import server_time_us
from tests.support.waiting import wait_for
from tests.support.zygote import REPO_ROOT

__all__ = [
    "REPO_ROOT",
    "CeleryProcess",
    "WorkerFactory",
    "WorkerProcess",
    "children_of",
    "group_members",
    "is_alive",
    "kill_child",
]


class CeleryProcess(DevProcess):
    """A ``python -m celery ...`` subprocess: a fork of this process's zygote where that starts
    the same process (zygote.py), else a new one."""

    def _start(self, cwd: Path | str | None) -> ChildProcess:
        forked = zygote.launch(self.args, self.env, cwd, self.log_path)
        return super()._start(cwd) if forked is None else forked


class WorkerProcess(CeleryProcess):
    """One ``celery worker`` subprocess."""

    def __init__(  # noqa: PLR0917
        self,
        app_module: str,
        log_dir: Path,
        pool: str = "prefork",
        concurrency: int = 2,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Iterable[str] = (),
        loglevel: str = "INFO",
        python: str = sys.executable,
        cwd: Path = REPO_ROOT,
        worker_events: bool = False,
    ) -> None:
        self.app_module = app_module
        self.pool = pool
        self.concurrency = concurrency
        name = name or f"w{uuid.uuid4().hex[:8]}"
        #: the node name Celery gives this worker (``-n name@%h``)
        self.nodename = f"{name}@{socket.gethostname()}"
        args = [
            python,
            "-m",
            "celery",
            "-A",
            app_module,
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "--without-mingle",
            # no worker events (heartbeats): quicker; ``worker_events``: a worker as deployed,
            # whose task events ``celery control enable_events`` turns on (as Flower does)
            *(() if worker_events else ("--without-gossip", "--without-heartbeat")),
            "-l",
            loglevel,
            *extra_args,
        ]
        super().__init__(args, Path(log_dir) / f"{name}.log", name=name, env=env, cwd=cwd)

    def wait_ready(self, app: Any, timeout: float = 30.0) -> None:
        """Poll ``app.control.ping`` until this worker answers; raise with its log if not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise RuntimeError(
                    f"worker {self.nodename} exited with {self.returncode} before it was ready:\n"
                    f"{self.log_tail()}"
                )
            replies = app.control.ping(destination=[self.nodename], timeout=0.5)
            if any(self.nodename in reply for reply in replies or ()):
                return
        raise TimeoutError(
            f"worker {self.nodename} did not answer ping within {timeout}s:\n{self.log_tail()}"
        )

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited({self.returncode})"
        return f"<WorkerProcess {self.nodename} pid={self.pid} -P {self.pool} {state}>"


class WorkerFactory:
    """Starts workers with logs under ``tmp_path``; :meth:`close` kills every one of them."""

    def __init__(self, tmp_path: Path, base_env: Mapping[str, str] | None = None) -> None:
        self.log_dir = Path(tmp_path) / "worker-logs"
        self.base_env = dict(base_env or {})
        self.workers: list[WorkerProcess] = []

    def start(  # noqa: PLR0917 - mirrors the celery worker options
        self,
        app_module: str,
        pool: str = "prefork",
        concurrency: int = 2,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        extra_args: Iterable[str] = (),
        python: str = sys.executable,
        cwd: Path = REPO_ROOT,
        worker_events: bool = False,
    ) -> WorkerProcess:
        """Start a worker; ``env`` is merged over ``base_env``, itself over ``os.environ``.

        ``python`` (this interpreter by default) runs ``-m celery`` from ``cwd`` (the
        repository root by default).
        """
        worker = WorkerProcess(
            app_module,
            self.log_dir,
            pool=pool,
            concurrency=concurrency,
            name=name or f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:6]}",
            env={**self.base_env, **(env or {})},
            extra_args=extra_args,
            python=python,
            cwd=cwd,
            worker_events=worker_events,
        )
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        """SIGKILL every worker started here, with all their processes."""
        for worker in self.workers:
            worker.kill()

    def logs(self) -> str:
        """Every worker's log, for failure messages."""
        return "\n".join(f"===== {w.nodename} =====\n{w.log_tail(200)}" for w in self.workers)


def kill_child(client: Any, pid: int) -> int:
    """SIGKILL a pool child, wait until it is gone; return the Redis server's time (us, the
    history's clock, read from ``client``) just after."""
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not is_alive(pid), 5, f"child {pid} to die")
    return server_time_us(client)
