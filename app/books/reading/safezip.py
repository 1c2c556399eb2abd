"""Reading an uploaded zip (an EPUB, a DOCX) without letting it inflate without bound.

Refused from the central directory, before anything is inflated: too many entries, a declared
total or per-entry size over the limits, a compression ratio past the limit (for entries over
1 MiB). Every read is capped at the entry's declared size, and `SafeArchive` counts what it has
inflated in all, so neither a lying header nor one entry read many times gets past the limits.
Refusals are `BadInput` with the reason.
"""

from __future__ import annotations

import io
import zipfile
import zlib

from app.books.reading.source import BookLimits
from app.errors import BadInput

_RATIO_FLOOR = 1024 * 1024  # small entries may compress very well (a run of spaces) without harm


def open_archive(data: bytes, limits: BookLimits, kind: str = "EPUB") -> zipfile.ZipFile:
    """Open the book's zip and refuse it from its central directory if it could inflate too much."""
    if not data:
        raise BadInput(f"the {kind} is empty")
    if len(data) > limits.max_epub_bytes:
        raise BadInput(f"the {kind} is {len(data)} bytes; the limit is {limits.max_epub_bytes}")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as exc:
        raise BadInput(f"not a valid {kind}: the zip container is broken ({exc})") from exc
    infos = archive.infolist()
    if len(infos) > limits.epub_max_entries:
        raise BadInput(f"the {kind} has {len(infos)} files; the limit is {limits.epub_max_entries}")
    total = sum(i.file_size for i in infos)
    if total > limits.epub_max_unpacked:
        raise BadInput(f"the {kind} unpacks to {total} bytes; the limit is {limits.epub_max_unpacked} "
                       "(refused as a possible zip bomb)")
    for info in infos:
        _check_entry(info, limits, kind)
    return archive


def _check_entry(info: zipfile.ZipInfo, limits: BookLimits, kind: str) -> None:
    if info.file_size > limits.epub_max_entry:
        raise BadInput(f"{kind} file {info.filename!r} unpacks to {info.file_size} bytes; "
                       f"the limit is {limits.epub_max_entry}")
    ratio = info.file_size / max(1, info.compress_size)
    if info.file_size > _RATIO_FLOOR and ratio > limits.epub_max_ratio:
        raise BadInput(f"{kind} file {info.filename!r} is compressed {ratio:.0f}:1; the limit is "
                       f"{limits.epub_max_ratio}:1 (refused as a possible zip bomb)")


def read_entry(archive: zipfile.ZipFile, name: str, limits: BookLimits, kind: str = "EPUB") -> bytes:
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise BadInput(f"not a valid {kind}: {name!r} is missing") from None
    try:
        with archive.open(info) as handle:
            content = handle.read(min(info.file_size, limits.epub_max_entry) + 1)
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, NotImplementedError, ValueError) as exc:
        raise BadInput(f"not a valid {kind}: {name!r} cannot be unpacked ({exc})") from exc
    if len(content) > info.file_size:  # pragma: no cover - zipfile stops at the declared size
        raise BadInput(f"{kind} file {name!r} is larger than its header says")
    return content


class SafeArchive:
    """Reads entries and counts them against the unpacked limit: a file read twice counts twice."""

    def __init__(self, data: bytes, limits: BookLimits, kind: str = "EPUB") -> None:
        self.zip, self.limits, self.left = open_archive(data, limits, kind), limits, limits.epub_max_unpacked
        self.kind = kind

    def has(self, name: str) -> bool:
        return name in self.zip.NameToInfo

    def read(self, name: str) -> bytes:
        content = read_entry(self.zip, name, self.limits, self.kind)
        self.left -= len(content)
        if self.left < 0:
            raise BadInput(f"reading the {self.kind} unpacks more than {self.limits.epub_max_unpacked} bytes "
                           "(refused as a possible zip bomb)")
        return content
