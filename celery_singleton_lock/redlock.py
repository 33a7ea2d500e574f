"""The documented import path of :class:`RedlockStore` (docs/redlock.md); it lives in
``core/redlock.py``."""

from __future__ import annotations

from .core.redlock import RedlockStore

__all__ = ["RedlockStore"]
