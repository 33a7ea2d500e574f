"""This process's id, without a system call per read.

``os.getpid()`` is a system call each time (glibc does not cache it). The lock's hot path
asks "am I still the process that made this?" several times per run, so the id is read
once at import and again in the child after every fork (``os.register_at_fork``, which
``os.fork``, multiprocessing, billiard and embedding servers all run; Python's own
``threading`` and ``random`` rely on the same hook).
"""

from __future__ import annotations

import os

__all__ = ["current_pid"]

_pid = os.getpid()


def current_pid() -> int:
    """``os.getpid()`` as of the last fork (or import)."""
    return _pid


def _after_fork_in_child() -> None:
    global _pid  # noqa: PLW0603 - the one value this module keeps
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)
