"""``celery -A proj singleton ...``: list, show, release and purge the locks; stats; the
publish-time markers, pending follow-ups and joiners beside them listed and counted, a marker
shown and deleted.

Registered through the ``celery.commands`` entry point. The Redis URL and the key prefix are
the app's (``singleton_redis_url``, ``singleton_key_prefix``) unless ``--url``/``--prefix``
say otherwise; the URL is only ever shown without its password. The Redis work is done by
:mod:`celery_singleton_lock.core.admin` and :mod:`celery_singleton_lock.core.markers`, the
text for people by :mod:`.shown`; this module is the click glue, the confirmations, the log
lines and the ``lock_force_released`` signal.
"""

from __future__ import annotations

import getpass
import json
import logging
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import click

from .. import signals
from ..core._pid import current_pid
from ..core.admin import (
    ForceStatus,
    LockInfo,
    check_lock_key,
    force_release,
    iter_locks,
    read_lock,
    stale_reason,
    stats,
)
from ..core.backend import REDIS_ERRORS, Client
from ..core.connection import client_for
from ..core.keys import keys_of
from ..core.markers import Marker, check_marker_key, iter_markers, read_marker, release_marker
from ..core.urls import redact_url, repr_without_password
from ..errors import SingletonConfigError
from ..settings.options import read_options
from .beat_cli import beat
from .columns import aligned, cell, tab_separated
from .shown import (
    COLUMNS,
    describe,
    describe_marker,
    json_object,
    marker_row,
    row,
    stats_lines,
    text,
)
from .waiting_calls import hand_on, orphaned_follow_ups, orphaned_queues, publish_pending

__all__ = ["singleton"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Target:
    """Where the command looks: the client, the URL (shown redacted) and the prefix."""

    __repr__ = repr_without_password

    redis_url: str
    prefix: str
    app: Any
    _client: Client | None = None

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = client_for(self.redis_url)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def fail(self, exc: Exception) -> NoReturn:
        raise click.ClickException(f"Redis at {redact_url(self.redis_url)}: {exc}") from None


def _setup_logging() -> None:
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


@click.group(name="singleton")
@click.option("--url", default=None, help="Redis URL of the locks (default: the app's).")
@click.option("--prefix", default=None, help="Key prefix of the locks (default: the app's).")
@click.pass_context
def singleton(ctx: click.Context, url: str | None, prefix: str | None) -> None:
    """List, show, release and purge celery_singleton_lock locks."""
    app = getattr(ctx.obj, "app", None)
    try:
        options = read_options(app.conf) if app is not None else None
    except SingletonConfigError as exc:
        raise click.ClickException(f"invalid setting: {exc}") from None
    if url is None:
        url = options.redis_url if options is not None else "redis://localhost:6379/0"
    if prefix is None:
        prefix = options.key_prefix if options is not None else "singleton:"
    _setup_logging()
    ctx.obj = target = _Target(redis_url=url, prefix=prefix, app=app)
    ctx.call_on_close(target.close)


def _read_all(target: _Target, read: Callable[[], Iterator[T]]) -> Iterator[T]:
    """What ``read()`` yields; Redis's errors and a bad setting as the command's error."""
    try:
        yield from read()
    except REDIS_ERRORS as exc:
        target.fail(exc)
    except SingletonConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _locks(target: _Target, task: str | None) -> Iterator[LockInfo]:
    scope = _scope_of(target, task)
    return _read_all(target, lambda: iter_locks(target.client, target.prefix, task, scope=scope))


def _markers(target: _Target, task: str | None) -> Iterator[Marker]:
    scope = _scope_of(target, task)
    return _read_all(target, lambda: iter_markers(target.client, target.prefix, task, scope=scope))


def _scope_of(target: _Target, task: str | None) -> str | None:
    """The ``singleton_scope`` of ``task`` in the app (its locks carry the scope's name, not
    the task's); None when it has none, or the app does not know it."""
    found = None if task is None or target.app is None else target.app.tasks.get(task)
    options = getattr(found, "singleton_options", None)
    return None if options is None else options().scope


@singleton.command(name="list")
@click.option("--task", default=None, help="Only the locks (and markers) of this task name.")
@click.option("--json", "as_json", is_flag=True, help="One JSON array of lock and marker objects.")
@click.pass_obj
def list_locks(target: _Target, task: str | None, as_json: bool) -> None:
    """Every lock: task, arguments, holder, worker, age, TTL, fencing token, last renewal;
    then every publish-time marker, pending follow-up and joiners (STATE queued, pending,
    joiners), each with its TTL.

    Aligned columns in a terminal, tab-separated when piped."""
    if as_json:  # streamed: a big database never sits in memory
        click.echo("[", nl=False)
        for count, item in enumerate(_items(target, task)):
            click.echo(("," if count else "") + "\n" + json.dumps(json_object(item)), nl=False)
        click.echo("\n]")
        return
    rows = (row(i) if isinstance(i, LockInfo) else marker_row(i) for i in _items(target, task))
    if sys.stdout.isatty():  # columns an operator reads, previews cut
        lines = aligned(COLUMNS, rows, preview=COLUMNS.index("ARGS"))
    else:  # piped: tab-separated, for cut -f and awk
        lines = tab_separated(COLUMNS, rows)
    for line in lines:
        click.echo(line)


def _items(target: _Target, task: str | None) -> Iterator[LockInfo | Marker]:
    yield from _locks(target, task)
    yield from _markers(target, task)


def _read(target: _Target, key: str) -> LockInfo | Marker:
    try:
        if _is_lock_key(key, target.prefix):
            info: LockInfo | Marker | None = read_lock(target.client, key, target.prefix)
        else:
            info = read_marker(target.client, key, target.prefix)
    except REDIS_ERRORS as exc:
        target.fail(exc)
    except ValueError as exc:  # a key of a marker's shape holding something else
        raise click.UsageError(str(exc)) from None
    if info is None:
        raise click.ClickException(
            f"no {'lock' if _is_lock_key(key, target.prefix) else 'marker'} at {key}"
        )
    return info


def _is_lock_key(key: str, prefix: str) -> bool:
    """Whether ``key`` is a lock key (else :func:`_lock_key` found a marker's)."""
    try:
        check_lock_key(key, prefix)
    except ValueError:
        return False
    return True


def _lock_key(ctx: click.Context, param: click.Parameter, key: str) -> str:
    """The KEY argument: a lock key or a publish-time marker's key under the prefix, else a
    usage error (exit code 2)."""
    target = ctx.find_object(_Target)
    assert target is not None  # the group's callback runs before a command's arguments
    try:
        check_lock_key(key, target.prefix)
    except ValueError as exc:
        try:
            check_marker_key(key, target.prefix)
        except ValueError:
            raise click.BadParameter(
                f"{exc}, nor a publish-time marker of this library (<lock key> with :queued "
                "for :lock)",
                ctx,
                param,
            ) from None
    return key


@singleton.command(name="show")
@click.argument("key", callback=_lock_key)
@click.option("--json", "as_json", is_flag=True, help="The lock or marker as a JSON object.")
@click.pass_obj
def show(target: _Target, key: str, as_json: bool) -> None:
    """One lock or publish-time marker, every field (exit code 1 when there is none, 2 when
    KEY is neither a lock key nor a marker's key under the prefix)."""
    info = _read(target, key)
    if as_json:
        click.echo(json.dumps(json_object(info), indent=2))
    else:
        click.echo(describe(info) if isinstance(info, LockInfo) else describe_marker(info))


def _operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "?"
    return f"{user}@{socket.gethostname()}:{current_pid()}"


def _force(target: _Target, info: LockInfo, reason: str) -> ForceStatus:
    """Compare-and-delete ``info``'s lock; log and signal what happened."""
    try:
        status = force_release(target.client, info)
    except REDIS_ERRORS as exc:
        target.fail(exc)
    if status is ForceStatus.RELEASED:
        logger.warning(
            "singleton: force-released key=%s task=%s owner=%s token=%s reason=%s by=%s",
            info.key,
            info.task,
            info.owner,
            info.token,
            reason,
            _operator(),
        )
        signals.lock_force_released.send(
            sender=None,
            key=info.key,
            task_id=info.owner,
            token=info.token,
            task=info.task,
            reason=reason,
        )
        if info.pending_follow_up is not None:
            keys = keys_of(info.key, info.permits or 1)
            publish_pending(target, keys, info.task, info.pending_follow_up, reason, info.owner)
        if info.queue_length:
            keys = keys_of(info.key, info.permits or 1)
            hand_on(target, keys, info.task, info.queue_length, reason, info.owner)
    elif status is ForceStatus.CHANGED:
        logger.warning(
            "singleton: force release skipped, the lock changed hands: key=%s owner=%s",
            info.key,
            info.owner,
        )
    return status


@singleton.command(name="release")
@click.argument("key", callback=_lock_key)
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.pass_obj
def release(target: _Target, key: str, yes: bool) -> None:
    """Force-release one lock, or delete one publish-time marker: the one shown, only if
    nobody took it over meanwhile.

    The running holder is not stopped: its next renewal finds the lock gone, its
    ``self.singleton.lost`` turns true and ``lock_lost`` is sent. A marker's call stays in the
    queue and still runs; the next ``delay()`` of its arguments publishes again. A KEY that is
    neither a lock key nor a marker's key under the prefix is refused unread (exit code 2).
    """
    info = _read(target, key)
    if isinstance(info, Marker):
        _unmark(target, info, yes)
        return
    click.echo(describe(info))
    if not yes:
        click.confirm("Force-release this lock? Its holder may still be running", abort=True)
    status = _force(target, info, "operator")
    if status is ForceStatus.RELEASED:
        click.echo(f"released {key}")
    elif status is ForceStatus.GONE:
        raise click.ClickException(f"no lock at {key} any more")
    else:
        raise click.ClickException(f"{key} changed hands since it was shown; left alone")


def _unmark(target: _Target, marker: Marker, yes: bool) -> None:
    """Delete the publish-time marker shown, only if it still names the same call."""
    click.echo(describe_marker(marker))
    if not yes:
        click.confirm(
            "Delete this marker? A delay() of these arguments then publishes again", abort=True
        )
    try:
        status = ForceStatus(release_marker(target.client, marker))
    except REDIS_ERRORS as exc:
        target.fail(exc)
    if status is ForceStatus.RELEASED:
        logger.warning(
            "singleton: queued marker deleted key=%s task=%s queued=%s by=%s",
            marker.key,
            marker.task,
            marker.call,
            _operator(),
        )
        click.echo(f"released {marker.key}")
    elif status is ForceStatus.GONE:
        raise click.ClickException(f"no marker at {marker.key} any more")
    else:
        raise click.ClickException(
            f"{marker.key} marks another call since it was shown; left alone"
        )


def _show_purged(locks: Sequence[Sequence[str]], waiting: Sequence[Sequence[str]]) -> None:
    """What purge found: aligned under headers in a terminal, tab-separated when piped (no
    header: each line starts with why it is purged)."""
    if not sys.stdout.isatty():
        for cells in (*locks, *waiting):
            click.echo("\t".join(cell(value) for value in cells))
        return
    if locks:
        for line in aligned(("REASON", *COLUMNS), locks, preview=1 + COLUMNS.index("ARGS")):
            click.echo(line)
    if waiting:
        for line in aligned(("WHAT", "CALLS", "TASK", "KEY"), waiting):
            click.echo(line)


def _live_hosts(target: _Target, timeout: float) -> set[str] | None:
    """Node names of the workers that answer a ping; None if none does (unknown)."""
    if target.app is None:
        return None
    replies = target.app.control.ping(timeout=timeout) or []
    hosts = {name for reply in replies for name in reply}
    if not hosts:
        click.echo("no worker answered the ping: no holder is taken for down", err=True)
        return None
    return hosts


@singleton.command(name="purge")
@click.option("--task", default=None, help="Only the locks of this task name.")
@click.option(
    "--all", "purge_all", is_flag=True, help="Every lock of --task, stale or not (asks first)."
)
@click.option("--dry-run", is_flag=True, help="Only show what would be released.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--timeout", default=2.0, show_default=True, help="Seconds to wait for pings.")
@click.pass_obj
def purge(
    target: _Target,
    *,
    task: str | None,
    purge_all: bool,
    dry_run: bool,
    yes: bool,
    timeout: float,
) -> None:
    """Release stale locks: without owner, without TTL, or held on a worker that is down.

    A worker is down when its node name does not answer ``celery inspect ping`` within
    ``--timeout``. With ``--all`` (which needs ``--task``) every lock of that task goes.
    """
    if purge_all and task is None:
        raise click.UsageError("--all needs --task NAME")
    hosts: list[set[str] | None] = []

    def live() -> set[str] | None:
        if not hosts:  # ping once, and only when a lock needs it
            hosts.append(_live_hosts(target, timeout))
        return hosts[0]

    chosen: list[tuple[LockInfo, str]] = []
    for info in _locks(target, task):
        reason = "all" if purge_all else stale_reason(info, live)
        if reason is not None:
            chosen.append((info, reason))
    orphans = [o for o in orphaned_follow_ups(target) if task is None or o.task == task]
    lines = [q for q in orphaned_queues(target) if task is None or q.task == task]
    _show_purged(
        [(reason, *row(info)) for info, reason in chosen],
        [("orphaned follow-up", text(o.follow_up), text(o.task), o.lock_key) for o in orphans]
        + [("orphaned queue", f"{q.length} calls", text(q.task), q.lock_key) for q in lines],
    )
    if not chosen and not orphans and not lines:
        click.echo("nothing to purge")
        return
    if dry_run:
        queues = f", {len(lines)} orphaned queue(s) handed on" if lines else ""
        click.echo(
            f"{len(chosen)} lock(s) would be released, {len(orphans)} orphaned follow-up(s) "
            f"published{queues} (dry run)"
        )
        return
    if not yes:
        queues = f", hand on {len(lines)} queue(s)" if lines else ""
        click.confirm(
            f"Force-release these {len(chosen)} lock(s), publish {len(orphans)} "
            f"follow-up(s){queues}?",
            abort=True,
        )
    released = sum(_force(target, info, reason) is ForceStatus.RELEASED for info, reason in chosen)
    click.echo(f"released {released} of {len(chosen)} lock(s)")
    if orphans:
        published = sum(
            publish_pending(target, keys_of(o.lock_key, o.permits), o.task, o.follow_up, "purge")
            for o in orphans
        )
        click.echo(f"published {published} of {len(orphans)} orphaned follow-up(s)")
    for line in lines:  # each says where its calls went, or that they stay
        hand_on(target, keys_of(line.lock_key, line.permits), line.task, line.length, "purge")


@singleton.command(name="stats")
@click.option("--task", default=None, help="Only the locks (and markers) of this task name.")
@click.option("--json", "as_json", is_flag=True, help="The totals as a JSON object.")
@click.pass_obj
def show_stats(target: _Target, task: str | None, as_json: bool) -> None:
    """How many locks, by task, by worker and by state; the oldest, the longest since a
    running lock's renewal; the publish-time markers, pending follow-ups and joiners."""
    totals = stats(_locks(target, task), _markers(target, task))
    data = {"redis": redact_url(target.redis_url), "prefix": target.prefix, **totals.as_dict()}
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for line in stats_lines(data["redis"], target.prefix, totals):
        click.echo(line)


singleton.add_command(beat)
