"""Text every database can store, the one rule for client strings that reach a row or a query.

PostgreSQL's text types refuse the NUL character (SQLite keeps it), and a lone surrogate (JSON's
`"\\ud800"` decodes to one) has no UTF-8 form, so neither database driver can send it. Both are refused
where a request comes in, naming the field, so that either database answers the same 422 rather than
one of them a 500. The API's models, its form reader and the voice lookup use it.
"""

from __future__ import annotations

import re

from app.errors import BadInput

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def unstorable(value: str) -> str | None:
    """What makes `value` unstorable (a sentence), or None when it is fine."""
    found = _UNSTORABLE.search(value)
    if found is None:
        return None
    what = "a NUL character" if found.group() == "\x00" else "a lone surrogate (not valid Unicode text)"
    return f"contains {what} at position {found.start()}"


def check_storable(value: str, field: str) -> str:
    """`value`, or BadInput naming `field` and what is wrong with it."""
    why = unstorable(value)
    if why is not None:
        raise BadInput(f"{field} {why}")
    return value
