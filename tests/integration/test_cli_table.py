"""``celery singleton list`` read by an operator: aligned columns in a terminal (a real pseudo
terminal), tab-separated when piped, never a control character from a lock's fields."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys

import redis

from celery_singleton_lock.core.keys import lock_keys
from celery_singleton_lock.core.store import LockStore
from celery_singleton_lock.tools.columns import PREVIEW_WIDTH, width
from tests.support.basic_app import SINGLETON_APP
from tests.support.workers import REPO_ROOT

#: A long task name, a preview longer than a terminal cell, wide characters, and an
#: ``argsrepr`` with a tab, a newline and an escape sequence (it can hold any string).
LOCKS = (
    ("t.a", b"short", "(1,)"),
    ("proj.billing.tasks.sync_every_account_of_the_tenant", b"long", "x" * 100),
    ("t.wide", b"wide", "('東京都', 'Zürich')"),
    ("t.hostile", b"hostile", "(1,\t2)\n\x1b[31mred"),
)


def _plant(client: redis.Redis, prefix: str) -> dict[str, str]:
    """The locks of LOCKS, as a worker takes them; ``{task: key}``."""
    keys = {}
    for task, ident, args in LOCKS:
        found = lock_keys(prefix, task, ident)
        meta = {"task": task, "host": "w1@host", "pid": "4242", "args": args}
        LockStore(client).acquire(found, f"owner-{ident.decode()}", 0, 60_000, meta)
        keys[task] = found.lock
    return keys


def _list_command(redis_url: str, prefix: str, *command: str) -> list[str]:
    """``celery -A <the test app> singleton --url ... --prefix ... list`` (or ``command``)."""
    return [
        *(sys.executable, "-m", "celery", "-A", SINGLETON_APP, "singleton"),
        *("--url", redis_url, "--prefix", prefix, *(command or ("list",))),
    ]


def _list_in_a_terminal(redis_url: str, prefix: str, *command: str) -> str:
    """``list``'s (or ``command``'s) output with its stdout a pseudo terminal, as an
    operator's shell runs it."""
    master, slave = pty.openpty()
    args = _list_command(redis_url, prefix, *command)
    with subprocess.Popen(args, cwd=REPO_ROOT, stdout=slave, stderr=subprocess.PIPE) as run:
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the command closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        os.close(master)
        assert run.wait(60) == 0, run.stderr.read() if run.stderr else ""
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_list_aligns_columns_in_a_terminal_and_cuts_long_previews(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """Every column starts at the same display cell on every line (wide characters count two),
    the preview is cut with ``...``, the key is whole, and no control character gets through."""
    keys = _plant(redis_client, key_prefix)
    text = _list_in_a_terminal(redis_url, key_prefix)
    assert "\x1b" not in text
    assert "\t" not in text
    lines = text.rstrip("\n").split("\n")
    header, rows = lines[0], lines[1:]
    assert len(rows) == len(LOCKS), text
    holder_at = header.index("HOLDER")
    key_at = width(header[: header.index("KEY")])
    by_task = {row.split()[0]: row for row in rows}
    assert set(by_task) == {task for task, _, _ in LOCKS}
    for task, ident, _ in LOCKS:
        row = by_task[task]
        holder = f"owner-{ident.decode()}"
        assert width(row[: row.index(holder)]) == holder_at, text
        key = keys[task]
        assert row.endswith(key), text  # the key, whole, for `show` and `release`
        assert width(row[: row.index(key)]) == key_at, text
    long_row = by_task["proj.billing.tasks.sync_every_account_of_the_tenant"]
    assert "x" * (PREVIEW_WIDTH - 3) + "..." in long_row
    assert "x" * (PREVIEW_WIDTH - 2) not in long_row
    assert "('東京都', 'Zürich')" in by_task["t.wide"]
    assert "(1,\\t2)\\n\\x1b[31mred" in by_task["t.hostile"]


def test_list_stays_tab_separated_when_piped(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """Piped, each line is one row of tab-separated cells with the whole stored preview; a
    control character inside a cell is escaped, so the columns hold."""
    keys = _plant(redis_client, key_prefix)
    run = subprocess.run(
        _list_command(redis_url, key_prefix),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.rstrip("\n").split("\n")
    header = lines[0].split("\t")
    assert header[0] == "TASK"
    assert header[-1] == "KEY"
    rows = {line.split("\t")[0]: line.split("\t") for line in lines[1:]}
    assert len(rows) == len(LOCKS)
    assert all(len(cells) == len(header) for cells in rows.values()), run.stdout
    args_at = header.index("ARGS")
    long_task = "proj.billing.tasks.sync_every_account_of_the_tenant"
    assert rows[long_task][args_at] == "x" * 100
    assert rows["t.hostile"][args_at] == "(1,\\t2)\\n\\x1b[31mred"
    assert {task: cells[-1] for task, cells in rows.items()} == keys


def _column_of(line: str, value: str) -> int:
    return width(line[: line.index(value)])


def test_show_stats_and_purge_line_up_in_a_terminal(
    redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    """show's values start in one column, and no control character of a preview gets through;
    stats' values start in one column and its counts end in one; purge's rows line up under a
    header, and its waiting calls under theirs."""
    keys = _plant(redis_client, key_prefix)
    shown = _list_in_a_terminal(redis_url, key_prefix, "show", keys["t.hostile"])
    assert "\x1b" not in shown
    assert "\t" not in shown
    assert "(1,\\t2)\\n\\x1b[31mred" in shown
    lines = shown.rstrip("\n").split("\n")
    labels = [re.match(r"[a-z]+: +", line) for line in lines]
    assert all(labels), shown
    assert {len(label.group()) for label in labels if label} == {len("key:       ")}, shown

    totals = _list_in_a_terminal(redis_url, key_prefix, "stats")
    head, _, groups = totals.partition("by task:")
    starts = {_column_of(line, line.split(":", 1)[1].lstrip()) for line in head.splitlines()}
    assert len(starts) == 1, totals
    counted = [line for line in groups.splitlines() if line.startswith("  ")]
    assert len(counted) == len(LOCKS) + 1, totals  # every task, and the one worker
    ends = {len(line.split()[0]) + line.index(line.split()[0]) for line in counted}
    assert len(ends) == 1, totals

    redis_client.persist(keys["t.a"])  # no ttl: stale
    redis_client.persist(keys["t.hostile"])
    purged = _list_in_a_terminal(redis_url, key_prefix, "purge", "--dry-run", "--timeout", "0.1")
    assert "\x1b" not in purged
    assert "\t" not in purged
    lines = purged.rstrip("\n").split("\n")
    header = lines[0]
    assert header.startswith("REASON"), purged
    rows = [line for line in lines[1:] if line.startswith("no ttl")]
    assert len(rows) == 2, purged
    key_at = _column_of(header, "KEY")
    for task in ("t.a", "t.hostile"):
        row = next(line for line in rows if keys[task] in line)
        assert _column_of(row, keys[task]) == key_at, purged
    assert redis_client.exists(keys["t.a"], keys["t.hostile"]) == 2  # a dry run
