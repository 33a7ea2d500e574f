"""The composition matrix, declared once: the library's duplicate policies, its modifiers and
the events a waiting call can meet, crossed two by two (policies x modifiers, policies x events,
modifiers x events), each cell allowed (with the outcome every call of its scenario must end
in) or refused at worker start (with the settings its one line names).

Read by the matrix's task app (tests/support/matrix_app.py: one task per configuration), its
scenarios and checks (tests/support/matrix_run.py, tests/integration/test_matrix*.py), and the
unit test that holds docs/compatibility.md's tables to it (tests/unit/test_matrix_docs.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

__test__ = False

POLICIES = ("skip", "retry", "raise", "coalesce", "join", "queue", "cancel")
MODIFIERS = ("permits", "rate", "debounce", "window", "publish")
EVENTS = ("revoke", "expires", "kill", "redelivered", "refused_retry")

#: the three tables, each (name, its rows, its columns)
TABLES = (
    ("PxM", POLICIES, MODIFIERS),
    ("PxE", POLICIES, EVENTS),
    ("MxE", MODIFIERS, EVENTS),
)

# -- the settings every matrix task shares, and each modifier's ------------------------------

#: lock ttl (s): a joined call's watch copy comes due one ttl after it joined
TTL = 2.0
#: seconds between a requeued duplicate's tries (``singleton_retry_countdown``)
RETRY_COUNTDOWN = 0.25
RATE = "1/s"
RATE_PERIOD_S = 1.0
DEBOUNCE_S = 1.5
WINDOW_S = 2.0
#: a waiting call's ``expires`` (s after it was sent); the debounce row's is shorter than the
#: debounce, so that it passes while the call waits in its debounce
EXPIRES_S = 2.5
DEBOUNCE_EXPIRES_S = 0.8
#: a waiting call's countdown in the redelivery cells: the broker (visibility_timeout 1 s,
#: swept every second) hands its message out again before it is due
REDELIVERED_COUNTDOWN_S = 5.0
#: the countdown of a queued call that publish-time dedup's marker stands for, revoked or
#: expiring (``QUEUED_EXPIRES_S``) before it is due
QUEUED_COUNTDOWN_S = 2.0
QUEUED_EXPIRES_S = 1.0

#: each modifier's task options
MODIFIER_OPTIONS: Mapping[str, Mapping[str, Any]] = {
    "permits": {"singleton_permits": 2},
    "rate": {"singleton_rate_limit": RATE},
    "debounce": {"singleton_debounce": DEBOUNCE_S},
    "window": {"singleton_lock_at_least": WINDOW_S},
    "publish": {"singleton_lock_on": "publish"},
}

#: the setting each row or column is, as a refusal line names it
SETTING_OF = {
    **dict.fromkeys(POLICIES, "singleton_on_duplicate"),
    "permits": "singleton_permits",
    "rate": "singleton_rate_limit",
    "debounce": "singleton_debounce",
    "window": "singleton_lock_at_least",
    "publish": "singleton_lock_on",
}

#: how docs/compatibility.md names each row and column
LABELS = {
    "skip": '`"skip"`',
    "retry": '`"retry"`',
    "raise": '`"raise"`',
    "coalesce": '`"coalesce"`',
    "join": '`"join"`',
    "queue": '`"queue"`',
    "cancel": '`"cancel"`',
    "permits": "`singleton_permits=2`",
    "rate": "`singleton_rate_limit`",
    "debounce": "`singleton_debounce`",
    "window": "`singleton_lock_at_least`",
    "publish": '`singleton_lock_on="publish"`',
    "revoke": "`revoke()`",
    "expires": "`expires` passes",
    "kill": "holder's child killed",
    "redelivered": "copy redelivered",
    "refused_retry": "holder's retry refused",
}

# -- how a call may end -------------------------------------------------------------------------

RAN = "ran"  #: SUCCESS with the value of its own run; ran once; its link called once
JOINED = "joined"  #: SUCCESS with the value of the run it joined; never ran; link called once
JOINED_FAILURE = "joined failure"  #: FAILURE with the exception of the run it joined; never ran
SKIPPED = "skipped"  #: SUCCESS, the skip marker (no follow-up); never ran; no link
SUPERSEDED = "superseded"  #: SUCCESS, the skip marker of a debounced call a later one superseded
#: SUCCESS, the skip marker naming a call sent after it (``"cancel"``: that newer call took
#: its place in line); never ran; no link
OVERTAKEN = "overtaken"
COALESCED = "coalesced"  #: SUCCESS, the skip marker naming a follow-up, which ends as "F" says
DUPLICATE_ERROR = "DuplicateTaskError"  #: FAILURE with DuplicateTaskError; never ran
RATE_ERROR = "RateLimitedError"  #: FAILURE with RateLimitedError; never ran
REVOKED = "revoked"  #: REVOKED; never ran; no link
LOST = "lost"  #: FAILURE with WorkerLostError: its pool child was killed while it ran
#: REVOKED by its own body's ``self.singleton.end_cancelled()``, naming a call sent after it
#: (``"cancel"``: asked to stop, it stopped); ran once; no link
CANCELLED = "cancelled"
REFUSED = "refused"  #: FAILURE with MaxRetriesExceededError: it ran, and Celery refused its retry
NOT_PUBLISHED = "not published"  #: publish-time dedup: ``apply_async`` returned the holder's result
RAISED_AT_PUBLISH = "raised at publish"  #: ``apply_async`` raised DuplicateTaskError

OUTCOMES = (
    RAN,
    JOINED,
    JOINED_FAILURE,
    SKIPPED,
    SUPERSEDED,
    OVERTAKEN,
    COALESCED,
    DUPLICATE_ERROR,
    RATE_ERROR,
    REVOKED,
    LOST,
    CANCELLED,
    REFUSED,
    NOT_PUBLISHED,
    RAISED_AT_PUBLISH,
)


@dataclass(frozen=True)
class Cell:
    """One cell: a policy with a modifier, a policy meeting an event, or a modifier (under the
    policy :attr:`policy`) meeting an event.

    ``expect`` maps each role of the scenario (``H`` the holder, ``H1``/``H2`` with two
    permits, ``D``/``D1``/``D2`` duplicates, ``F`` the follow-up a coalesced duplicate names,
    ``N`` a new call after the event, ``W`` a call that waited before a newer one came,
    ``Q`` a queued call a newer one replaced at publish) to the outcomes it may end in; more
    than one where the machine's timing decides which path a call takes (a rate or a window
    met, or not yet), each checked on the path the call took. ``order``: roles whose runs must
    start in that order (``"queue"``: the order they reached the key).
    """

    table: str
    row: str
    col: str
    policy: str
    doc: str
    expect: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: refused at worker start: the settings its one line must name
    refused: tuple[str, ...] = ()
    #: a defect of the library this cell shows (pytest.mark.xfail(strict=True, reason=...))
    known_failure: str | None = None
    order: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.table}-{self.row}-{self.col}"

    @property
    def modifier(self) -> str | None:
        return self.col if self.table == "PxM" else self.row if self.table == "MxE" else None

    @property
    def event(self) -> str | None:
        return None if self.table == "PxM" else self.col

    @property
    def allowed(self) -> bool:
        return not self.refused

    @property
    def task(self) -> str:
        """The name of the task of this cell's configuration (tests/support/matrix_app.py)."""
        return task_name(self.policy, self.modifier)

    def options(self) -> dict[str, Any]:
        """The task options of this cell's configuration."""
        return task_options(self.policy, self.modifier)


def task_name(policy: str, modifier: str | None) -> str:
    return f"m.{policy}" if modifier is None else f"m.{policy}.{modifier}"


def task_options(policy: str, modifier: str | None) -> dict[str, Any]:
    options: dict[str, Any] = {"singleton_on_duplicate": policy}
    if modifier is not None:
        options.update(MODIFIER_OPTIONS[modifier])
    return options


def _e(**roles: str | tuple[str, ...]) -> dict[str, frozenset[str]]:
    return {
        role: frozenset((kinds,) if isinstance(kinds, str) else kinds)
        for role, kinds in roles.items()
    }


# -- policies x modifiers --------------------------------------------------------------------

_REFUSED_WHY = {
    ("coalesce", "window"): (
        "refused: a burst met in the window would run twice after it, not as one follow-up"
    ),
    ("coalesce", "publish"): "refused: a duplicate is coalesced on the worker, where it runs",
    ("join", "permits"): "refused: a duplicate joins the one run holding its key; here two may",
    ("join", "window"): "refused: a call met in the window has no run left to join",
    ("queue", "rate"): "refused: a call handed the key over the rate would wait out of line",
    ("queue", "window"): (
        "refused: each release hands the key to the next call; a window would hold it with no run"
    ),
    ("queue", "publish"): "refused: every call must reach a worker to take its place in line",
    ("cancel", "permits"): (
        "refused: a newer call asks the one run holding its key to stop; here two may"
    ),
    ("cancel", "rate"): (
        "refused: the newer call handed the key over the rate would wait out of line"
    ),
    ("cancel", "window"): (
        "refused: the newer call runs at the holder's release; a window would hold it with no run"
    ),
}

_PXM: dict[tuple[str, str], tuple[str, dict[str, frozenset[str]]]] = {
    ("skip", "permits"): ("works", _e(H1=RAN, H2=RAN, D=SKIPPED)),
    ("retry", "permits"): ("works", _e(H1=RAN, H2=RAN, D=RAN)),
    ("raise", "permits"): ("works", _e(H1=RAN, H2=RAN, D=DUPLICATE_ERROR)),
    ("coalesce", "permits"): (
        "works: one follow-up per key, not one per permit",
        _e(H1=RAN, H2=RAN, D=COALESCED, F=RAN),
    ),
    ("skip", "rate"): (
        "works: a call over the rate is skipped too, its marker saying when",
        _e(H=RAN, D1=SKIPPED, D2=(SKIPPED, RAN)),
    ),
    ("retry", "rate"): ("works", _e(H=RAN, D1=RAN, D2=RAN)),
    ("raise", "rate"): (
        "works: over the rate, `RateLimitedError`",
        _e(H=RAN, D1=DUPLICATE_ERROR, D2=(RATE_ERROR, RAN)),
    ),
    # the follow-up, requeued to the next allowed start, and D2 (over the rate after the
    # holder's end: the key's next follow-up) both come due then; the one that takes the key
    # runs, and a follow-up that meets D2's run ends a skip naming it (never coalesced again)
    ("coalesce", "rate"): (
        "works: the first call over the rate is the follow-up",
        _e(H=RAN, D1=COALESCED, D2=(RAN, COALESCED), F=(RAN, OVERTAKEN)),
    ),
    ("join", "rate"): (
        "works: a call over the rate has no run to join, and waits as under retry",
        _e(H=RAN, D1=JOINED, D2=RAN),
    ),
    ("skip", "debounce"): (
        "works: the burst's last call meets the policy when it comes due",
        _e(H=RAN, D1=SUPERSEDED, D2=SKIPPED),
    ),
    ("retry", "debounce"): ("works", _e(H=RAN, D1=SUPERSEDED, D2=RAN)),
    ("raise", "debounce"): ("works", _e(H=RAN, D1=SUPERSEDED, D2=DUPLICATE_ERROR)),
    ("coalesce", "debounce"): (
        "works: the follow-up is not debounced again",
        _e(H=RAN, D1=SUPERSEDED, D2=COALESCED, F=RAN),
    ),
    ("join", "debounce"): ("works", _e(H=RAN, D1=SUPERSEDED, D2=JOINED)),
    ("skip", "window"): (
        "works: a call in the window is skipped, naming the finished run",
        _e(H=RAN, D1=SKIPPED, D2=(SKIPPED, RAN)),
    ),
    ("retry", "window"): (
        "works: a call in the window waits for its end",
        _e(H=RAN, D1=RAN, D2=RAN),
    ),
    ("raise", "window"): ("works", _e(H=RAN, D1=DUPLICATE_ERROR, D2=(DUPLICATE_ERROR, RAN))),
    ("skip", "publish"): (
        "works: `delay()` returns the holder's result",
        _e(H=RAN, D=NOT_PUBLISHED),
    ),
    ("retry", "publish"): (
        "works: `delay()` returns the holder's result",
        _e(H=RAN, D=NOT_PUBLISHED),
    ),
    ("raise", "publish"): (
        "works: `delay()` raises `DuplicateTaskError`",
        _e(H=RAN, D=RAISED_AT_PUBLISH),
    ),
    ("join", "publish"): (
        "works: a call with a `link` is published and joins; a plain one returns the holder's "
        "result",
        _e(H=RAN, D=JOINED, D2=NOT_PUBLISHED),
    ),
    ("queue", "permits"): (
        "works: the waiting calls run in the order they came, as slots free",
        _e(H1=RAN, H2=RAN, D1=RAN, D2=RAN),
    ),
    ("queue", "debounce"): (
        "works: the burst's last call takes its place in line when it comes due",
        _e(H=RAN, D1=SUPERSEDED, D2=RAN),
    ),
    ("cancel", "debounce"): (
        "works: the burst's last call asks the holder to stop when it comes due",
        _e(H=CANCELLED, D1=SUPERSEDED, D2=RAN),
    ),
    ("cancel", "publish"): (
        "works: a newer call replaces a queued one, which is revoked; one sent while a run "
        "holds the key is published and asks it to stop",
        _e(Q=REVOKED, H=CANCELLED, D=RAN),
    ),
}

# -- policies x events (no modifier) -------------------------------------------------------

_PXE: dict[tuple[str, str], tuple[str, dict[str, frozenset[str]]]] = {
    ("skip", "revoke"): (
        "works: the duplicate ended at once; a later revoke changes nothing",
        _e(H=RAN, D=SKIPPED),
    ),
    ("retry", "revoke"): ("works: the waiting duplicate ends `REVOKED`", _e(H=RAN, D=REVOKED)),
    ("raise", "revoke"): (
        "works: the duplicate ended at once; a later revoke changes nothing",
        _e(H=RAN, D=DUPLICATE_ERROR),
    ),
    ("coalesce", "revoke"): (
        "works: a revoked follow-up ends `REVOKED` when it is published",
        _e(H=RAN, D=COALESCED, F=REVOKED),
    ),
    ("join", "revoke"): (
        "works: the revoked call stays `REVOKED`, its `link` not called",
        _e(H=RAN, D=REVOKED),
    ),
    ("skip", "expires"): (
        "works: the duplicate ended before its `expires`",
        _e(H=RAN, D=SKIPPED),
    ),
    ("retry", "expires"): (
        "works: the waiting duplicate ends `REVOKED` (expired)",
        _e(H=RAN, D=REVOKED),
    ),
    ("raise", "expires"): (
        "works: the duplicate ended before its `expires`",
        _e(H=RAN, D=DUPLICATE_ERROR),
    ),
    ("coalesce", "expires"): (
        "works: the follow-up does not carry the duplicate's `expires`, and runs",
        _e(H=RAN, D=COALESCED, F=RAN),
    ),
    ("join", "expires"): (
        "works: the joined call ends `REVOKED` (expired)",
        _e(H=RAN, D=REVOKED),
    ),
    ("skip", "kill"): ("works", _e(H=LOST, D=SKIPPED)),
    ("retry", "kill"): ("works: the duplicate runs at once", _e(H=LOST, D=RAN)),
    ("raise", "kill"): ("works", _e(H=LOST, D=DUPLICATE_ERROR)),
    ("coalesce", "kill"): (
        "works: the worker publishes the follow-up at once",
        _e(H=LOST, D=COALESCED, F=RAN),
    ),
    ("join", "kill"): (
        "works: the joined call runs in the holder's place, within a ttl",
        _e(H=LOST, D=RAN),
    ),
    ("skip", "redelivered"): ("works", _e(H=RAN, D=SKIPPED)),
    ("retry", "redelivered"): ("works: the duplicate runs once", _e(H=RAN, D=RAN)),
    ("raise", "redelivered"): ("works", _e(H=RAN, D=DUPLICATE_ERROR)),
    ("coalesce", "redelivered"): (
        "works: the copies are dropped, one follow-up runs",
        _e(H=RAN, D=COALESCED, F=RAN),
    ),
    ("join", "redelivered"): (
        "works: a copy that comes as the holder ends is dropped; the call ends once",
        _e(H=RAN, D=JOINED, X=JOINED),
    ),
    ("skip", "refused_retry"): ("works", _e(H=REFUSED, D=SKIPPED)),
    ("retry", "refused_retry"): ("works: the duplicate runs at once", _e(H=REFUSED, D=RAN)),
    ("raise", "refused_retry"): ("works", _e(H=REFUSED, D=DUPLICATE_ERROR)),
    ("coalesce", "refused_retry"): (
        "works: the follow-up is published at once",
        _e(H=REFUSED, D=COALESCED, F=RAN),
    ),
    ("join", "refused_retry"): (
        "works: the joined call fails with the holder's error",
        _e(H=REFUSED, D=JOINED_FAILURE),
    ),
    # "queue": a second call waits behind the one that meets the event (not behind a copy)
    ("queue", "revoke"): (
        "works: the revoked call is passed over at its turn; the call behind it runs",
        _e(H=RAN, D=REVOKED, D2=RAN),
    ),
    ("queue", "expires"): (
        "works: the expired call is passed over at its turn, `REVOKED`; the call behind it runs",
        _e(H=RAN, D=REVOKED, D2=RAN),
    ),
    ("queue", "kill"): (
        "works: the worker hands the key on; the waiting calls run in order",
        _e(H=LOST, D=RAN, D2=RAN),
    ),
    ("queue", "redelivered"): (
        "works: a copy is not queued twice, nor run once the call ran; the call runs once",
        _e(H=RAN, D=RAN),
    ),
    ("queue", "refused_retry"): (
        "works: the failed run's release hands the key on; the waiting calls run in order",
        _e(H=REFUSED, D=RAN, D2=RAN),
    ),
    # "cancel": an older call waits first, and makes way for the one that meets the event; the
    # holder's body ends cancelled once asked, unless it fails first or is killed
    ("cancel", "revoke"): (
        "works: the revoked call's stop request is withdrawn, the holder ends as it would have; "
        "the revoked call is passed over",
        _e(H=RAN, W=OVERTAKEN, D=REVOKED),
    ),
    ("cancel", "expires"): (
        "works: the holder, asked already, ends cancelled; the expired call is passed over, "
        "`REVOKED`",
        _e(H=CANCELLED, W=OVERTAKEN, D=REVOKED),
    ),
    ("cancel", "kill"): (
        "works: the newest call runs in the holder's place",
        _e(H=LOST, W=OVERTAKEN, D=RAN),
    ),
    ("cancel", "redelivered"): (
        "works: each copy asks again, one after the run is dropped; the call runs once",
        _e(H=CANCELLED, W=OVERTAKEN, D=RAN),
    ),
    ("cancel", "refused_retry"): (
        "works: the newest call runs after the failed holder",
        _e(H=REFUSED, W=OVERTAKEN, D=RAN),
    ),
}

#: the roles whose runs must start in the order given (a cell's ``order``)
_ORDER: dict[str, tuple[str, ...]] = {
    "PxM-queue-permits": ("D1", "D2"),
    "PxE-queue-kill": ("D", "D2"),
    "PxE-queue-refused_retry": ("D", "D2"),
}

# -- modifiers x events (under "retry": the policy that leaves a call waiting) ------------

#: the policy each modifier row runs under
MXE_POLICY = dict.fromkeys(MODIFIERS, "retry")

_WAITING = {
    "revoke": ("works: the waiting call ends `REVOKED`", REVOKED),
    "expires": ("works: the waiting call ends `REVOKED` (expired)", REVOKED),
    "kill": ("works: the waiting call runs", RAN),
    "redelivered": ("works: the waiting call runs once", RAN),
    "refused_retry": ("works: the waiting call runs", RAN),
}

_MXE: dict[tuple[str, str], tuple[str, dict[str, frozenset[str]]]] = {}
for _event, (_doc, _kind) in _WAITING.items():
    _lost = LOST if _event == "kill" else REFUSED if _event == "refused_retry" else RAN
    _MXE[("permits", _event)] = (_doc, _e(H1=_lost, H2=RAN, D=_kind))
    for _modifier in ("rate", "debounce", "window"):
        _MXE[(_modifier, _event)] = (_doc, _e(H=_lost, D=_kind))
_MXE[("debounce", "revoke")] = (
    "works: a call revoked while it waits in its debounce ends `REVOKED`",
    _e(H=RAN, D=REVOKED),
)
_MXE[("debounce", "expires")] = (
    "works: a call that expires while it waits in its debounce ends `REVOKED`",
    _e(H=RAN, D=REVOKED),
)
_MXE[("debounce", "redelivered")] = (
    "works: each copy is told the same; the call runs once",
    _e(H=RAN, D=RAN),
)
_MXE[("window", "kill")] = (
    "works: the window outlives the killed run; the waiting call runs at its end",
    _e(H=LOST, D=RAN),
)
_MXE[("window", "refused_retry")] = (
    "works: the waiting call runs at the window's end",
    _e(H=REFUSED, D=RAN),
)
# publish-time dedup leaves no duplicate waiting: its waiting call is the queued holder
_MXE[("publish", "revoke")] = (
    "works: a revoked queued call frees the key at once; the next call is published",
    _e(H=REVOKED, D=NOT_PUBLISHED, N=RAN),
)
_MXE[("publish", "expires")] = (
    "works: the queued marker ends with its call's `expires`",
    _e(H=REVOKED, D=NOT_PUBLISHED, N=RAN),
)
_MXE[("publish", "kill")] = (
    "works: the deduplicated call gets the holder's `FAILURE`",
    _e(H=LOST, D=NOT_PUBLISHED, N=RAN),
)
_MXE[("publish", "redelivered")] = (
    "works: the queued call runs once",
    _e(H=RAN, D=NOT_PUBLISHED),
)
_MXE[("publish", "refused_retry")] = (
    "works: the deduplicated call gets the holder's `FAILURE`",
    _e(H=REFUSED, D=NOT_PUBLISHED, N=RAN),
)


#: the cells that show a defect of the library, and which
KNOWN_FAILURES: dict[str, str] = {}


def _cells() -> tuple[Cell, ...]:
    cells = []
    for policy in POLICIES:
        for modifier in MODIFIERS:
            why = _REFUSED_WHY.get((policy, modifier))
            if why is not None:
                refused = (SETTING_OF[policy], SETTING_OF[modifier])
                cells.append(Cell("PxM", policy, modifier, policy, why, refused=refused))
            else:
                doc, expect = _PXM[(policy, modifier)]
                cells.append(Cell("PxM", policy, modifier, policy, doc, expect))
    for policy in POLICIES:
        for event in EVENTS:
            doc, expect = _PXE[(policy, event)]
            cells.append(Cell("PxE", policy, event, policy, doc, expect))
    for modifier in MODIFIERS:
        for event in EVENTS:
            doc, expect = _MXE[(modifier, event)]
            cells.append(Cell("MxE", modifier, event, MXE_POLICY[modifier], doc, expect))
    return tuple(
        replace(cell, known_failure=KNOWN_FAILURES.get(cell.id), order=_ORDER.get(cell.id, ()))
        for cell in cells
    )


#: every cell, in table order
CELLS = _cells()
BY_ID = {cell.id: cell for cell in CELLS}


def cells_of(*, table: str | None = None, event: str | None = None) -> list[Cell]:
    """The allowed cells of ``table`` or of the column ``event`` (in P x E and M x E)."""
    return [
        cell
        for cell in CELLS
        if cell.allowed
        and (table is None or cell.table == table)
        and (event is None or cell.event == event)
    ]


def refused_cells() -> list[Cell]:
    return [cell for cell in CELLS if not cell.allowed]


def configurations() -> dict[str, dict[str, Any]]:
    """Every allowed configuration's task name and options (several cells share one)."""
    return {cell.task: cell.options() for cell in CELLS if cell.allowed}
