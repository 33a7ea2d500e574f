"""Start ``python -m celery`` workers and beats by forking one process that has already
imported Celery, instead of a new interpreter each time.

The suite starts about 300 workers and beats. Each new interpreter spends about 0.9 CPU-s
importing Celery, kombu, redis-py, click and the ``celery.commands`` plugins (Flower, this
library's CLI) before it does anything: a third of the suite's CPU on a 2-core machine. A
zygote imports them once (per xdist worker); each start is then a fork of it that runs the
very same ``python -m celery ...`` (``runpy``, as ``-m`` does) in a new session, with its own
environment, working directory and log file. What the worker does from there on is what a new
interpreter would do: the app module, its settings and the library's hooks are imported and run
in the child.

A start is forked only where the child cannot tell the difference: this interpreter, the
repository root as working directory, and a pool that does not monkeypatch (not gevent,
eventlet); anything else is started as a new process. Each environment has its own zygote,
started with it, so what is read at import time is what a new interpreter would read; the
variables the test apps read only when the child imports them (:data:`FREE_PREFIXES`) differ
between the starts of one zygote.

Protocol (lines of text): the client writes one JSON request per start; the zygote answers
``pid <pid>`` after the fork, and ``exit <pid> <code>`` when it reaps a child (``code`` as
:attr:`subprocess.Popen.returncode` gives it: negative for a signal).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__test__ = False

REPO_ROOT = Path(__file__).resolve().parents[2]

#: environment variables a forked start may set differently from the zygote: read by the test
#: apps when the child imports them (and pytest's name of the running test), never at the
#: import of what the zygote preloads
FREE_PREFIXES = ("SINGLETON_TEST_", "EXAMPLE_", "PROJECT_", "PYTEST_CURRENT_TEST")

#: what the zygote imports before it forks (a worker or beat would import each of them)
PRELOAD = (
    "celery.__main__",
    "celery.bin.celery",  # loads the celery.commands plugins: Flower and this library's CLI
    "celery.apps.worker",
    "celery.apps.beat",
    "celery.beat",
    "celery.worker.consumer",
    "celery.concurrency.prefork",
    "celery.concurrency.thread",
    "celery.concurrency.solo",
    "celery.backends.redis",
    "kombu.transport.redis",
    "celery_singleton_lock",
)  # not the test support modules: tests.support.basic_app makes its app at import

#: pools that patch the standard library before anything else is imported
PATCHING_POOLS = frozenset({"gevent", "eventlet"})


# -- the zygote (python -m tests.support.zygote) ----------------------------------------------


def _serve() -> dict[str, Any] | None:
    """Answer requests until stdin closes (return None), or return a request in a forked child."""
    for name in PRELOAD:
        __import__(name)
    stdin = sys.stdin.buffer
    out = sys.stdout
    pending = b""
    while True:
        readable, _, _ = select.select([stdin], [], [], 0.05)
        while True:  # reap every child that exited
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()
        if not readable:
            continue
        chunk = os.read(stdin.fileno(), 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            out.flush()
            pid = os.fork()
            if pid == 0:
                return dict(request)
            out.write(f"pid {pid}\n")
            out.flush()


def _become(request: Mapping[str, Any]) -> None:
    """In the forked child: a new session, the log as stdout and stderr, the request's
    environment and directory; then run ``python -m celery`` with its arguments."""
    import runpy

    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["celery", *request["argv"]]
    runpy.run_module("celery", run_name="__main__", alter_sys=True)


def main() -> None:
    request = _serve()
    if request is None:
        return
    _become(request)


# -- the client (in the test process) ---------------------------------------------------------


class ForkedProcess:
    """The part of :class:`subprocess.Popen` that DevProcess uses, for a zygote's child."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self._zygote = zygote
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode


def import_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` a process may read while it imports: all but :data:`FREE_PREFIXES`."""
    return {k: v for k, v in env.items() if not k.startswith(FREE_PREFIXES)}


def forkable(args: Sequence[str], cwd: Path | str | None) -> bool:
    """Whether a fork can run ``args`` as a new interpreter would (the environment aside: each
    import environment has its own zygote)."""
    if list(args[:3]) != [sys.executable, "-m", "celery"]:
        return False
    if cwd is None or Path(cwd).resolve() != REPO_ROOT:
        return False
    return not any(pool in args for pool in PATCHING_POOLS)


class Zygote:
    """One zygote process, started with one import environment (:func:`import_environment`)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote"],
            cwd=REPO_ROOT,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.owner = os.getpid()
        self._lock = threading.Lock()  # one start at a time
        self._changed = threading.Condition()
        self._pids: list[int] = []
        self._exits: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, name="zygote-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            kind, *values = raw.decode().split()
            with self._changed:
                if kind == "pid":
                    self._pids.append(int(values[0]))
                elif kind == "exit":
                    self._exits[int(values[0])] = int(values[1])
                self._changed.notify_all()
        with self._changed:  # the zygote is gone
            self._changed.notify_all()

    def alive(self) -> bool:
        return self._proc.poll() is None and os.getpid() == self.owner

    def fork(self, args: Sequence[str], env: Mapping[str, str], cwd: Path | str, log: Path) -> Any:
        """A child running ``args`` with ``env`` (which must import as :attr:`env` does)."""
        assert import_environment(env) == import_environment(self.env)
        request = {"argv": list(args[3:]), "env": dict(env), "cwd": str(cwd), "log": str(log)}
        assert self._proc.stdin is not None
        with self._lock:
            with self._changed:
                seen = len(self._pids)
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            with self._changed:
                self._changed.wait_for(lambda: len(self._pids) > seen or not self.alive(), 30)
                if len(self._pids) <= seen:
                    raise RuntimeError("the zygote did not fork")
                pid = self._pids[seen]
        return ForkedProcess(self, pid, args)

    def exit_code(self, pid: int) -> int | None:
        """The child's exit code once the zygote reaped it; -1 once it is gone unreaped (the
        zygote died, and init reaped it)."""
        with self._changed:
            code = self._exits.get(pid)
        if code is None and not self.alive() and not _exists(pid):
            return -1
        return code

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or not self.alive(), timeout)
        return self.exit_code(pid)

    def close(self) -> None:
        """Kill the zygote (its children live on: their owners kill them)."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


#: at most this many zygotes per process (one per import environment); more starts are new
#: processes
MAX_ZYGOTES = 6

#: this process's zygotes, by import environment
_ZYGOTES: dict[frozenset[tuple[str, str]], Zygote] = {}


def zygote_for(env: Mapping[str, str]) -> Zygote | None:
    """The zygote of ``env``'s import environment, started at its first use (None: too many, or
    this is a process forked from the one that started it)."""
    imports = import_environment(env)
    key = frozenset(imports.items())
    zygote = _ZYGOTES.get(key)
    if zygote is not None:
        if zygote.alive():
            return zygote
        if os.getpid() != zygote.owner:
            return None  # forked from its owner (a test's multiprocessing child)
        zygote.close()
        del _ZYGOTES[key]
    if len(_ZYGOTES) >= MAX_ZYGOTES:
        return None
    zygote = _ZYGOTES[key] = Zygote(imports)
    atexit.register(zygote.close)
    return zygote


def launch(args: Sequence[str], env: Mapping[str, str], cwd: Path | str | None, log: Path) -> Any:
    """A forked child running ``args`` where that is the same as a new process (else None)."""
    if os.environ.get("SINGLETON_TEST_NO_ZYGOTE") or not forkable(args, cwd):
        return None
    zygote = zygote_for(env)
    if zygote is None:
        return None
    return zygote.fork(args, env, cwd or REPO_ROOT, log)


if __name__ == "__main__":
    main()
