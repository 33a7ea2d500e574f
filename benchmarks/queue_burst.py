"""Section 9: a burst of calls of one key, ``singleton_on_duplicate="queue"`` against
``"retry"`` (``singleton_retry_countdown=0.5``).

A holder of one key runs on one prefork worker of four processes; twenty calls of the key are
sent, each once the one before reached the key (it waits: queued, or requeued), so the order
they reached it is the order they were sent; then the holder lets go. Each run takes 50 ms.
For each policy, interleaved over the repeats:

- **holder's end to last end**: how long the key takes to serve the burst once it is free (the
  server's clock, as each run records it); the floor is 20 runs of 50 ms back to back, 1 s;
- **broker messages per call**: every message published to the broker during the burst
  (Redis ``LPUSH``, counted by the server), over the 20 calls: 1.0 would be each call's own
  message and nothing more. A ``retry`` wait is a message per try; a ``queue`` wait is none
  until the call's turn, then its own message once more;
- **runs in the order sent**: how many of the 20 runs started in the order their calls were
  sent (``queue`` keeps arrival order; ``retry`` takes whichever requeued call comes first).

    python -m benchmarks.queue_burst [--repeat N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from celery_singleton_lock.core.queue import queue_keys

from .report import Table, median, spread
from .server import PrivateRedis, command_stats
from .workers import BenchWorker

CALLS = 20
BODY_S = 0.05


@dataclasses.dataclass
class Burst:
    span_s: float
    messages_per_call: float
    in_order: int


def _holding(client: Any, queue: str) -> bool:
    """Whether the burst's holder holds its key (the lock beside ``queue``)."""
    return bool(client.exists(queue[: -len(":queue")] + ":lock"))


def _reached(client: Any, queue: str, result: Any) -> bool:
    """Whether the call of ``result`` reached its key: it waits in the key's ``queue``, or it
    was requeued (its state RETRY)."""
    if client.zscore(queue, result.id) is not None:
        return True
    return result.state not in ("PENDING", "SENT")


def _burst(app: Any, client: Any, task: str, timeout: float = 120.0) -> Burst:
    from .bench_app import BURST_RUNS_KEY

    key = uuid.uuid4().hex[:8]
    queue, _ = queue_keys(app.tasks[task].singleton_keys((key, 0, BODY_S), {}).lock)
    before = command_stats(client).calls("lpush")
    deadline = time.monotonic() + timeout
    app.send_task(task, (key, 0, BODY_S), queue="bench")  # the holder
    while not _holding(client, queue):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{task}: the holder never took its key")
        time.sleep(0.002)
    for payload in range(1, CALLS + 1):
        result = app.send_task(task, (key, payload, BODY_S), queue="bench")
        while not _reached(client, queue, result):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{task}: call {payload} never reached its key")
            time.sleep(0.002)
    client.rpush(BURST_RUNS_KEY + key + ":go", 1)
    while client.llen(BURST_RUNS_KEY + key) < CALLS + 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{task}: {client.llen(BURST_RUNS_KEY + key)} of {CALLS} ran")
        time.sleep(0.02)
    published = command_stats(client).calls("lpush") - before  # kombu publishes with LPUSH
    runs = [line.decode().split() for line in client.lrange(BURST_RUNS_KEY + key, 0, -1)]
    runs.sort(key=lambda run: int(run[1]))
    holder, burst = runs[0], runs[1:]
    order = [int(run[0]) for run in burst]
    span = (max(int(run[2]) for run in burst) - int(holder[2])) / 1e6
    in_order = sum(1 for i, payload in enumerate(order, 1) if payload == i)
    return Burst(span, (published - 1) / CALLS, in_order)  # the holder's own message left out


def run(server: PrivateRedis, repeats: int) -> Table:
    from . import bench_app

    app = bench_app.configure(server.url)
    client = server.client()
    worker = BenchWorker(server.url, "prefork", 4)
    results: dict[str, list[Burst]] = {bench_app.QUEUE_BURST: [], bench_app.RETRY_BURST: []}
    try:
        worker.wait_ready(app)
        for _ in range(repeats):  # interleaved: each round one burst of each
            for task, bursts in results.items():
                bursts.append(_burst(app, client, task))
    finally:
        worker.close()
    table = Table(
        f"9. A burst of {CALLS} calls of one key, {BODY_S * 1000:.0f} ms each, one prefork "
        "worker of 4: queue against retry",
        [
            "policy",
            "holder's end to last end, s",
            "spread",
            "broker messages per call",
            "spread",
            f"runs in the order sent (of {CALLS})",
        ],
    )
    names = {bench_app.QUEUE_BURST: '"queue"', bench_app.RETRY_BURST: '"retry" (countdown 0.5 s)'}
    for task, bursts in results.items():
        spans = [b.span_s for b in bursts]
        messages = [b.messages_per_call for b in bursts]
        table.add(
            names[task],
            median(spans),
            spread(spans),
            median(messages),
            spread(messages),
            f"{min(b.in_order for b in bursts)} to {max(b.in_order for b in bursts)}",
        )
    table.notes.append(
        f"{repeats} bursts per policy, interleaved; medians, spread min-max. The floor for the "
        f"span is {CALLS} runs back to back: {CALLS * BODY_S:.1f} s. Messages: the broker's "
        "LPUSH count during the burst over the calls, the holder's left out (1.0: each call's "
        "own message only)."
    )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.queue_burst", description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    with PrivateRedis() as server:
        table = run(server, args.repeat)
    print(table.render())
    if args.json:
        args.json.write_text(json.dumps(dataclasses.asdict(table), default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
