"""Conversions from asyncpg records to domain types, shared by the store modules."""

from __future__ import annotations

from typing import Any

import asyncpg
import msgspec

from controlplane.domain import tokens
from controlplane.domain.jobs import JobIdentity
from controlplane.store.pool import Conn

IDENTITY_COLUMNS = (
    "workspace_id, workflow_run_id, workflow_run_attempt_id, job_id, job_execution_id, project_id"
)

_json_decoder = msgspec.json.Decoder()
_json_encoder = msgspec.json.Encoder()


def identity(row: asyncpg.Record) -> JobIdentity:
    return JobIdentity(
        workspace_id=row["workspace_id"],
        workflow_run_id=row["workflow_run_id"],
        workflow_run_attempt_id=row["workflow_run_attempt_id"],
        job_id=row["job_id"],
        job_execution_id=row["job_execution_id"],
        project_id=row["project_id"],
    )


def json_value(raw: str | None) -> Any:
    """jsonb arrives as text (we install no codec, so the hot path decodes only what it reads)."""
    return None if raw is None else _json_decoder.decode(raw)


def json_text(value: Any) -> str:
    return _json_encoder.encode(value).decode()


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
