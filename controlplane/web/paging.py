"""Pages of the admin lists: `limit` (1-100, default 50) and an opaque `cursor` in, `next_cursor`
out. Every paged list is ordered by (created_at, id) descending; the cursor (domain/fleet.py)
names the last row of a page. The store is asked for one row more than the page, which is how we
know that another page follows: `next_cursor` is null on the last page."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar
from uuid import UUID

from controlplane.domain.fleet import decode_cursor, encode_cursor
from controlplane.errors import InvalidInput

T = TypeVar("T")

# Ours are about 120 characters. A longer one is not ours, and is refused before its JSON is
# parsed, so no cursor can nest deep enough to exhaust the parser's stack.
_MAX_CURSOR_LENGTH = 256


@dataclass(frozen=True, slots=True)
class Page:
    limit: int
    before: tuple[datetime, UUID] | None

    @property
    def fetch(self) -> int:
        """Rows to ask the store for."""
        return self.limit + 1


def page_of(limit: int, cursor: str | None) -> Page:
    """The page a decoded query asks for (wire/queries.py: `limit` is in range, an empty
    `cursor` is already `invalid-cursor`); a cursor we did not give is `invalid-cursor`."""
    if cursor is None:
        return Page(limit, None)
    if len(cursor) > _MAX_CURSOR_LENGTH:
        raise _not_ours()
    created_at, row_id = decode_cursor(cursor)
    try:
        created_at.astimezone(UTC)  # what the driver does; year 1 east of UTC overflows
    except OverflowError as error:
        raise _not_ours() from error
    return Page(limit, (created_at, row_id))


def _not_ours() -> InvalidInput:
    return InvalidInput("cursor is not one this server gave", code="invalid-cursor", field="cursor")


def cut(
    rows: Sequence[T], page: Page, position: Callable[[T], tuple[datetime, UUID]]
) -> tuple[list[T], str | None]:
    """The page's rows and the cursor of the next page (None when this is the last)."""
    shown = list(rows[: page.limit])
    if len(rows) <= page.limit:
        return shown, None
    return shown, encode_cursor(*position(shown[-1]))
