"""Real Celery worker processes for integration tests.

Each worker runs ``python -m celery -A <module> worker ...`` (this interpreter, from the repository
root, unless told otherwise) in its own session (so its process group is its pid), with
stdout+stderr in a log file. ``kill()`` SIGKILLs
the whole tree; :class:`WorkerFactory` and an atexit hook make sure nothing outlives the tests.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

try:
    import psutil
except ImportError:  # pragma: no cover - psutil is a test dependency, /proc is the fallback
    psutil = None

REPO_ROOT = Path(__file__).resolve().parents[2]

_LIVE: set[WorkerProcess] = set()


# -- process-tree helpers (psutil, else /proc) ------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces: split after the last ')'
    fields = data[data.rfind(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children_of(pid: int, recursive: bool = False) -> list[int]:
    """Live (non-zombie) child pids of ``pid``; with ``recursive``, every descendant."""
    if psutil is not None:
        try:
            kids = psutil.Process(pid).children(recursive=recursive)
        except psutil.NoSuchProcess:
            return []
        return [k.pid for k in kids if is_alive(k.pid)]
    parents: dict[int, list[int]] = {}
    for other in _all_pids():
        stat = _proc_stat(other)
        if stat is not None and stat[0] not in ("Z", "X"):
            parents.setdefault(stat[1], []).append(other)
    found: list[int] = []
    todo = [pid]
    while todo:
        for kid in parents.get(todo.pop(), []):
            found.append(kid)
            if recursive:
                todo.append(kid)
    return found


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is ``pgid``."""
    members = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None and stat[2] == pgid and stat[0] not in ("Z", "X"):
            members.append(pid)
    return members


def _kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


# -- one worker --------------------------------------------------------------------------------


class WorkerProcess:
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
    ) -> None:
        self.app_module = app_module
        self.pool = pool
        self.concurrency = concurrency
        self.name = name or f"w{uuid.uuid4().hex[:8]}"
        #: the node name Celery gives this worker (``-n name@%h``)
        self.nodename = f"{self.name}@{socket.gethostname()}"
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.name}.log"
        self.args = [
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
            f"{self.name}@%h",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "-l",
            loglevel,
            *extra_args,
        ]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)

    @property
    def pid(self) -> int:
        """Pid of the worker's main process (also its process group id)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once the main process was reaped, else None."""
        return self.proc.poll()

    def is_running(self) -> bool:
        """True while the main process has not exited."""
        return self.proc.poll() is None

    def log_text(self) -> str:
        """Everything the worker wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

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

    def child_pids(self) -> list[int]:
        """Live direct children of the main process (the prefork pool's processes)."""
        return children_of(self.pid)

    def group_pids(self) -> list[int]:
        """Live processes of the worker's process group (main process included while alive)."""
        return group_members(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the main process to exit; return its exit code (TimeoutExpired on timeout)."""
        code = self.proc.wait(timeout=timeout)
        _LIVE.discard(self)
        return code

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the main process only."""
        if self.is_running():
            _kill_pid(self.pid, sig)

    def terminate(self, timeout: float = 30.0) -> int:
        """Warm shutdown (SIGTERM): wait up to ``timeout`` for running tasks, then kill."""
        self.signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait(5)

    def kill(self) -> None:
        """SIGKILL the main process, its process group and every descendant, then reap."""
        descendants = children_of(self.pid, recursive=True) if self.is_running() else []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        _kill_pid(self.pid)
        for pid in descendants:
            _kill_pid(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(10)
        # processes of the group are reparented after the main one dies: wait until gone
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = [pid for pid in [*descendants, *self.group_pids()] if is_alive(pid)]
            if not left:
                break
            for pid in left:
                _kill_pid(pid)
            time.sleep(0.02)

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


@atexit.register
def _kill_leftover_workers() -> None:
    for worker in list(_LIVE):
        with contextlib.suppress(Exception):
            worker.kill()


def wait_for(
    condition: Callable[[], Any],
    timeout: float,
    what: str,
    worker: WorkerProcess | None = None,
) -> Any:
    """Poll ``condition`` until it returns something truthy (returned); fail with the worker log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    log = f"\n{worker.log_tail(60)}" if worker is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{log}")
