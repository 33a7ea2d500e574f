"""Real ``celery beat`` processes for integration tests (the beat side of ``workers.py``).

Each beat runs ``python -m celery -A <module> beat -S <scheduler> -s <file> --max-interval 1``
from the repository root in its own session, with stdout+stderr in a log file. It can be killed
(SIGKILL), paused (SIGSTOP), resumed (SIGCONT) or stopped (SIGTERM); :class:`BeatFactory` and an
atexit hook make sure none outlives the tests. The log is parsed into timestamped lines, so a
test can tell what a beat did and when (beat logs local time with millisecond precision).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path

from tests.support.history import Execution
from tests.support.workers import REPO_ROOT, _kill_pid, group_members, is_alive

_LIVE: set[BeatProcess] = set()

_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): (\w+)/([\w-]+)\] (.*)$")
_PUBLISHED = re.compile(r"beat: published run: entry=(\S+) run=(\S+) task_id=(\S+)")


@dataclass(frozen=True)
class LogLine:
    """One timestamped line of a beat's log; ``ts`` in epoch seconds (from local time)."""

    ts: float
    level: str
    text: str


@dataclass(frozen=True)
class Published:
    """A ``beat: published run`` line: which run this beat published, and when."""

    ts: float
    entry: str
    run: str
    task_id: str

    @property
    def label(self) -> str:
        """The run label the executed task records: ``<entry>@<run id>``."""
        return f"{self.entry}@{self.run}"


def parse_log(text: str) -> list[LogLine]:
    """The timestamped lines of a Celery log (banner and traceback lines are skipped)."""
    lines = []
    for raw in text.splitlines():
        match = _LINE.match(raw.strip("\x00 "))
        if match is None:
            continue
        stamp, level, _process, message = match.groups()
        ts = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        lines.append(LogLine(ts, level, message))
    return lines


class BeatProcess:
    """One ``celery beat`` subprocess."""

    def __init__(  # noqa: PLR0917
        self,
        app_module: str,
        work_dir: Path,
        name: str | None = None,
        env: Mapping[str, str] | None = None,
        scheduler: str = "singleton",
        max_interval: float = 1.0,
        loglevel: str = "INFO",
        extra_args: Iterable[str] = (),
    ) -> None:
        self.app_module = app_module
        self.name = name or f"beat-{uuid.uuid4().hex[:8]}"
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = work_dir / f"{self.name}.log"
        self.schedule_path = work_dir / f"schedule-{self.name}"
        self.args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app_module,
            "beat",
            "-S",
            scheduler,
            "-s",
            str(self.schedule_path),
            "--max-interval",
            f"{max_interval:g}",
            "-l",
            loglevel,
            *extra_args,
        ]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        #: epoch times of the last signals sent (None until sent)
        self.started_at = time.time()
        self.killed_at: float | None = None
        self.stopped_at: float | None = None
        self.continued_at: float | None = None
        #: log size in bytes when the process was resumed (SIGCONT)
        self.log_size_at_cont: int | None = None
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.args,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        _LIVE.add(self)

    # -- state -------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Pid of the beat process (also its process group id)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once the process was reaped, else None."""
        return self.proc.poll()

    def is_running(self) -> bool:
        """True while the process has not exited (a stopped process is still running)."""
        return self.proc.poll() is None

    # -- the log -----------------------------------------------------------------------------

    def log_bytes(self) -> bytes:
        """Everything the beat wrote so far, raw."""
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

    def lines(self, start: int = 0) -> list[LogLine]:
        """Timestamped log lines from byte offset ``start`` on."""
        return parse_log(self.log_text(start))

    def published(self, start: int = 0) -> list[Published]:
        """Every run this beat logged as published, from byte offset ``start`` on."""
        found = []
        for line in self.lines(start):
            match = _PUBLISHED.search(line.text)
            if match is not None:
                found.append(Published(line.ts, *match.groups()))
        return found

    def wait_for_log(self, pattern: str, timeout: float = 20.0, start: int = 0) -> re.Match[str]:
        """Wait until ``pattern`` (a regex) appears in the log after ``start``; return the match.

        Raises TimeoutError (or RuntimeError if the beat exited) with the log's tail."""
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
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Wait for the singleton scheduler's first tick; return its log time (epoch s)."""
        self.wait_for_log(r"singleton scheduler started", timeout)
        return next(ln.ts for ln in self.lines() if "singleton scheduler started" in ln.text)

    # -- signals -----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the beat process."""
        if self.is_running():
            _kill_pid(self.pid, sig)

    def stop(self) -> None:
        """Pause the beat (SIGSTOP)."""
        self.stopped_at = time.time()
        self.signal(signal.SIGSTOP)

    def cont(self) -> None:
        """Resume a paused beat (SIGCONT); remember the log size at that moment."""
        self.log_size_at_cont = self.log_size()
        self.continued_at = time.time()
        self.signal(signal.SIGCONT)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the process to exit; return its exit code (TimeoutExpired on timeout)."""
        code = self.proc.wait(timeout=timeout)
        _LIVE.discard(self)
        return code

    def terminate(self, timeout: float = 15.0) -> int:
        """Stop the beat (SIGTERM, resumed if paused); SIGKILL it after ``timeout``."""
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.wait(5)

    def kill(self) -> None:
        """SIGKILL the beat and anything in its process group, then reap it."""
        if self.killed_at is None and self.is_running():
            self.killed_at = time.time()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        _kill_pid(self.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.wait(10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = [pid for pid in group_members(self.pid) if is_alive(pid)]
            if not left:
                break
            for pid in left:
                _kill_pid(pid)
            time.sleep(0.02)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited({self.returncode})"
        return f"<BeatProcess {self.name} pid={self.pid} {state}>"


class BeatFactory:
    """Starts beats with logs and schedule files under ``work_dir``; :meth:`close` kills all."""

    def __init__(self, work_dir: Path, base_env: Mapping[str, str] | None = None) -> None:
        self.work_dir = Path(work_dir)
        self.base_env = dict(base_env or {})
        self.beats: list[BeatProcess] = []

    def start(
        self,
        app_module: str = "tests.support.beat_app",
        env: Mapping[str, str] | None = None,
        name: str | None = None,
        **kwargs: object,
    ) -> BeatProcess:
        """Start a beat; ``env`` is merged over ``base_env``, itself over ``os.environ``."""
        beat = BeatProcess(
            app_module,
            self.work_dir,
            name=name or f"beat{len(self.beats) + 1}",
            env={**self.base_env, **(env or {})},
            **kwargs,  # type: ignore[arg-type]
        )
        self.beats.append(beat)
        return beat

    def close(self) -> None:
        """SIGKILL every beat started here."""
        for beat in self.beats:
            beat.kill()

    def logs(self, lines: int = 200) -> str:
        """Every beat's log tail, for failure messages."""
        return "\n".join(
            f"===== {b.name} (pid {b.pid}) =====\n{b.log_tail(lines)}" for b in self.beats
        )


@atexit.register
def _kill_leftover_beats() -> None:
    for beat in list(_LIVE):
        with contextlib.suppress(Exception):
            beat.kill()


# -- what the executions recorded by tests.support.beat_app say --------------------------------


class BeatHistory:
    """The executions of beat_app's entries, keyed by run label ``<entry>@<run id ms>``."""

    def __init__(self, executions: Iterable[Execution]) -> None:
        self.executions = list(executions)
        self.labels = Counter(e.key for e in self.executions)

    def duplicates(self) -> dict[str, int]:
        """Run labels executed more than once, with their counts."""
        return {label: n for label, n in self.labels.items() if n > 1}

    def unlabelled(self) -> list[str]:
        """Labels without a run id (a message published without the run header)."""
        return [label for label in self.labels if label.endswith("@?")]

    def run_ids(self, entry: str) -> list[int]:
        """The distinct run ids (epoch ms) of ``entry`` that executed, in order."""
        ids = {
            int(label.rsplit("@", 1)[1])
            for label in self.labels
            if label.startswith(f"{entry}@") and not label.endswith("@?")
        }
        return sorted(ids)

    def starts_of(self, label: str) -> list[float]:
        """Start times (epoch s, Redis server clock) of every execution of ``label``."""
        return [e.start_us / 1e6 for e in self.executions if e.key == label]

    def missing_slots(self, entry: str, step_ms: int, first_ms: int, last_ms: int) -> list[int]:
        """Slots of ``entry`` from ``first_ms`` to ``last_ms`` (both included) that never ran."""
        seen = set(self.run_ids(entry))
        return [s for s in range(first_ms, last_ms + 1, step_ms) if s not in seen]

    def largest_gap_ms(self, entry: str) -> int:
        """Largest distance between consecutive run ids of ``entry`` (0 if fewer than two)."""
        ids = self.run_ids(entry)
        return max((b - a for a, b in pairwise(ids)), default=0)

    def summary(self) -> str:
        """Per entry: count, first and last run id, and the run ids' differences if irregular."""
        lines = [f"{len(self.executions)} executions, {len(self.labels)} distinct runs"]
        entries = sorted({label.rsplit("@", 1)[0] for label in self.labels})
        for entry in entries:
            ids = self.run_ids(entry)
            lines.append(f"  {entry}: {len(ids)} runs {ids[:1]}..{ids[-1:]}")
        for label, count in sorted(self.duplicates().items()):
            lines.append(f"  DUPLICATE {label} x{count}")
        return "\n".join(lines)
