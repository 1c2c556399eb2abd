"""Reading the fields of a multipart form (jobs and books that upload files), refusing with BadInput.

Form values arrive as strings or uploads; these turn them into what the services take, or say which
field is wrong and why.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import UploadFile

from app.errors import BadAudio, BadInput
from app.storable import check_storable


def text_field(value: Any, name: str) -> str | None:
    """A text field's value; None when it is absent or empty. BadInput for an upload, or for text no
    database can store (NUL, a lone surrogate: `app.storable`)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise BadInput(f"{name} must be a text field")
    return check_storable(value, name)


def number_field(value: Any, name: str, kind: type[int] | type[float] = int) -> Any:
    """A number field's value as `kind`; None when it is absent or empty."""
    text = text_field(value, name)
    if text is None:
        return None
    try:
        return kind(text)
    except ValueError as exc:
        raise BadInput(f"{name} must be {'an integer' if kind is int else 'a number'}, not {text!r}") from exc


async def read_upload(upload: UploadFile, limit: int, what: str) -> bytes:
    """The upload's bytes, refusing more than `limit` without reading them all into memory."""
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise BadAudio(f"{what} is larger than the {limit} byte limit")
    return data
