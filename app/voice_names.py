"""Voice names: a stored voice may have a unique name, and a name, an id or a unique id prefix all find it.

`find_voice_id` is what every route and command that takes a voice calls before anything else: an exact
id, then an exact name, then a prefix of at least `MIN_PREFIX` hex digits of one id (what the CLI and
the web page print). A prefix shared by several voices is refused with the candidates.
"""

from __future__ import annotations

import re

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.db import queries
from app.db.models import Voice
from app.errors import BadInput, Conflict, NotFound
from app.storable import check_storable

NAME_MAX = 64
MIN_PREFIX = 4  # hex digits: what short ids print (8) with room; shorter matches too much to be meant
_NAME = re.compile(r"[^\W\d_][\w .'-]*")  # starts with a letter; letters, digits, space, . ' - _
_ID = re.compile(r"[0-9a-f]{64}")
_PREFIX = re.compile(r"[0-9a-f]+")


def check_name(name: str) -> str:
    """The name, stripped, or BadInput saying what a name may be."""
    name = name.strip()
    if not 1 <= len(name) <= NAME_MAX or not _NAME.fullmatch(name):
        raise BadInput(f"a voice name is 1 to {NAME_MAX} characters, starts with a letter, and has only "
                       "letters, digits, spaces and . ' - _")
    return name


def find_voice_id(*, session: Session, ref: str) -> str:
    """The id of the voice `ref` names (id, name or unique id prefix); NotFound, or BadInput when a
    prefix is ambiguous (the message lists the candidates) or `ref` is text no database can store."""
    ref = check_storable(ref, "voice").strip()
    if _ID.fullmatch(ref) and queries.get_voice(session=session, voice_id=ref) is not None:
        return ref
    named = queries.get_voice_by_name(session=session, name=ref) if len(ref) <= NAME_MAX else None
    if named is not None:
        return named.id
    if len(ref) >= MIN_PREFIX and _PREFIX.fullmatch(ref):
        found = queries.voice_ids_with_prefix(session=session, prefix=ref, limit=6)
        if len(found) == 1:
            return found[0]
        if found:
            shown = ", ".join(v[:12] for v in found[:5]) + (", ..." if len(found) > 5 else "")
            raise BadInput(f"voice {ref!r} is ambiguous: it begins {len(found)} voice ids ({shown}); "
                           "give more of the id")
    raise NotFound(f"no voice {ref[:80]!r} (by id, name or id prefix)")


def resolve_ref(*, session: Session, ref: str | None) -> str | None:
    """For a request's voice field: a name or an id prefix becomes its voice's id (NotFound when it names
    none); a full id, None, or anything that is neither (refused later as a malformed id) is unchanged."""
    if ref is None or _ID.fullmatch(ref) or not (_NAME.fullmatch(ref.strip()) or _PREFIX.fullmatch(ref)):
        return ref
    return find_voice_id(session=session, ref=ref)


def rename_voice(*, session: Session, voice_id: str, name: str | None) -> Voice:
    """Give the voice `name` (None: take its name away); Conflict when another voice has it."""
    name = check_name(name) if name is not None else None
    voice = queries.require_voice(session=session, voice_id=voice_id)
    if name is not None and _ID.fullmatch(name.lower()):
        raise BadInput("a voice name cannot look like a voice id")
    holder = queries.get_voice_by_name(session=session, name=name) if name is not None else None
    if holder is not None and holder.id != voice.id:
        raise Conflict(f"the name {name!r} is taken by voice {holder.id[:12]}")
    try:
        queries.set_voice_name(session=session, voice_id=voice.id, name=name)
    except IntegrityError as exc:  # taken between the look and the write
        session.rollback()
        raise Conflict(f"the name {name!r} is taken") from exc
    session.commit()
    return queries.require_voice(session=session, voice_id=voice.id)
