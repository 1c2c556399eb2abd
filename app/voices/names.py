"""Voice names: a stored voice may have a unique name, and a name, an id or a unique id prefix all find it.

`find_voice_id` is what every route and command that takes a voice calls before anything else: an exact
id, then a prefix of at least `MIN_PREFIX` hex digits of one id (what the CLI and the web page print),
then a name (as stored, else by its key: `ada` finds `Ada`). A prefix shared by several voices is
refused with the candidates; a reference that finds nothing is answered with the nearest stored names
(difflib's ratio over the keys), "did you mean 'Ada'?".

Ids come first, and a name can never spell one: `check_name` refuses a name of hex digits only (in any
case) that is long enough to be a prefix, since any voice stored later may begin with it. Two names are
the same name when their keys are (`name_key`: Unicode NFKC, then case folding, so `Ada`, `ada` and
`ＡＤＡ` are one name), and a name that mixes letters of the Latin, Greek and Cyrillic scripts is refused
(Cyrillic `А` in `Аda` looks like Latin `A`). What this does not catch: a name written wholly in another
script that looks like a Latin one (ICU's confusable skeleton would; PyICU has no wheel to install).
"""

from __future__ import annotations

import difflib
import re
import unicodedata

import regex
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
_HEX = re.compile(r"[0-9a-fA-F]+")
# Scripts whose letters stand in for each other's (UTS 39's confusables are mostly among these three).
_LOOKALIKE_SCRIPTS = tuple(regex.compile(rf"\p{{Script={name}}}") for name in ("Latin", "Greek", "Cyrillic"))


def name_key(name: str) -> str:
    """What two names are compared by: NFKC, then case folding (NFKC again: folding can denormalise)."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def check_name(name: str) -> str:
    """The name, stripped, or BadInput saying what a name may be and which rule it broke."""
    name = name.strip()
    if not 1 <= len(name) <= NAME_MAX or not _NAME.fullmatch(name):
        raise BadInput(f"a voice name is 1 to {NAME_MAX} characters, starts with a letter, and has only "
                       "letters, digits, spaces and . ' - _")
    if len(name) >= MIN_PREFIX and _HEX.fullmatch(name_key(name)):
        raise BadInput(f"a voice name cannot be {MIN_PREFIX} or more hex digits only: it would read as a "
                       "voice id prefix (ids are looked up before names)")
    if sum(bool(script.search(name)) for script in _LOOKALIKE_SCRIPTS) > 1:
        raise BadInput("a voice name cannot mix Latin, Greek and Cyrillic letters: their look-alikes "
                       "would make two names that read the same")
    return name


def find_voice_id(*, session: Session, ref: str) -> str:
    """The id of the voice `ref` names (id, name or unique id prefix); NotFound, or BadInput when a
    prefix is ambiguous (the message lists the candidates) or `ref` is text no database can store."""
    ref = check_storable(ref, "voice").strip()
    if _ID.fullmatch(ref) and queries.get_voice(session=session, voice_id=ref) is not None:
        return ref
    if len(ref) >= MIN_PREFIX and _PREFIX.fullmatch(ref):  # before names: no name shadows an id
        found = queries.voice_ids_with_prefix(session=session, prefix=ref, limit=6)
        if len(found) == 1:
            return found[0]
        if found:
            shown = ", ".join(v[:12] for v in found[:5]) + (", ..." if len(found) > 5 else "")
            raise BadInput(f"voice {ref!r} is ambiguous: it begins {len(found)} voice ids ({shown}); "
                           "give more of the id")
    named = queries.get_voice_by_name(session=session, name=ref) if len(ref) <= NAME_MAX else None
    if named is not None:
        return named.id
    holder = _holder(session, ref) if len(ref) <= NAME_MAX else None
    if holder is not None:  # the same name by its key: `ada` finds `Ada`, as it could not be another's
        return holder[0]
    raise NotFound(f"no voice {ref[:80]!r} (by id, name or id prefix){_suggestions(session, ref)}")


def _suggestions(session: Session, ref: str) -> str:
    """"; did you mean 'Ada' or 'Adam'?" for the stored names nearest `ref` (compared by key), or ""."""
    if len(ref) > NAME_MAX:
        return ""
    held = {name_key(name): name for _, name in queries.voice_names(session=session)}
    near = difflib.get_close_matches(name_key(ref), list(held), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(held[key]) for key in near)}?" if near else ""


def resolve_ref(*, session: Session, ref: str | None) -> str | None:
    """For a request's voice field: a name or an id prefix becomes its voice's id (NotFound when it names
    none); a full id, None, or anything that is neither (refused later as a malformed id) is unchanged."""
    if ref is None or _ID.fullmatch(ref) or not (_NAME.fullmatch(ref.strip()) or _PREFIX.fullmatch(ref)):
        return ref
    return find_voice_id(session=session, ref=ref)


def _holder(session: Session, name: str) -> tuple[str, str] | None:
    """(id, name) of a voice whose name is the same as `name` by `name_key`, if one is."""
    key = name_key(name)
    return next(((voice_id, held) for voice_id, held in queries.voice_names(session=session)
                 if name_key(held) == key), None)


def rename_voice(*, session: Session, voice_id: str, name: str | None) -> Voice:
    """Give the voice `name` (None: take its name away); Conflict when another voice has it."""
    name = check_name(name) if name is not None else None
    voice = queries.require_voice(session=session, voice_id=voice_id)
    holder = _holder(session, name) if name is not None else None
    if holder is not None and holder[0] != voice.id:
        raise Conflict(f"the name {name!r} is taken by voice {holder[0][:12]} (as {holder[1]!r}: names are "
                       "compared after Unicode NFKC and case folding)")
    try:
        queries.set_voice_name(session=session, voice_id=voice.id, name=name)
    except IntegrityError as exc:  # taken between the look and the write
        session.rollback()
        raise Conflict(f"the name {name!r} is taken") from exc
    session.commit()
    return queries.require_voice(session=session, voice_id=voice.id)
