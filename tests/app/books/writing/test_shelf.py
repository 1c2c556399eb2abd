"""Audiobookshelf-ready: the tags as FFmpeg reads them back (Audiobookshelf reads them with ffprobe, the
same library), metadata.json, the cover file, and the series options' checks."""

import json
import re
from dataclasses import replace

import av
import pytest

from app.books.planning.plan import plan_book
from app.books.reading.text import parse_markdown
from app.books.submission import BookOptions
from app.books.writing.output import BookOutput, assemble_book
from app.errors import BadInput
from tests.app.books.conftest import MARKDOWN_BOOK, tiny_png
from tests.app.books.writing.test_output import VOICE, render

SEQUENCE_RE = re.compile(r" #([^#\s]+)$")  # how Audiobookshelf takes a sequence out of "Series #2"


@pytest.fixture
def shelved(tmp_path):
    plan = replace(plan_book(parse_markdown(MARKDOWN_BOOK.encode()), voice_id=VOICE), narrator="Ben Narrow",
                   description="Three short parts.", series="The Lamps", series_part="2")
    out = assemble_book(plan, render(plan, tmp_path / "segments"), tmp_path / "out", output=BookOutput(
        mp3=True, cover=tiny_png(), cover_type="image/png"))
    return plan, out


def test_the_m4b_and_mp3_tags_read_back_as_audiobookshelf_maps_them(shelved):
    plan, out = shelved
    with av.open(str(out.m4b)) as box:
        tags = dict(box.metadata)
    assert (tags["album"], tags["artist"], tags["composer"]) == (plan.title, "Ada Quill", "Ben Narrow")
    assert tags["description"] == "Three short parts." and tags["LANGUAGE"] == "en"
    assert (tags["SERIES"], tags["SERIES-PART"]) == ("The Lamps", "2")
    assert SEQUENCE_RE.search(tags["grouping"]).group(1) == "2"
    with av.open(str(out.mp3s[0])) as box:
        first = {k.lower(): v for k, v in box.metadata.items()}
    assert (first["album"], first["artist"], first["composer"]) == (plan.title, "Ada Quill", "Ben Narrow")
    assert (first["series"], first["series-part"], first["language"]) == ("The Lamps", "2", "en")


def test_metadata_json_and_the_cover_sit_beside_the_audio(shelved):
    plan, out = shelved
    folder = out.m4b.parent
    meta = json.loads((folder / "metadata.json").read_text())
    index = json.loads(out.index_json.read_text())
    assert (meta["title"], meta["authors"], meta["narrators"]) == (plan.title, ["Ada Quill"], ["Ben Narrow"])
    assert meta["series"] == ["The Lamps #2"] and meta["language"] == "en"
    assert [(c["start"], c["end"], c["title"]) for c in meta["chapters"]] == [
        (c["start"], c["end"], c["title"]) for c in index["chapters"]]
    assert (folder / "cover.png").read_bytes() == tiny_png()


@pytest.mark.parametrize(("options", "reason"), [
    (BookOptions(series="S", series_part="1 a"), "without spaces"),
    (BookOptions(series="S", series_part="#1"), "without spaces"),
    (BookOptions(series_part="1"), "needs a series"),
    (BookOptions(series=" "), "1 to 500 characters"),
])
def test_a_series_part_audiobookshelf_could_not_read_is_refused(options, reason):
    with pytest.raises(BadInput, match=reason):
        options.check()
