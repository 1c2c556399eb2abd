"""A book's files under the artifact root, named by us, never by a client:

    books/<book id>/request.json  what the client asked (`app.books.submission`), from submission on
                    source      the upload, until a CPU worker has read it (then removed)
                    lexicon     a lexicon and a cast sent with it, likewise
                    cast
                    outcome.json  what reading it gave (`app.books.intake_child`), then plan.json ...
                    plan.json   the plan (`app.books.planning.plan.BookPlan`), written once, when the book is
                    read meta.json   cover type, the manifest's folder (CLI books with source audio), and what
                                the book's status shows of the plan (narrator, description, cast)
                    cover       the cover image, when the book has one
                    readalong.json  epub3 books: each chapter's text as shown, cut at its segments
                                (`app.books.planning.readalong`), written by the reading child with the plan
                    readalong-source.zip  epub3 books from an EPUB: its files, segments wrapped
                    out/        chapter-001.flac ..., book.m4b, chapters.json, chapters.vtt, and with
                                mp3 chapter-001.mp3 ..., with epub3 book.epub and readalong/ (its
                                chapter audio) (+ sidecars)

A book's plan never changes once written, so `load_plan` keeps the last plans it read (a book's
thousand segment tasks read it once per process, not a thousand times).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.books.planning.plan import BookPlan
from app.books.planning.readalong import ChapterText, ReadAlong, load_text
from app.books.reading.source import SourceBook
from app.storage.artifacts import ArtifactStore, atomic_path, write_text

BOOKS_DIR = "books"
READALONG = "readalong.json"
SKELETON = "readalong-source.zip"  # an EPUB source's files for its read-along EPUB
# (`app.books.planning.readalong_source`)
OUTPUT_NAMES = ("book.m4b", "book.epub", "chapters.json", "chapters.vtt", "metadata.json", "cover.jpg",
                "cover.png")  # besides the chapter files


def book_dir(artifacts: ArtifactStore, book_id: str) -> Path:
    return artifacts.root / BOOKS_DIR / str(uuid.UUID(book_id))


def output_dir(artifacts: ArtifactStore, book_id: str) -> Path:
    return book_dir(artifacts, book_id) / "out"


def store_files(folder: Path, plan: BookPlan, source: SourceBook, base_dir: Path | None) -> None:
    """A planned book's files in its folder (`book_dir`): plan, meta and cover."""
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "plan.json", json.dumps(plan.to_dict(), ensure_ascii=False))
    if source.cover:
        with atomic_path(folder / "cover") as tmp:
            tmp.write_bytes(source.cover)
    meta = {"cover_type": source.cover_type if source.cover else None,
            "base_dir": str(base_dir.resolve()) if base_dir is not None else None,
            "narrator": plan.narrator, "description": plan.description, "cast": plan.cast,
            "series": plan.series, "series_part": plan.series_part, "publication": asdict(plan.publication)}
    write_text(folder / "meta.json", json.dumps(meta))


def store_readalong(folder: Path, texts: list[ChapterText], source: dict[str, Any] | None = None) -> None:
    """The shown text, and an EPUB source's own documents (their skeleton zip is written already)."""
    write_text(folder / READALONG, json.dumps({"chapters": [t.to_dict() for t in texts], "source": source},
                                              ensure_ascii=False))


def load_readalong(artifacts: ArtifactStore, book_id: str) -> ReadAlong:
    folder = book_dir(artifacts, book_id)
    data = json.loads((folder / READALONG).read_text(encoding="utf-8"))
    source = data.get("source")
    return ReadAlong(tuple(load_text(data["chapters"])), source, folder / SKELETON if source else None)


def load_plan(artifacts: ArtifactStore, book_id: str) -> BookPlan:
    return _read_plan(str(artifacts.root), book_id)


@lru_cache(maxsize=32)
def _read_plan(root: str, book_id: str) -> BookPlan:
    data = json.loads((book_dir(ArtifactStore(root), book_id) / "plan.json").read_text(encoding="utf-8"))
    return BookPlan.from_dict(data)


def load_meta(artifacts: ArtifactStore, book_id: str) -> dict[str, Any]:
    return dict(json.loads((book_dir(artifacts, book_id) / "meta.json").read_text(encoding="utf-8")))


def base_dir_of(artifacts: ArtifactStore, book_id: str) -> Path | None:
    """The folder a CLI manifest's audio segments are read from, if the book has one."""
    base = load_meta(artifacts, book_id).get("base_dir")
    return Path(base) if base else None


def load_cover(artifacts: ArtifactStore, book_id: str) -> tuple[bytes | None, str | None]:
    meta = load_meta(artifacts, book_id)
    path = book_dir(artifacts, book_id) / "cover"
    if not meta.get("cover_type") or not path.is_file():
        return None, None
    return path.read_bytes(), meta["cover_type"]


def chapter_file_name(index: int, fmt: str) -> str:
    """The output file of chapter `index` (0-based): chapter-001.flac ..."""
    return f"chapter-{index + 1:03d}.{fmt}"


def is_output(name: str) -> bool:
    """A finished output's name: the M4B, the index, a chapter file (not sidecars or temp files)."""
    return name in OUTPUT_NAMES or (
        name.startswith("chapter-") and name.endswith((".wav", ".flac", ".mp3")) and "/" not in name)


def list_outputs(artifacts: ArtifactStore, book_id: str) -> list[str]:
    out = output_dir(artifacts, book_id)
    return sorted(p.name for p in out.iterdir() if is_output(p.name)) if out.is_dir() else []
