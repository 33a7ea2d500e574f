"""A real Flower for integration tests, and an event receiver in the test process.

:class:`FlowerProcess` runs ``python -m celery -A <module> flower`` headless on a free loopback
port (a :class:`~celery_singleton_lock._dev.process.DevProcess`: its own session, a log file,
killed with everything it started), with its HTTP API open (``FLOWER_UNAUTHENTICATED_API``).
:class:`EventCapture` is what ``celery events`` does: an event receiver, in a thread of the test
process, keeping every event it gets.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celery import Celery

from celery_singleton_lock._dev.process import DevProcess
from tests.support.servers import free_port
from tests.support.waiting import wait_for
from tests.support.workers import REPO_ROOT

__all__ = ["EventCapture", "FlowerProcess"]

__test__ = False


class FlowerProcess(DevProcess):
    """One headless ``celery flower`` on 127.0.0.1 and a free port."""

    def __init__(
        self, app_module: str, log_dir: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            app_module,
            "flower",
            "--address=127.0.0.1",
            f"--port={self.port}",
            "--persistent=False",
        ]
        super().__init__(
            args,
            Path(log_dir) / f"flower-{self.port}.log",
            env={"FLOWER_UNAUTHENTICATED_API": "true", **(env or {})},
            cwd=REPO_ROOT,
        )

    def get(self, path: str) -> Any:
        """GET ``path`` from Flower's HTTP API and decode its JSON (None on a 404)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 404:
                return None
            raise

    def task(self, task_id: str) -> dict[str, Any] | None:
        """``/api/task/info/<id>``: what Flower knows of a task, None if nothing yet."""
        info: dict[str, Any] | None = self.get(f"/api/task/info/{task_id}")
        return info

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Wait until ``/healthcheck`` answers; raise with the log's tail if it does not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.is_running():
                raise RuntimeError(f"flower exited with {self.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/healthcheck", timeout=1) as reply:
                    if reply.read() == b"OK":
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"flower did not answer within {timeout}s:\n{self.log_tail()}")


class EventCapture:
    """Every event the broker's event exchange carries while it runs (``celery events``)."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.events: list[dict[str, Any]] = []
        self._receiver: Any = None
        self._thread = threading.Thread(target=self._capture, name="event-capture", daemon=True)

    def _capture(self) -> None:
        # wakeup: ask the workers for a heartbeat (worker-heartbeat) once consuming
        with self.app.connection_for_read() as connection:
            self._receiver = self.app.events.Receiver(
                connection, handlers={"*": self.events.append}
            )
            self._receiver.capture(limit=None, timeout=None, wakeup=True)

    def start(self) -> EventCapture:
        self._thread.start()
        return self

    def wait_subscribed(self, *workers: Any, timeout: float = 20) -> None:
        """Wait until the receiver gets events: a worker answers a heartbeat request with a
        worker-heartbeat event; one sent before the subscription reached the broker is lost,
        so ask again."""

        def subscribed() -> bool:
            if any(e.get("type") == "worker-heartbeat" for e in self.events):
                return True
            self.app.control.broadcast("heartbeat")
            return False

        wait_for(subscribed, timeout, "the receiver to get a heartbeat", *workers, interval=0.3)

    def stop(self) -> None:
        """Stop consuming (within the receiver's one-second poll) and close the connection."""
        deadline = time.monotonic() + 10
        while self._receiver is None and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._receiver is not None:
            self._receiver.should_stop = True
        self._thread.join(10)

    def of(self, task_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        """The events of ``task_id`` so far (of type ``kind`` only, if given)."""
        return [
            e
            for e in list(self.events)
            if e.get("uuid") == task_id and (kind is None or e.get("type") == kind)
        ]
