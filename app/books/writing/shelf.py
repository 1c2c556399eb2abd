"""What Audiobookshelf reads beside a book's audio, so that it shows the book without manual matching:
`metadata.json` and the cover as an image file in the book's folder.

Facts from Audiobookshelf's scanner (its server/scanner and server/utils code): a book folder's metadata
comes, in its default order of precedence (later wins), from the folder names, the first audio file's
tags (ffprobe's: `album` or `title`, `artist` or `album_artist`, `composer` for the narrators,
`description` or `comment`, `genre`, `date`, `publisher`, `language`, `series` with `series-part` or a
`grouping` such as "Series #2", `isbn`, `asin`), an .nfo file, desc.txt and reader.txt, an .opf file,
and last `metadata.json`, whose book keys include title, authors, narrators, series (each "Name #2"),
description, language, genres, publishedYear, publisher, isbn and chapters ({start, end, title}, in
seconds); a genre tag is split at the first of "/", "//" or ";" it holds, and `date` is taken as the
published year as it stands. Its cover is an image in the folder, `cover.*` first. The M4B carries the
same tags (`app.books.writing.assemble`); this file repeats them (the genre "Audiobook" too when the book
names none), so the book reads the same whichever Audiobookshelf trusts. Nothing here is spoken.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.books.planning.plan import BookPlan
from app.books.writing.tags import FALLBACK_GENRE
from app.storage.artifacts import atomic_path, write_text

METADATA = "metadata.json"
COVER_NAMES = {"image/jpeg": "cover.jpg", "image/png": "cover.png"}


def shelf_metadata(plan: BookPlan, index: Mapping[str, Any]) -> dict[str, Any]:
    """metadata.json's content: the book's own fields, and its chapters on the M4B's timeline."""
    series = f"{plan.series} #{plan.series_part}" if plan.series_part else plan.series
    data: dict[str, Any] = {
        "title": plan.title, "authors": [plan.author] if plan.author else [],
        "narrators": [plan.narrator] if plan.narrator else [], "series": [series] if series else [],
        "description": plan.description or None, "language": plan.language,
        "publisher": plan.publication.publisher or None, "publishedYear": plan.publication.year or None,
        "isbn": plan.publication.isbn or None, "genres": list(plan.publication.genres) or [FALLBACK_GENRE],
        "chapters": [{"id": i, "start": c["start"], "end": c["end"], "title": c["title"]}
                     for i, c in enumerate(index["chapters"])]}
    return data


def write_shelf_files(out_dir: Path, plan: BookPlan, index: Mapping[str, Any], *, cover: bytes | None,
                      cover_type: str | None) -> list[str]:
    """metadata.json and the cover file; returns their names."""
    write_text(out_dir / METADATA, json.dumps(shelf_metadata(plan, index), ensure_ascii=False, indent=1))
    names = [METADATA]
    for kind, name in COVER_NAMES.items():
        path = out_dir / name
        if cover and cover_type == kind:
            if not path.is_file() or path.read_bytes() != cover:
                with atomic_path(path) as tmp:
                    tmp.write_bytes(cover)
            names.append(name)
        else:
            path.unlink(missing_ok=True)  # a cover the book no longer has
    return names
