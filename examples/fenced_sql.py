"""Fenced writes to a SQL table: a run that lost its lock cannot overwrite a newer run's data.

A lock can be lost while its task still runs (a long pause, a partition, a Redis restart
without persistence): another run then takes the lock and writes, and the old run, when it
resumes, would overwrite that write with stale data. The fencing token makes the table refuse
it: every acquire of a lock key gets a token larger than every earlier one, the row keeps the
token of the write that produced it, and an update only lands when its token is larger::

    UPDATE accounts SET balance = ?, fence_token = ?
     WHERE id = ? AND fence_token < ?

"0 rows updated" means a run with a newer (or the same) token has written already: drop the
result. The same guard works in PostgreSQL or MySQL (an UPDATE re-checks its WHERE clause on
the row it locked); the helpers below use the standard library's sqlite3 so the example runs
anywhere. The column must hold 64-bit integers: tokens are about 1.7 x 10^15.

In a task::

    from celery_singleton_lock import SingletonTask
    from examples.fenced_sql import fenced_update

    @app.task(bind=True, base=SingletonTask, singleton_key_args=("account_id",))
    def sync_account(self, account_id):
        balance = compute_balance(account_id)  # slow: the lock may be lost meanwhile
        if not fenced_update(db, account_id, balance, self.singleton.fencing_token):
            logger.warning("account %s: a newer run wrote first, result dropped", account_id)

Each token is written once per row: a second write of the same row by the same run carries the
same token and is refused too (as :func:`celery_singleton_lock.fenced_set` refuses it). A run
that updates one row several times should compare with ``<=`` instead of ``<`` (a token is
never issued twice, so an equal token is always the same run).
"""

from __future__ import annotations

import sqlite3

__all__ = ["SCHEMA", "create_schema", "fenced_update", "fenced_upsert", "read_account"]

#: The example table: the data, plus the token of the run that wrote it (0: never fenced).
SCHEMA = """
CREATE TABLE IF NOT EXISTS accounts (
    id          INTEGER PRIMARY KEY,
    balance     INTEGER NOT NULL,
    fence_token INTEGER NOT NULL DEFAULT 0
)
"""

_UPDATE = "UPDATE accounts SET balance = ?, fence_token = ? WHERE id = ? AND fence_token < ?"

_UPSERT = """
INSERT INTO accounts (id, balance, fence_token) VALUES (?, ?, ?)
ON CONFLICT (id) DO UPDATE
   SET balance = excluded.balance, fence_token = excluded.fence_token
 WHERE excluded.fence_token > accounts.fence_token
"""


def create_schema(conn: sqlite3.Connection) -> None:
    """Create the ``accounts`` table if it does not exist."""
    with conn:
        conn.execute(SCHEMA)


def _check_token(token: object) -> int:
    if isinstance(token, bool) or not isinstance(token, int) or token <= 0:
        raise ValueError(
            f"token must be a positive int (self.singleton.fencing_token), got {token!r}"
        )
    return token


def fenced_update(conn: sqlite3.Connection, account_id: int, balance: int, token: int) -> bool:
    """Set the balance of an existing account unless a write with a token >= ``token`` landed.

    Commits. Returns True if the row was written, False if it was refused (or is missing).
    """
    _check_token(token)
    with conn:
        cursor = conn.execute(_UPDATE, (balance, token, account_id, token))
    return cursor.rowcount == 1


def fenced_upsert(conn: sqlite3.Connection, account_id: int, balance: int, token: int) -> bool:
    """Like :func:`fenced_update`, but creates the row when it does not exist yet."""
    _check_token(token)
    with conn:
        cursor = conn.execute(_UPSERT, (account_id, balance, token))
    return cursor.rowcount == 1


def read_account(conn: sqlite3.Connection, account_id: int) -> tuple[int, int] | None:
    """``(balance, fence_token)`` of an account, or None if it does not exist."""
    row = conn.execute(
        "SELECT balance, fence_token FROM accounts WHERE id = ?", (account_id,)
    ).fetchone()
    return None if row is None else (int(row[0]), int(row[1]))
