"""Keyset pages of the admin token lists: newest (created_at, id) first, strictly before the last
row of the previous page. A list statement takes the page as its first three parameters:
`WHERE <filters> AND {BEFORE} ORDER BY {NEWEST_FIRST}`, then `*args(before, limit)`; a `limit` of
None lists every row (LIMIT NULL), as the CLI does."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

Before = tuple[datetime, UUID] | None

BEFORE = "($1::timestamptz IS NULL OR (created_at, id) < ($1, $2::uuid))"
NEWEST_FIRST = "created_at DESC, id DESC LIMIT $3"


def args(before: Before, limit: int | None) -> tuple[datetime | None, UUID | None, int | None]:
    return (None, None, limit) if before is None else (before[0], before[1], limit)
