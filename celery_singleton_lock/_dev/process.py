"""A child process in its own session, logging to a file: the base of the dev process wrappers.

Not part of the public API. The test suite's worker and beat wrappers and the benchmarks'
workers are subclasses of :class:`DevProcess`: the process runs in a session of its own (so its
process group id is its pid and a Ctrl-C sent to the caller never reaches it), writes stdout and
stderr to a log file, can be waited on for a log line, paused, resumed, stopped and killed with
everything it started, and is killed at interpreter exit if nobody did it before.

Standard library only; ``psutil`` is used when installed, else ``/proc`` (Linux).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

try:
    _psutil: Any = importlib.import_module("psutil")
except ImportError:  # pragma: no cover - psutil is optional, /proc is the fallback
    _psutil = None

_LIVE: set[DevProcess] = set()


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
    if _psutil is not None:
        return list(_psutil.pids())
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def is_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    if _psutil is not None:
        try:
            return bool(_psutil.Process(pid).status() != _psutil.STATUS_ZOMBIE)
        except _psutil.NoSuchProcess:
            return False
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def children_of(pid: int, recursive: bool = False) -> list[int]:
    """Live (non-zombie) child pids of ``pid``; with ``recursive``, every descendant."""
    if _psutil is not None:
        try:
            kids = _psutil.Process(pid).children(recursive=recursive)
        except _psutil.NoSuchProcess:
            return []
        return [int(k.pid) for k in kids if is_alive(k.pid)]
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
        try:
            in_group = os.getpgid(pid) == pgid
        except OSError:
            continue
        if in_group and is_alive(pid):
            members.append(pid)
    return members


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to ``pid``; a process that is gone (or not ours) is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used so far (0.0 if it is gone)."""
    if _psutil is not None:
        try:
            times = _psutil.Process(pid).cpu_times()
        except _psutil.NoSuchProcess:
            return 0.0
        return float(times.user + times.system)
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode(errors="replace")
    except OSError:
        return 0.0
    fields = data[data.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# -- one process -------------------------------------------------------------------------------


class ChildProcess(Protocol):
    """What :class:`DevProcess` uses of :class:`subprocess.Popen`."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class DevProcess:
    """One subprocess in its own session (its process group id is its pid), logging to a file.

    ``args`` is started at once, with ``env`` merged over ``os.environ`` (and
    ``PYTHONUNBUFFERED=1``, so log lines arrive as they are written) and stdout and stderr
    appended to ``log_path``. :meth:`kill` SIGKILLs the whole tree; an atexit hook kills any
    that is still running when the interpreter exits.
    """

    #: how often :meth:`wait_for_log` reads the log again, in seconds
    poll_interval = 0.05

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        self.args = list(args)
        self.name = name or Path(log_path).stem
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        #: epoch times of the last signals sent (None until sent)
        self.started_at = time.time()
        self.killed_at: float | None = None
        self.stopped_at: float | None = None
        self.continued_at: float | None = None
        #: log size in bytes when the process was resumed (SIGCONT)
        self.log_size_at_cont: int | None = None
        self.proc: ChildProcess = self._start(cwd)
        _LIVE.add(self)

    def _start(self, cwd: Path | str | None) -> ChildProcess:
        """Start ``self.args`` (a subclass may start it another way, with the same effect)."""
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                self.args,
                cwd=cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    # -- state -------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Pid of the main process (also its process group id)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once the main process was reaped, else None."""
        return self.proc.poll()

    def is_running(self) -> bool:
        """True while the main process has not exited (a paused process is still running)."""
        return self.proc.poll() is None

    def child_pids(self) -> list[int]:
        """Live direct children of the main process."""
        return children_of(self.pid)

    def group_pids(self) -> list[int]:
        """Live processes of the process group (the main process included while alive)."""
        return group_members(self.pid)

    # -- the log -----------------------------------------------------------------------------

    def log_bytes(self) -> bytes:
        """Everything the process wrote so far, raw."""
        try:
            return self.log_path.read_bytes()
        except OSError:
            return b""

    def log_text(self, start: int = 0) -> str:
        """The log from byte offset ``start`` on."""
        return self.log_bytes()[start:].decode(errors="replace")

    def log_size(self) -> int:
        """Current size of the log in bytes (an offset for :meth:`log_text`)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_log(self, pattern: str, timeout: float = 20.0, start: int = 0) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) appears in the log after ``start``; return the match.

        Raises TimeoutError (or RuntimeError if the process exited) with the log's tail.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log_text(start))
            if match is not None:
                return match
            if not self.is_running():
                raise RuntimeError(
                    f"{self.name} exited with {self.returncode} before logging {pattern!r}:\n"
                    f"{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.name} did not log {pattern!r} within {timeout}s:\n{self.log_tail()}"
                )
            time.sleep(self.poll_interval)

    # -- signals -----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the main process only."""
        if self.is_running():
            kill_pid(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the whole process group (the main process and what it forked)."""
        if self.is_running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def stop(self) -> None:
        """Pause the process group (SIGSTOP), as a long GC pause or a frozen VM would."""
        self.stopped_at = time.time()
        self.signal_group(signal.SIGSTOP)

    def cont(self) -> None:
        """Resume a paused process group (SIGCONT); remember the log size at that moment."""
        self.log_size_at_cont = self.log_size()
        self.continued_at = time.time()
        self.signal_group(signal.SIGCONT)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the main process to exit; return its exit code (TimeoutExpired on timeout)."""
        code = self.proc.wait(timeout=timeout)
        _LIVE.discard(self)
        return code

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (resumed first if paused); :meth:`kill` it all after ``timeout`` seconds."""
        self.signal(signal.SIGTERM)
        self.signal_group(signal.SIGCONT)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait(5)

    def kill(self) -> None:
        """SIGKILL the main process, its process group and every descendant, then reap.

        Processes of the group are reparented when the main one dies: they are killed until
        none is left (for up to 5 s).
        """
        running = self.is_running()
        descendants = children_of(self.pid, recursive=True) if running else []
        if running and self.killed_at is None:
            # right at the signal: listing the descendants can take a third of a second on a
            # loaded machine, and the process runs (a beat publishes) until the SIGKILL
            self.killed_at = time.time()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        kill_pid(self.pid)
        for pid in descendants:
            kill_pid(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = [pid for pid in [*descendants, *self.group_pids()] if is_alive(pid)]
            if not left:
                break
            for pid in left:
                kill_pid(pid)
            time.sleep(0.02)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited({self.returncode})"
        return f"<{type(self).__name__} {self.name} pid={self.pid} {state}>"


@atexit.register
def _kill_leftover_processes() -> None:
    for process in list(_LIVE):
        with contextlib.suppress(Exception):
            process.kill()
