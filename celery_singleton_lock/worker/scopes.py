"""Scopes (``singleton_scope``): the check that tasks sharing one lock can share it, made at
worker start (worker/hooks.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from ..duplicates.rate import rate_text
from ..errors import SingletonConfigError
from ..settings.table import permits_text

if TYPE_CHECKING:
    from ..task.singleton_task import SingletonTask

__all__ = ["check_scopes"]


def check_scopes(tasks: Iterable[SingletonTask]) -> None:
    """Raise :class:`SingletonConfigError` unless the tasks sharing a scope all key on the same
    argument names (or all on a ``singleton_key`` callable), take the same number of permits
    and the same rate limit, and all use a policy that owes its waiting calls (coalesce, join)
    or none does; and no scope has the name of a task outside any scope (its keys would be that
    task's); checked at worker start."""
    scopes: dict[str, dict[str, SingletonTask]] = {}
    unscoped: set[str] = set()
    for task in tasks:
        scope = task.singleton_options().scope
        if scope is not None:
            scopes.setdefault(scope, {})[task.name] = task
        else:
            unscoped.add(task.name)
    for scope, members in sorted(scopes.items()):
        if scope in unscoped:  # its keys are that task's: they would exclude each other
            raise SingletonConfigError(
                f"scope {scope!r} is the name of task {scope}, whose locks it would share: "
                "give the scope another name"
            )
        names = {name: task._singleton_scope_names() for name, task in members.items()}
        if len(set(names.values())) > 1:
            keyed = "; ".join(
                f"{name} on {'a key callable' if keys is None else ', '.join(keys)}"
                for name, keys in sorted(names.items())
            )
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must key on the same argument names: {keyed}"
            )
        permits = {n: permits_text(t.singleton_options().permits) for n, t in members.items()}
        if len(set(permits.values())) > 1:  # 1 permit locks the key itself, N its N slots
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must take the same singleton_permits, or they "
                f"never exclude each other: {_listed(permits)}"
            )
        rates = {name: task.singleton_options().rate_limit for name, task in members.items()}
        if len(set(rates.values())) > 1:  # one rate record for the scope's key: one limit
            shown = {name: rate and rate_text(rate) for name, rate in rates.items()}
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must take the same singleton_rate_limit (they "
                f"count their starts together): {_listed(shown)}"
            )
        policies = {name: task._singleton_parts().policy for name, task in members.items()}
        owing = {p.name for p in policies.values() if p.owes_waiting_calls}
        if owing and len({p.name for p in policies.values()}) > 1:
            raise SingletonConfigError(
                f"the tasks of scope {scope!r} must all use singleton_on_duplicate "
                f"{' or '.join(repr(n) for n in sorted(owing))} or none of them (only a run of "
                "that policy serves the calls waiting beside the key: a follow-up, joiners): "
                f"{_listed({n: p.name for n, p in policies.items()})}"
            )


def _listed(values: Mapping[str, object]) -> str:
    return "; ".join(f"{name} {value}" for name, value in sorted(values.items()))
