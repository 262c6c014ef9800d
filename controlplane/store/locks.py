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
* ``leader``: replica leadership for maintenance, as a session lock on a dedicated connection.
* ``admin_command``: one (admin key, Idempotency-Key) pair, around an idempotent create.
* ``ephemeral_mint``: one (workspace, provisioner, provider runner id) triple, while a mint
  checks that the runner has no active ephemeral registration token; several are taken in
  sorted key order, in one statement, after every other lock of the mint (store/ephemeral.py).
"""

from __future__ import annotations

import hashlib
from uuid import UUID

EXECUTION = "cp_job_execution"
WORKSPACE = "cp_workspace"
ASSIGNMENT = "cp_assignment"
MIGRATIONS = "cp_migrations"
LEADER = "cp_leader"
ADMIN_COMMAND = "cp_admin_command"
EPHEMERAL_MINT = "cp_ephemeral_mint"


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
