"""Section 2c: the work each contender does per task, counted instead of timed.

Section 2's throughput moves by ten points from run to run on a shared machine; a count of
the work done per task does not. For every base class of section 2, this process publishes
tasks (``apply_async`` to the private broker) and runs them through Celery's worker tracer
(``task.__trace__``, set to ``build_tracer(..., eager=False)`` as a worker sets it: the
function a worker's pool calls for each message,
with the real result backend and the library's ``task_postrun`` release), and counts per
task:

- Python bytecodes executed and Python function calls, publish and run apart
  (``sys.settrace`` with opcode events);
- Redis commands the server ran (``INFO commandstats``; the calls inside scripts included),
  and of them the script calls (``EVALSHA``, ``EVAL``): what the client sent, each call's
  inner commands riding in it;
- with ``--instructions`` (valgrind on PATH): CPU instructions in user space, from callgrind,
  in a child process that publishes and runs K tasks, minus one that does K/3 (start-up
  cancels out).

The counts repeat from run to run (the instructions to a few per thousand), whatever the
machine's load. They leave out what no count sees: system calls, waiting for Redis, and the
broker's and the worker's own loop, which are the same for every contender.

    python -m benchmarks.work                  # bytecodes, calls, Redis commands (seconds)
    python -m benchmarks.work --instructions   # also callgrind (about a minute per row)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from .report import Table
from .server import STATS_COMMANDS, PrivateRedis, command_stats

#: tasks counted per contender under settrace (the counts are per task, so few are enough)
TRACED = 20
#: tasks published and run before counting: connections, scripts, caches, renewer thread
WARM_UP = 30
#: tasks of the long callgrind child; the short one does a third of them
CALLGRIND_TASKS = 150
#: the commands this module sends itself while counting
HARNESS_COMMANDS = STATS_COMMANDS
#: the commands that run a script (``INFO commandstats`` names)
SCRIPT_COMMANDS = ("evalsha", "eval", "evalsha_ro", "eval_ro")
#: the floor a run's instructions are read against: SingletonTask's Redis traffic, no library
TRAFFIC_FLOOR = "plain + SingletonTask's Redis traffic (floor, no library Python)"
#: a SingletonTask's publish and run at most this much over that floor, in instructions
RUN_TARGET = 0.05


@dataclass
class Work:
    """What one contender does per task."""

    name: str
    publish_bytecodes: float = 0.0
    run_bytecodes: float = 0.0
    library_bytecodes: float = 0.0
    calls: float = 0.0
    redis_commands: float = 0.0
    script_calls: float = 0.0
    instructions: float | None = None
    by_function: Counter[str] = field(default_factory=Counter, repr=False)

    @property
    def bytecodes(self) -> float:
        return self.publish_bytecodes + self.run_bytecodes


class _Counter:
    """A ``sys.settrace`` function counting opcodes and calls, by function."""

    def __init__(self) -> None:
        self.opcodes: Counter[str] = Counter()
        self.calls = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "opcode":
            code = frame.f_code
            self.opcodes[f"{code.co_filename}:{code.co_name}"] += 1
        elif event == "call":
            self.calls += 1
            frame.f_trace_opcodes = True
        return self

    def total(self) -> int:
        return sum(self.opcodes.values())


class _Tasks:
    """Publishes tasks of one contender and runs them as a worker's pool would."""

    def __init__(self, app: Any, task: Any) -> None:
        from celery.app.trace import build_tracer

        self.app = app
        self.task = task
        # as a worker assigns it, so a SingletonTask's own wrapper (task/tracer.py) is in the count
        task.__trace__ = build_tracer(task.name, task, eager=False, app=app, hostname="bench@work")
        self.trace = task.__trace__
        self.next = int(uuid.uuid4().int % 10**12) * 1000

    def args(self) -> tuple[int]:
        self.next += 1
        return (self.next,)

    def publish(self, args: tuple[int]) -> str:
        task_id = uuid.uuid4().hex
        self.task.apply_async(args=args, task_id=task_id)
        return task_id

    def run(self, task_id: str, args: tuple[int]) -> None:
        request = {
            "id": task_id,
            "task": self.task.name,
            "retries": 0,
            "delivery_info": {"exchange": "", "routing_key": "bench", "redelivered": False},
            "hostname": "bench@work",
            "is_eager": False,
        }
        _retval, info, _runtime, _shown = self.trace(task_id, args, {}, request)
        if info is not None:  # a failed run would count Celery formatting its traceback
            raise RuntimeError(f"{self.task.name}[{task_id}] ended {info.state}: {info.retval!r}")

    def both(self, n: int) -> None:
        for _ in range(n):
            args = self.args()
            self.run(self.publish(args), args)


def _app(url: str) -> Any:
    from . import bench_app

    app = bench_app.configure(url)
    app.backend.on_task_call = lambda producer, task_id: None  # as section 2: no result channels
    app.finalize()
    return app


def count(url: str, names: Sequence[str], client: Any) -> list[Work]:
    """Bytecodes, calls and Redis commands per task for each contender, in this process."""
    from . import bench_app

    app = _app(url)
    out = []
    for name in names:
        tasks = _Tasks(app, {**bench_app.TASKS, **bench_app.COUNTED_ONLY}[name])
        tasks.both(WARM_UP)
        work = Work(name)
        publish, run = _Counter(), _Counter()
        client.config_resetstat()
        for _ in range(TRACED):
            args = tasks.args()
            sys.settrace(publish)
            try:
                task_id = tasks.publish(args)
            finally:
                sys.settrace(None)
            sys.settrace(run)
            try:
                tasks.run(task_id, args)
            finally:
                sys.settrace(None)
        stats = command_stats(client)
        commands = stats.total_calls(HARNESS_COMMANDS)
        work.script_calls = sum(stats.calls(name) for name in SCRIPT_COMMANDS) / TRACED
        work.publish_bytecodes = publish.total() / TRACED
        work.run_bytecodes = run.total() / TRACED
        work.calls = (publish.calls + run.calls) / TRACED
        work.redis_commands = commands / TRACED
        work.by_function = publish.opcodes + run.opcodes
        work.library_bytecodes = (
            sum(n for where, n in work.by_function.items() if "celery_singleton_lock" in where)
            / TRACED
        )
        out.append(work)
    return out


def instructions(url: str, name: str) -> float | None:
    """User-space CPU instructions per task (publish + run), from two callgrind runs."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    totals = []
    for n in (CALLGRIND_TASKS // 3, CALLGRIND_TASKS):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "callgrind.out"
            subprocess.run(
                [
                    valgrind,
                    "--tool=callgrind",
                    f"--callgrind-out-file={out}",
                    sys.executable,
                    "-m",
                    "benchmarks.work",
                    "--child",
                    name,
                    str(n),
                    url,
                ],
                cwd=Path(__file__).resolve().parents[1],
                env={**os.environ, "PYTHONHASHSEED": "0"},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=True,
                timeout=900,
            )
            totals.append(_callgrind_total(out))
    return (totals[1] - totals[0]) / (CALLGRIND_TASKS - CALLGRIND_TASKS // 3)


def _callgrind_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {path}")


def _child(name: str, n: int, url: str) -> None:
    """Inside callgrind: warm up, then publish and run ``n`` tasks."""
    from . import bench_app

    tasks = _Tasks(_app(url), {**bench_app.TASKS, **bench_app.COUNTED_ONLY}[name])
    tasks.both(WARM_UP + n)


def run(server: PrivateRedis, with_instructions: bool) -> tuple[Table, list[Work]]:
    from . import bench_app

    client = server.client()
    names = [*bench_app.TASKS, *bench_app.COUNTED_ONLY]
    works = count(server.url, names, client)
    if with_instructions:
        for work in works:
            work.instructions = instructions(server.url, work.name)
    return _table(works, with_instructions), works


def _table(works: list[Work], with_instructions: bool) -> Table:
    headers = [
        "base class",
        "bytecodes/task: publish",
        "run",
        "vs plain",
        "of it in celery_singleton_lock",
        "Python calls/task",
        "Redis cmds/task",
        "of them script calls",
    ]
    if with_instructions:
        headers += ["instructions/task", "vs plain"]
    table = Table("2c. Work per task, counted (publish + run, in-process; not timed)", headers)
    plain = works[0]
    for w in works:
        row: list[Any] = [
            w.name,
            w.publish_bytecodes,
            w.run_bytecodes,
            f"+{w.bytecodes - plain.bytecodes:,.0f}",
            w.library_bytecodes,
            w.calls,
            w.redis_commands,
            w.script_calls,
        ]
        if with_instructions:
            if w.instructions is None or plain.instructions is None:
                row += ["-", "-"]
            else:
                row += [w.instructions, f"+{w.instructions - plain.instructions:,.0f}"]
        table.add(*row)
    table.notes.append(
        f"{TRACED} tasks per row after {WARM_UP} to warm up; each published with apply_async to "
        "the broker and run through Celery's worker tracer in this process. Counts repeat from "
        "run to run; they leave out system calls and waiting for Redis."
    )
    if with_instructions:
        table.notes.append(
            f"Instructions: callgrind, user space, ({CALLGRIND_TASKS} tasks minus "
            f"{CALLGRIND_TASKS // 3}) / {CALLGRIND_TASKS - CALLGRIND_TASKS // 3}."
        )
        by_name = {w.name: w.instructions for w in works}
        ours, floor = by_name.get("SingletonTask"), by_name.get(TRAFFIC_FLOOR)
        if ours is not None and floor is not None:
            over = ours / floor - 1
            verdict = "met" if over <= RUN_TARGET else "not met"
            table.notes.append(
                f"Target: a SingletonTask publish and run within {RUN_TARGET:.0%} of the "
                f"traffic-only floor's instructions: {over:+.1%} ({verdict})."
            )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.work", description=__doc__)
    parser.add_argument(
        "--instructions", action="store_true", help="also count CPU instructions (valgrind)"
    )
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    parser.add_argument("--child", nargs=3, metavar=("NAME", "N", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        name, n, url = args.child
        _child(name, int(n), url)
        return 0
    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind on PATH")
    with PrivateRedis() as server:
        table, _ = run(server, args.instructions)
    print(table.render())
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(table), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
