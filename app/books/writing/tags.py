"""The tags a book's M4B and MP3s carry (`BookTags`), and the MP4 atoms FFmpeg's muxer does not write.

Names follow audiobook players' convention (Audible's and the community's taggers): title and album the
book, artist and album artist the author, composer the narrator, the description as `description` and
`comment` (then a "Note: ..." line for each note on how the audio was made). The series goes where
Audiobookshelf looks for it (`app.books.writing.shelf`): a grouping "Series #2" and freeform `SERIES` /
`SERIES-PART` atoms (ID3: TIT1 and TXXX frames), the language in `LANGUAGE` (ID3: TLAN). The
publication (`app.books.reading.publication`): `genre` the book's genres joined by ";" (where Audiobookshelf
splits them), "Audiobook" when none is known; `date` the year (ID3: TYER); freeform `PUBLISHER` (ID3:
TPUB) and `ISBN` (ID3: TXXX).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mutagen import mp4

from app.books.reading.publication import GENRE_SEPARATOR, Publication

FALLBACK_GENRE = "Audiobook"


@dataclass(frozen=True)
class BookTags:
    title: str
    author: str = ""
    narrator: str = ""
    description: str = ""
    notes: tuple[str, ...] = ()  # how the audio was made, when not by the real model: in the comment
    series: str = ""  # Audiobookshelf's "series" and "series-part" tags, and the grouping "Series #2"
    series_part: str = ""
    language: str = ""
    publication: Publication = Publication()

    @property
    def genre(self) -> str:
        return GENRE_SEPARATOR.join(self.publication.genres) or FALLBACK_GENRE

    @property
    def grouping(self) -> str:
        return f"{self.series} #{self.series_part}" if self.series and self.series_part else self.series

    def custom(self) -> dict[str, str]:
        """Tags with no standard MP4 atom or ID3 frame: freeform atoms / TXXX frames (empty ones left out)."""
        tags = {"SERIES": self.series, "SERIES-PART": self.series_part, "LANGUAGE": self.language,
                "PUBLISHER": self.publication.publisher, "ISBN": self.publication.isbn}
        return {k: v for k, v in tags.items() if v}

    @property
    def comment(self) -> str:
        return "\n".join([self.description, *(f"Note: {n}" for n in self.notes)]).strip()

    def common(self) -> dict[str, str]:
        """The tags every output of the book carries (empty ones left out)."""
        tags = {"album": self.title, "artist": self.author, "album_artist": self.author,
                "composer": self.narrator, "genre": self.genre, "date": self.publication.year,
                "comment": self.comment}
        return {k: v for k, v in tags.items() if v}


def write_mp4_extra_tags(path: Path, tags: BookTags) -> None:
    """What FFmpeg's MP4 muxer does not write: the grouping atom and freeform atoms, which FFmpeg (and so
    Audiobookshelf's ffprobe) reads back as `grouping`, `SERIES`, `SERIES-PART`, `LANGUAGE`, `PUBLISHER`,
    `ISBN`."""
    if not tags.grouping and not tags.custom():
        return
    box = mp4.MP4(path)
    if tags.grouping:
        box["\xa9grp"] = [tags.grouping]
    for key, value in tags.custom().items():
        box[f"----:com.apple.iTunes:{key}"] = [mp4.MP4FreeForm(value.encode())]
    box.save()
