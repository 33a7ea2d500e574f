"""Real ``celery beat`` processes for integration tests (the beat side of ``workers.py``).

Each beat runs ``python -m celery -A <module> beat -S <scheduler> -s <file> --max-interval 1``
from the repository root: a :class:`~celery_singleton_lock._dev.process.DevProcess`, in its own
session, with stdout+stderr in a log file. It can be killed (SIGKILL), paused (SIGSTOP), resumed
(SIGCONT) or stopped (SIGTERM); :class:`BeatFactory` and an atexit hook make sure none outlives
the tests. The log is parsed into timestamped lines, so a test can tell what a beat did and when
(beat logs local time with millisecond precision).
"""

from __future__ import annotations

import re
import sys
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path

from tests.support.history import Execution
from tests.support.workers import REPO_ROOT, CeleryProcess

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


class BeatProcess(CeleryProcess):
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
        schedule_file: str | None = None,
    ) -> None:
        self.app_module = app_module
        name = name or f"beat-{uuid.uuid4().hex[:8]}"
        work_dir = Path(work_dir)
        #: its schedule file: its own, or another's it starts on (``schedule_file``)
        self.schedule_path = work_dir / f"schedule-{schedule_file or name}"
        args = [
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
        super().__init__(args, work_dir / f"{name}.log", name=name, env=env, cwd=REPO_ROOT)

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

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Wait for the singleton scheduler's first tick; return its log time (epoch s)."""
        self.wait_for_log(r"singleton scheduler started", timeout)
        return next(ln.ts for ln in self.lines() if "singleton scheduler started" in ln.text)

    def terminate(self, timeout: float = 15.0) -> int:
        """Stop the beat (SIGTERM, resumed if paused); SIGKILL it after ``timeout``."""
        return super().terminate(timeout)


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
