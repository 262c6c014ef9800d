"""Every advisory-lock key, named in one place.

Keys are 64-bit: the first eight bytes of md5("<namespace>:<id>") as a signed integer. The same
key can be computed in Python (`key`) and inside a statement (`sql_key`), which the claim and the
reaper need because they try-lock a row they have only just found. 64 bits make false contention
between unrelated ids negligible, where the reference's 32-bit hashtext does not.

Namespaces:

* ``execution``: one job execution. Enqueue, reconcile, complete and put-back take it blocking;
  claim and the reaper only ever try-lock it, on a single candidate at a time.
* ``workspace``: demand allocation and idle-runner binding for one workspace.
* ``assignment``: one (provisioner, reservation) pair; several are taken in sorted key order.
* ``migrations``: the migration runner, as a session lock on a dedicated connection.
* ``leader``: replica leadership for maintenance, as a session lock on a dedicated connection
  (`LeaderLock`, below; actors/maintenance/leadership.py decides what to do with it).
* ``admin_command``: one (admin key, Idempotency-Key) pair, around an idempotent create.
* ``ephemeral_mint``: one (workspace, provisioner, provider runner id) triple, while a mint
  checks that the runner has no active ephemeral registration token; several are taken in
  sorted key order, in one statement, after every other lock of the mint (store/ephemeral.py).
* ``workspace_demand``: one workspace's row of `workspace_demand` (sql/0022, sql/0030). Every
  insert into pending_jobs takes it *shared* (its trigger, at the end of the statement, before
  it adds or lowers the row) and holds it to commit; `store/demand_list.py`'s prune only
  try-locks it exclusive, so it never deletes the row, nor raises its bound, under a pending row
  not committed yet, and never waits.
"""

from __future__ import annotations

import hashlib
from uuid import UUID

from controlplane.store.dedicated import Dedicated
from controlplane.store.pool import PoolSettings

EXECUTION = "cp_job_execution"
WORKSPACE = "cp_workspace"
ASSIGNMENT = "cp_assignment"
MIGRATIONS = "cp_migrations"
LEADER = "cp_leader"
ADMIN_COMMAND = "cp_admin_command"
EPHEMERAL_MINT = "cp_ephemeral_mint"
WORKSPACE_DEMAND = "cp_workspace_demand"  # spelled out in sql/0022 and sql/0030 too


def key(namespace: str, *parts: UUID | str) -> int:
    text = ":".join([namespace, *(str(part) for part in parts)])
    digest = hashlib.md5(text.encode(), usedforsecurity=False).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def sql_key(namespace: str, column: str) -> str:
    """The SQL expression computing `key(namespace, <column>)` for a uuid or text column."""
    if not namespace.isidentifier():
        raise ValueError(f"bad lock namespace {namespace!r}")
    return f"('x' || left(md5('{namespace}:' || {column}::text), 16))::bit(64)::bigint"


def execution(job_execution_id: UUID) -> int:
    return key(EXECUTION, job_execution_id)


def workspace(workspace_id: UUID) -> int:
    return key(WORKSPACE, workspace_id)


def assignment(provisioner_id: UUID, reservation_id: UUID) -> int:
    return key(ASSIGNMENT, provisioner_id, reservation_id)


def ephemeral_mint(workspace_id: UUID, provisioner_id: UUID, provider_runner_id: str) -> int:
    return key(EPHEMERAL_MINT, workspace_id, provisioner_id, provider_runner_id)


MIGRATIONS_KEY = key(MIGRATIONS)
LEADER_KEY = key(LEADER)


class LeaderLock:
    """The leader lock, `LEADER_KEY`, as a session lock on a dedicated connection: held for as
    long as that session lives, and released by the server when it ends (`release`, or a lost
    connection). It is the only lock of its session, and nothing waits for it: `acquire` only
    tries, so it cannot take part in a deadlock.

    A failed try keeps the connection for the next one. Not safe for concurrent use: one
    `Leadership` drives it.
    """

    def __init__(self, settings: PoolSettings) -> None:
        self._settings = settings
        self._session: Dedicated | None = None
        self._held = False

    async def acquire(self) -> bool:
        """Try the lock, opening a session first if there is none or it was lost; True when we
        hold it. Asking again while holding it only probes, so the lock is never stacked."""
        if self._session is None or self._session.lost:
            self.release()
            self._session = await Dedicated.open(self._settings)
        if self._held:
            await self._session.probe()
        else:
            self._held = bool(
                await self._session.connection.fetchval(
                    "SELECT pg_try_advisory_lock($1)", LEADER_KEY
                )
            )
        return self._held

    async def probe(self) -> None:
        """A round trip on the lock's session: raises if it is gone; hangs while the server does
        (the caller holds the deadline)."""
        if self._session is None or self._session.lost:
            raise ConnectionError("the leader lock's connection is gone")
        await self._session.probe()

    async def wait_lost(self) -> None:
        """Return once the lock's session has ended (at once when there is none)."""
        if self._session is not None:
            await self._session.wait_lost()

    def release(self) -> None:
        """End the session, which releases the lock; the next `acquire` opens a new one."""
        if self._session is not None:
            self._session.close()
        self._session = None
        self._held = False
