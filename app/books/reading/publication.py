"""A book's publication details for the players' tags and Audiobookshelf: publisher, year, ISBN, genres.

    Publication            the four, as a book carries them (`SourceBook`, `BookPlan`, `BookTags`)
    check_publication(...) what a request gives, checked: a 4-digit year within YEAR_RANGE, an ISBN-10 or
                           ISBN-13 whose check digit holds (hyphens and spaces allowed), lengths and the
                           number of genres bounded; BadInput with the reason otherwise
    opf_publication(opf)   an EPUB's package document: dc:publisher, dc:date, dc:identifier, dc:subject
    isbn_of / year_of / genres_of   lenient readers for what a book's own metadata says (those of an
                           EPUB; a DOCX's identifier and category): anything that is not a valid value
                           is left out, never refused

Genres travel in one tag, joined by ";": Audiobookshelf splits a genre tag at the first of "/", "//" or
";" it finds, so a genre given by a request may hold neither "/" nor ";", and a book's own subject
("Fiction / Fantasy / Epic") is split there into several genres.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from app.errors import BadInput

YEAR_RANGE = (1000, 2100)
MAX_PUBLISHER_CHARS = 500
MAX_GENRE_CHARS = 100
MAX_GENRES = 20
MAX_ISBN_CHARS = 40  # "978-0-306-40615-7" with room for spaces; the digits are checked after
GENRE_SEPARATOR = ";"
_ISBN_PREFIX_RE = re.compile(r"^(urn:)?isbn[:\s]*", re.IGNORECASE)
_YEAR_RE = re.compile(r"\d{4}")
_SPLIT_RE = re.compile(r"[/;]")


@dataclass(frozen=True)
class Publication:
    publisher: str = ""
    year: str = ""  # "2019": Audiobookshelf's publishedYear (the tags' `date`)
    isbn: str = ""  # digits (and a final X), no hyphens
    genres: tuple[str, ...] = ()


def publication_from_dict(data: dict) -> Publication:
    """Inverse of `dataclasses.asdict` after a JSON round trip (the genres back to a tuple)."""
    return Publication(str(data.get("publisher") or ""), str(data.get("year") or ""),
                       str(data.get("isbn") or ""), tuple(str(g) for g in data.get("genres") or ()))


def check_publication(*, publisher: str | None = None, year: str | None = None, isbn: str | None = None,
                      genres: list[str] | tuple[str, ...] | None = None) -> None:
    """Refuse what a request gives that no player could use; None is 'not given'."""
    if publisher is not None and len(publisher) > MAX_PUBLISHER_CHARS:
        raise BadInput(f"the publisher is {len(publisher)} characters; the limit is {MAX_PUBLISHER_CHARS}")
    if year is not None:
        check_year(year)
    if isbn is not None:
        check_isbn(isbn)
    if genres is not None:
        clean_genres(genres)


def check_year(year: str) -> str:
    text = year.strip()
    if not _YEAR_RE.fullmatch(text) or not YEAR_RANGE[0] <= int(text) <= YEAR_RANGE[1]:
        raise BadInput(f"year {text[:20]!r} must be four digits, {YEAR_RANGE[0]} to {YEAR_RANGE[1]}")
    return text


def check_isbn(isbn: str) -> str:
    """An ISBN as people write it -> its digits (a final X kept for ISBN-10); BadInput if it is not one."""
    if len(isbn) > MAX_ISBN_CHARS:
        raise BadInput(f"the ISBN is {len(isbn)} characters; the limit is {MAX_ISBN_CHARS}")
    digits = _ISBN_PREFIX_RE.sub("", isbn.strip()).replace("-", "").replace(" ", "").upper()
    if not re.fullmatch(r"\d{9}[\dX]|\d{13}", digits):
        raise BadInput(f"ISBN {isbn[:20]!r} must be 10 or 13 digits (hyphens allowed; an ISBN-10 may end "
                       "in X)")
    if not _check_digit_holds(digits):
        raise BadInput(f"ISBN {isbn[:20]!r}: its check digit does not match (a typing error?)")
    return digits


def _check_digit_holds(digits: str) -> bool:
    if len(digits) == 10:
        values = [10 if c == "X" else int(c) for c in digits]
        return "X" not in digits[:9] and sum((10 - i) * v for i, v in enumerate(values)) % 11 == 0
    return digits[:3] in ("978", "979") and sum(
        int(c) * (1 if i % 2 == 0 else 3) for i, c in enumerate(digits)) % 10 == 0


def clean_genres(genres: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """A request's genres -> whitespace collapsed, empty and repeated ones dropped; BadInput on a genre
    with '/' or ';', an over-long one, or too many."""
    kept: dict[str, None] = {}
    for raw in genres:
        genre = " ".join(str(raw).split())
        if _SPLIT_RE.search(genre):
            raise BadInput(f"genre {genre[:40]!r} holds '/' or ';', where Audiobookshelf splits a genre tag; "
                           "give each genre on its own")
        if len(genre) > MAX_GENRE_CHARS:
            raise BadInput(f"genre {genre[:40]!r}... is {len(genre)} characters; the limit is "
                           f"{MAX_GENRE_CHARS}")
        if genre:
            kept[genre] = None
    if len(kept) > MAX_GENRES:
        raise BadInput(f"{len(kept)} genres; the limit is {MAX_GENRES}")
    return tuple(kept)


def split_genre_list(text: str) -> list[str]:
    """A form's or the CLI's genres field: genres separated by commas."""
    return [part for part in (" ".join(p.split()) for p in text.split(",")) if part]


# --- a book's own metadata: lenient ----------------------------------------------------------------

def isbn_of(identifier: str, scheme: str = "") -> str:
    """An identifier that is an ISBN (its scheme says so, or it starts 'urn:isbn:' or 'isbn') -> its
    digits; "" otherwise or when its check digit fails."""
    text = identifier.strip()
    if "isbn" not in scheme.lower() and not _ISBN_PREFIX_RE.match(text):
        return ""
    try:
        return check_isbn(text)
    except BadInput:
        return ""


def year_of(date: str) -> str:
    """A date as books give it ("2019", "2019-03-01", "2019-03-01T00:00:00Z") -> "2019"; "" if none."""
    match = _YEAR_RE.match(date.strip())
    if match is None or not YEAR_RANGE[0] <= int(match.group()) <= YEAR_RANGE[1]:
        return ""
    return match.group()


_OPF = "{http://www.idpf.org/2007/opf}"
_DC = "{http://purl.org/dc/elements/1.1/}"
_ONIX_ISBN = {"02", "15"}  # ONIX code list 5: ISBN-10, ISBN-13 (an EPUB 3 identifier-type refinement)


def opf_publication(opf: ET.Element) -> Publication:
    """An EPUB package document's (already parsed, safely) dc:publisher, the year of its first dc:date,
    its first ISBN dc:identifier, its dc:subjects as genres."""
    def texts(tag: str) -> list[str]:
        return [" ".join((el.text or "").split()) for el in opf.iterfind(f"{_OPF}metadata/{_DC}{tag}")]

    types = {(m.get("refines") or "").lstrip("#"): (m.text or "").strip()
             for m in opf.iterfind(f"{_OPF}metadata/{_OPF}meta") if m.get("property") == "identifier-type"}
    isbn = ""
    for el in opf.iterfind(f"{_OPF}metadata/{_DC}identifier"):
        scheme = el.get(f"{_OPF}scheme") or ("isbn" if types.get(el.get("id") or "") in _ONIX_ISBN else "")
        isbn = isbn or isbn_of(el.text or "", scheme)
    publisher = next((p for p in texts("publisher") if p and len(p) <= MAX_PUBLISHER_CHARS), "")
    year = next((y for y in map(year_of, texts("date")) if y), "")
    return Publication(publisher=publisher, year=year, isbn=isbn, genres=genres_of(texts("subject")))


def genres_of(subjects: list[str]) -> tuple[str, ...]:
    """A book's subjects -> genres: split at '/' and ';', over-long ones and those past the limit left out."""
    kept: dict[str, None] = {}
    for subject in subjects:
        for part in _SPLIT_RE.split(subject):
            genre = " ".join(part.split())
            if genre and len(genre) <= MAX_GENRE_CHARS:
                kept[genre] = None
    return tuple(kept)[:MAX_GENRES]
