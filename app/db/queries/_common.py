"""Helpers shared by the query modules: error clipping, UPDATE row counts, dialect INSERTs."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import CursorResult
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

ERROR_MAX_CHARS = 4000


def _clip(error: str) -> str:
    return error if len(error) <= ERROR_MAX_CHARS else error[: ERROR_MAX_CHARS - 3] + "..."


def _rowcount(result: Any) -> int:
    """Rows an UPDATE matched (a CursorResult's rowcount; typed as plain Result by session.execute)."""
    return int(cast(CursorResult[Any], result).rowcount)


def _insert(session: Session, model: type[Any]) -> Any:
    """A dialect INSERT that supports on_conflict_do_nothing."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(model)
    if name == "sqlite":
        return sqlite.insert(model)
    raise NotImplementedError(f"unsupported database dialect {name!r}")
