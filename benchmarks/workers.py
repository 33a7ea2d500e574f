"""Real ``celery worker`` subprocesses for the throughput benchmarks.

Each worker runs ``python -m celery -A benchmarks.bench_app worker`` from the repository root:
a :class:`~celery_singleton_lock._dev.process.DevProcess`, in its own session, so
:meth:`BenchWorker.close` can SIGKILL its whole process group. Workers log at WARNING: a
per-task INFO line would cost more than some of the differences measured.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from celery_singleton_lock._dev.process import DevProcess, children_of, cpu_seconds

from .bench_app import URL_ENV

REPO_ROOT = Path(__file__).resolve().parents[1]


class BenchWorker(DevProcess):
    """One worker process (solo, or prefork with ``concurrency`` children)."""

    def __init__(
        self, url: str, pool: str, concurrency: int, env: dict[str, str] | None = None
    ) -> None:
        self.pool = pool
        self.concurrency = concurrency
        name = f"bench-{pool}-{uuid.uuid4().hex[:6]}"
        self.nodename = f"{name}@{socket.gethostname()}"
        args = [
            sys.executable,
            # `python -m celery`, with this package imported first: the celery command imports
            # the library (its entry point) before the app, and the library is measured as a
            # plain install has it (benchmarks/__init__.py)
            "-c",
            "import benchmarks, celery.__main__; celery.__main__.main()",
            "-A",
            "benchmarks.bench_app",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            f"{name}@%h",
            "-Q",
            "bench",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "-l",
            "WARNING",
        ]
        log_path = Path(tempfile.gettempdir()) / f"cslt-{name}.log"
        env = {URL_ENV: url, **(env or {})}
        super().__init__(args, log_path, name=name, env=env, cwd=REPO_ROOT)

    def wait_ready(self, app: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise RuntimeError(f"worker exited early:\n{self.log_tail()}")
            replies = app.control.ping(destination=[self.nodename], timeout=0.5)
            if any(self.nodename in reply for reply in replies or ()):
                return
        raise TimeoutError(f"worker not ready within {timeout}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        return super().log_tail(lines)

    def rss_bytes(self) -> int:
        """Resident memory of the worker and its children, now (``/proc``)."""
        total = 0
        for pid in [self.pid, *children_of(self.pid, recursive=True)]:
            try:
                with open(f"/proc/{pid}/status", encoding="ascii") as fh:
                    for line in fh:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1]) * 1024
            except OSError:
                continue
        return total

    def cpu_seconds(self) -> float:
        """User + system CPU of the worker and its children so far."""
        pids = [self.pid, *children_of(self.pid, recursive=True)]
        return sum(cpu_seconds(pid) for pid in pids)

    def close(self) -> None:
        """SIGKILL the worker's whole tree and remove its log."""
        self.kill()
        with contextlib.suppress(OSError):
            self.log_path.unlink()
