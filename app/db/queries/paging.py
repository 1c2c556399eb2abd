"""Keyset pagination for the newest-first lists (jobs, books).

A page is ordered by (submitted_at DESC, id DESC), the order of the (submitted_at, id) indexes. The cursor
is the last row's pair, base64url-encoded: opaque to clients, and stable under concurrent inserts (a row
submitted after the first page sorts before every cursor, so no later page shows it twice or skips one).
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, and_, or_

from app.errors import BadInput

_SEP = "|"
_ID = re.compile(r"[0-9A-Za-z-]{1,36}")  # row ids are UUIDs; nothing else reaches the query


def encode_cursor(submitted_at: datetime, row_id: str) -> str:
    raw = f"{submitted_at.isoformat()}{_SEP}{row_id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """The (submitted_at, id) a cursor names; BadInput (422) with the reason if it is not one."""
    if not cursor or len(cursor) > 200:
        raise BadInput("after: not a cursor this API returned (empty or too long)")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        stamp, row_id = raw.split(_SEP, 1)
        when = datetime.fromisoformat(stamp)
        if when.tzinfo is None or not _ID.fullmatch(row_id):
            raise ValueError("not a stamp and an id")
        return when.astimezone(UTC), row_id
    except (binascii.Error, UnicodeDecodeError, ValueError, OverflowError) as e:
        raise BadInput("after: not a cursor this API returned (use X-Next-Cursor as given)") from e


def page(stmt: Select[Any], table: Any, after: str | None, limit: int) -> Select[Any]:
    """`stmt` newest first, after the cursor, one row more than `limit` (to know if another page exists)."""
    stmt = stmt.order_by(table.submitted_at.desc(), table.id.desc()).limit(limit + 1)
    if after is None:
        return stmt
    when, row_id = decode_cursor(after)
    return stmt.where(or_(table.submitted_at < when, and_(table.submitted_at == when, table.id < row_id)))


def split(rows: list[Any], limit: int) -> tuple[list[Any], str | None]:
    """A page of at most `limit` rows and the cursor of the next page (None: this is the last)."""
    if len(rows) <= limit:
        return rows, None
    last = rows[limit - 1]
    return rows[:limit], encode_cursor(last.submitted_at, last.id)
