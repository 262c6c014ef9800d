"""Conversions from asyncpg records to domain types, shared by the store modules; and the lookup
and the insert of a token row, which every family of opaque credential shares.

No statement here takes an explicit lock: `row_by_digest` reads one row by a unique key, and
`insert_token` inserts one row (in its caller's transaction, if any)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar
from uuid import UUID

import asyncpg
import msgspec

from controlplane.domain import tokens
from controlplane.domain.jobs import JobIdentity
from controlplane.store.pool import Conn

T = TypeVar("T")

IDENTITY_COLUMNS = (
    "workspace_id, workflow_run_id, workflow_run_attempt_id, job_id, job_execution_id, project_id"
)

# The ordering columns a lease copies from its pending row (sql/0012; store/ordering.py).
ORDERING_COLUMNS = "priority, concurrency_key, concurrency_limit"

# The policy columns a pending row and its lease both have, under the same names (sql/0012 and
# 0013): the claim copies them onto the lease (store/claiming.py), a put-back and a retry copy
# them back (store/queue.py `requeue_statement`). A column added to both tables is added here,
# once.
POLICY_COLUMNS = (
    f"{ORDERING_COLUMNS}, timeout_seconds, queue_timeout_seconds, expires_at, retries_on_lost,"
    " attempt"
)

# Everything a lease carries back to the queue besides its identity and queue position.
CARRIED_COLUMNS = f"required_labels, payload, {POLICY_COLUMNS}"


def qualified(alias: str, columns: str) -> str:
    """`columns` (a comma-separated list) each prefixed with `alias.`."""
    return ", ".join(f"{alias}.{column}" for column in columns.split(", "))


_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


def json_value(raw: str | None) -> Any:
    """jsonb arrives as text (we install no codec, so the hot path decodes only what it reads)."""
    return None if raw is None else _json_decoder.decode(raw)


def json_text(value: Any) -> str:
    return _json_encoder.encode(value).decode()


def row_mapper(
    kind: type[T], /, **convert: Callable[[Any], object]
) -> Callable[[asyncpg.Record], T]:
    """The function that makes the domain dataclass `kind` of a row whose columns are named as
    its fields, a field in `convert` passed through its function (`state=RunnerState`). Made
    once per type for the hot paths: it is written out as `kind(a=row["a"], ...)` would be by
    hand, so a row costs what a hand-written mapper costs (`from_row` reads the field names
    again for each row)."""
    names = getattr(kind, "__dataclass_fields__")  # noqa: B009 -- mypy knows no such field of type[T]
    if unknown := set(convert) - set(names):
        raise TypeError(f"{kind.__name__} has no field {', '.join(sorted(unknown))}")
    # Field names are identifiers (dataclass checks them), so the source below is made of
    # nothing but names the class declares.
    fields = ", ".join(
        f"{name}=_{name}(row[{name!r}])" if name in convert else f"{name}=row[{name!r}]"
        for name in names
    )
    scope: dict[str, Any] = {"_kind": kind, **{f"_{name}": f for name, f in convert.items()}}
    exec(f"def {kind.__name__}_from_row(row):\n    return _kind({fields})\n", scope)  # noqa: S102 -- see above
    into: Callable[[asyncpg.Record], T] = scope[f"{kind.__name__}_from_row"]
    return into


# A job's identity, read from its IDENTITY_COLUMNS on every claim, completion and reap.
identity = row_mapper(JobIdentity)


def from_row(kind: type[T], row: asyncpg.Record, /, **given: object) -> T:
    """The domain dataclass `kind` of a row whose columns are named as its fields; `given`
    holds the fields that are not a plain column (converted, renamed or computed)."""
    names = getattr(kind, "__dataclass_fields__")  # noqa: B009 -- mypy knows no such field of type[T]
    plain = {name: row[name] for name in names if name not in given}
    return kind(**plain, **given)


async def row_by_digest(
    conn: Conn, query: str, sha256: str, *args: object
) -> asyncpg.Record | None:
    """The row `query` finds for a token digest (its $1), kept only when the row's
    `token_sha256` equals that digest by a constant-time comparison: every lookup of a presented
    token goes through here."""
    row = await conn.fetchrow(query, sha256, *args)
    if row is None or not tokens.same_digest(row["token_sha256"], sha256):
        return None
    return row


async def found_by_digest(
    conn: Conn, into: Callable[[asyncpg.Record], T], query: str, sha256: str, *args: object
) -> T | None:
    """`row_by_digest`, the row made into its domain value by `into`."""
    row = await row_by_digest(conn, query, sha256, *args)
    return None if row is None else into(row)


async def insert_token(
    conn: Conn,
    table: str,
    fields: Mapping[str, object],
    token: tokens.Opaque,
    ttl: timedelta | None,
    returning: str,
) -> asyncpg.Record:
    """Insert the row of a newly issued opaque token into `table`: its `fields` (column names, the
    caller's constants, to their values), the token's digest and display prefix (never the raw
    token), and an expiry `ttl` from now by the database's clock (none without a `ttl`); the row
    as `returning` reads it. Every family of opaque credential is issued through here."""
    values = [*fields.values(), token.sha256, token.display_prefix, ttl]
    columns = ", ".join([*fields, "token_sha256", "display_prefix", "expires_at"])
    places = ", ".join(f"${n}" for n in range(1, len(values)))
    row = await conn.fetchrow(
        f"""
        INSERT INTO {table} ({columns})
        VALUES ({places}, now() + ${len(values)}::interval)
        RETURNING {returning}
        """,  # noqa: S608 -- interpolates constants only: table, columns, places, returning
        *values,
    )
    assert row is not None
    return row


@dataclass(frozen=True, slots=True)
class TokenTable(Generic[T]):
    """A family of opaque tokens kept in a table of its own (manual registration tokens,
    provisioner tokens): its name, the columns its domain value is read from, and `into`, which
    makes a row that value. Its issue and its two lookups are written once, here."""

    table: str
    columns: str
    into: Callable[[asyncpg.Record], T]

    async def insert(
        self, conn: Conn, fields: Mapping[str, object], token: tokens.Opaque, ttl: timedelta | None
    ) -> T:
        """`insert_token` into this table."""
        return self.into(await insert_token(conn, self.table, fields, token, ttl, self.columns))

    async def by_digest(self, conn: Conn, sha256: str) -> T | None:
        return await found_by_digest(
            conn,
            self.into,
            f"SELECT token_sha256, {self.columns} FROM {self.table} WHERE token_sha256 = $1",  # noqa: S608 -- interpolates constants only: table, columns
            sha256,
        )

    async def by_id(self, conn: Conn, token_id: UUID) -> T | None:
        row = await conn.fetchrow(
            f"SELECT {self.columns} FROM {self.table} WHERE id = $1",  # noqa: S608 -- interpolates constants only: table, columns
            token_id,
        )
        return None if row is None else self.into(row)
