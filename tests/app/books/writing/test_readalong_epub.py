"""Read-along EPUB 3 from every source format: valid for EPUBCheck (a validator no one here wrote), every
<par> pointing at an element that exists, every clip inside its audio file, a chapter's clips covering
its audio end to end in order, on the same timings as chapters.json; rebuilt only where a chapter changed."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import zipfile
from pathlib import Path, PurePosixPath

import av
import pytest
from lxml import etree

from app.books.planning.plan import plan_book
from app.books.planning.readalong import ReadAlong, readalong_text, split_like
from app.books.planning.readalong_source import own_documents
from app.books.reading.parse import parse_book
from app.books.reading.source import DEFAULT_LIMITS
from app.books.submission import BookOptions, Submission
from app.books.writing.output import BookOutput, assemble_book
from app.errors import BadInput
from tests.app.books.conftest import MARKDOWN_BOOK, make_docx, make_epub, make_pdf, tiny_png
from tests.app.books.reading.test_documents import PAGE
from tests.app.books.reading.test_publication import PUBLISHED
from tests.app.books.reading.test_subtitles import MARA, SRT, VTT
from tests.app.books.writing.test_output import VOICE, render

SMIL = "{http://www.w3.org/ns/SMIL}"
TEXT_BOOK = (b"The Quiet House\n\nChapter 1\n\nThe door was open. Nobody came.\n\n"
             b"Chapter 2\n\nAt 7:30 the bell rang twice.\n")
PDF_BOOK = make_pdf([["Chapter 1", "The rain fell on the roof all night."],
                     ["Chapter 2", "By morning it stopped."]],
                    outline=[("Chapter 1", 0), ("Chapter 2", 1)], info={"/Title": "Rain"})
DOCX_BOOK = make_docx([("Title", "Winter"), ("Heading 1", "Snow"),
                       ("", "It snowed for 3 days. Dr. Hale stayed in."),
                       ("Heading 1", "Thaw"), ("", "Then the ice broke.")])
SOURCES = {"text": TEXT_BOOK, "markdown": MARKDOWN_BOOK.encode(), "epub": make_epub(cover=tiny_png(),
                                                                                     opf_extra=PUBLISHED),
           "html": PAGE, "pdf": PDF_BOOK, "docx": DOCX_BOOK, "srt": SRT, "vtt": VTT}


def build(fmt: str, folder: Path, data: bytes | None = None, audio=None, own: bool = True):
    """A book read, planned, rendered (tones) and assembled with its read-along EPUB; an EPUB source in
    its own XHTML unless `own` is False."""
    data = SOURCES[fmt] if data is None else data
    source = parse_book(data, fmt=fmt)
    plan = plan_book(source, voice_id=VOICE, cast={"mara": MARA})  # the WebVTT book's <v Mara>
    audio = render(plan, folder / "segments", audio)
    readalong = ReadAlong(tuple(readalong_text(source, plan)))
    if fmt == "epub" and own:
        described = own_documents(data, source, plan, DEFAULT_LIMITS, folder / "skeleton.zip")
        assert described is not None
        readalong = ReadAlong(readalong.texts, described, folder / "skeleton.zip")
    output = BookOutput(fmt="flac", timed=fmt == "srt", readalong=readalong, cover=source.cover,
                        cover_type=source.cover_type)
    out = assemble_book(plan, audio, folder / "out", output=output)
    return plan, audio, out


def epubcheck(path: Path) -> list[dict]:
    """EPUBCheck's messages on the file (Debian's `epubcheck`, a jar run with java)."""
    jar = shutil.which("epubcheck")
    assert jar, "EPUBCheck is not installed: apt-get install epubcheck (.ci/run installs it)"
    report = path.with_suffix(".check.json")
    subprocess.run(["java", "-jar", str(Path(jar).resolve()), str(path), "--json", str(report)],
                   capture_output=True, timeout=300, check=False)
    return json.loads(report.read_text())["messages"]


def overlays(epub: Path) -> dict[str, list[tuple[str, str, float, float]]]:
    """Each SMIL's <par>s: (text document, fragment, clip begin, clip end), paths from the zip's root."""
    found = {}
    with zipfile.ZipFile(epub) as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".smil")):
            pars = []
            for par in etree.fromstring(z.read(name)).iter(f"{SMIL}par"):
                text, audio = par.find(f"{SMIL}text"), par.find(f"{SMIL}audio")
                doc, _, fragment = text.get("src").partition("#")
                pars.append((_join(name, doc), fragment, _join(name, audio.get("src")),
                             _seconds(audio.get("clipBegin")), _seconds(audio.get("clipEnd"))))
            found[name] = pars
    return found


def _join(base: str, href: str) -> str:
    parts: list[str] = []
    for part in (PurePosixPath(base).parent / href).parts:
        if part == "..":
            parts.pop()
        else:
            parts.append(part)
    return "/".join(parts)


def _seconds(clock: str) -> float:
    h, m, s = clock.split(":")
    return int(h) * 3600 + int(m) * 60 + float(s)


def audio_seconds(data: bytes) -> float:
    with av.open(io.BytesIO(data)) as box:
        return float(box.duration) / av.time_base


VARIANTS = {"epub-plain": {"own": False},  # an EPUB in plain documents; an EPUB 2 (an NCX, no nav document)
            "epub2": {"data": make_epub(nav=False, cover=tiny_png())}}


@pytest.mark.parametrize("fmt", [*SOURCES, *VARIANTS])
def test_a_read_along_epub_from_each_format_is_valid_and_its_overlays_match_the_audio(fmt, tmp_path):
    plan, _, out = build(fmt if fmt in SOURCES else "epub", tmp_path, **VARIANTS.get(fmt, {}))
    messages = epubcheck(out.epub)
    assert [m for m in messages if m["severity"] in ("FATAL", "ERROR", "WARNING")] == []
    index = json.loads(out.index_json.read_text())
    by_audio: dict[str, list] = {}  # each chapter's pars, in reading order, over its documents
    for pars in overlays(out.epub).values():
        for par in pars:
            by_audio.setdefault(par[2], []).append(par)
    assert len(by_audio) == len(plan.chapters) == len(index["chapters"])
    with zipfile.ZipFile(out.epub) as z:
        ids = {doc: {el.get("id") for el in etree.fromstring(z.read(doc)).iter()}
               for doc in {par[0] for pars in by_audio.values() for par in pars}}
        for (audio, pars), chapter, planned in zip(sorted(by_audio.items()), index["chapters"], plan.chapters,
                                                   strict=True):
            assert len(pars) == len(planned.segments)  # a <par> per segment
            assert all(fragment in ids[doc] for doc, fragment, *_ in pars)
            check_clips([(begin, end) for *_, begin, end in pars], chapter, audio_seconds(z.read(audio)))


def check_clips(clips: list[tuple[float, float]], chapter: dict, length: float) -> None:
    """A chapter's clips against its audio file's length and chapters.json's segments."""
    assert clips[0][0] == 0.0  # chapters.json's ends are rounded on the book's timeline: 1 ms apart
    assert clips[-1][1] == pytest.approx(chapter["end"] - chapter["start"], abs=1.5e-3)
    for (begin, end), (next_begin, _) in zip(clips, clips[1:], strict=False):
        assert begin < end == next_begin  # in order, no gap, no overlap
    assert clips[-1][1] <= length + 1e-3  # inside the file (AAC pads its last frame, never cuts)
    assert length - clips[-1][1] < 1024 / 24000 + 1e-3  # ... by less than one AAC frame
    for (begin, end), segment in zip(clips, chapter["segments"], strict=True):
        assert begin <= segment["start"] and segment["end"] <= end + 1e-3  # its speech is inside its clip
    for (begin, _), segment in zip(clips[1:], chapter["segments"][1:], strict=True):
        assert begin == segment["start"]  # chapters.json's timing, to the millisecond


def test_the_text_shown_is_the_books_own_not_the_normalised_text(tmp_path):
    _, _, out = build("markdown", tmp_path)
    with zipfile.ZipFile(out.epub) as z:
        first = etree.fromstring(z.read("OEBPS/text/chapter-001.xhtml"))
        package = z.read("OEBPS/package.opf").decode()
    spans = [el.text for el in first.iter("{http://www.w3.org/1999/xhtml}span")]
    assert spans == ["Chapter 1: The Storm", "Mr. Smith climbed the 132 steps on the 3rd of May, 1895.",
                     "The lamp cost $12.50.", "It was very cold.", "He checked the log twice."]
    assert 'media-overlay="mo001"' in package and "media:active-class" in package
    assert package.count('property="media:duration"') == 3 + 1  # each overlay and the whole book


def test_pieces_of_a_paragraph_follow_its_segments_across_normalisation():
    shown = 'Dr. Watson came at 7:30. "Go!" he said. The 3rd day ended.'
    spoken = ["Doctor Watson came at seven thirty.", "Go! he said.", "The third day ended."]
    cuts = split_like(shown, spoken)
    assert [shown[a:b].strip() for a, b in zip(cuts, [*cuts[1:], len(shown)], strict=True)] == [
        "Dr. Watson came at 7:30.", '"Go!" he said.', "The 3rd day ended."]


def test_a_second_build_reuses_the_epub_and_an_edit_rebuilds_only_its_chapters_audio(tmp_path):
    _, audio, first = build("markdown", tmp_path)
    stamp = first.epub.stat().st_mtime_ns
    again = build("markdown", tmp_path, audio=audio)[2]
    assert again.epub_reused and again.m4as_reused == (0, 1, 2) and again.epub.stat().st_mtime_ns == stamp
    edited = MARKDOWN_BOOK.replace("did not", "never did").encode()
    changed = build("markdown", tmp_path, data=edited, audio=audio)[2]
    assert not changed.epub_reused and changed.m4as_reused == (0, 2)
    with zipfile.ZipFile(changed.epub) as z:
        assert "The second mate never did." in z.read("OEBPS/text/chapter-002.xhtml").decode()


def test_a_manifest_has_no_text_to_read_along():
    with pytest.raises(BadInput, match="no text to read along"):
        Submission(options=BookOptions(epub3=True), book_format="manifest").check()
    manifest = json.dumps({"title": "T", "chapters": [{"title": "One", "segments": [{"tokens": [1, 2, 3]}]}]})
    source = parse_book(manifest.encode(), fmt="manifest")
    with pytest.raises(BadInput, match="no text to read along"):
        readalong_text(source, plan_book(source, voice_id=VOICE))


def test_runs_are_wrapped_inside_the_books_markup_and_widened_only_around_an_element_they_cut():
    from app.books.planning.span_wrap import nonspace, visible, wrap_runs

    xhtml = "http://www.w3.org/1999/xhtml"
    p = etree.fromstring(f'<p xmlns="{xhtml}">He said <em>hello there</em>. Then he left.<br/> The '
                         '<a href="n.xhtml">end. And</a> more.</p>')
    sentences = ["He said hello there.", "Then he left.", "The end.", "And more."]
    marks = [0]
    for s in sentences:
        marks.append(marks[-1] + len(nonspace(s)))
    before = visible(p)
    runs = [(a, b, f"s{n}") for n, (a, b) in enumerate(zip(marks, marks[1:], strict=False), 1)]
    ids = wrap_runs(p, runs, f"{{{xhtml}}}span")
    assert ids == ["s1", "s2", "s3", "s3"]  # "And more." starts inside the link: one span with "The end."
    assert visible(p) == before  # not a character added, lost or moved
    spans = {s.get("id"): "".join(s.itertext()) for s in p.iter(f"{{{xhtml}}}span")}
    assert spans == {"s1": "He said hello there.", "s2": "Then he left.", "s3": "The end. And more."}
    assert p.find(f"{{{xhtml}}}span/{{{xhtml}}}em").text == "hello there"  # the book's markup is kept


def test_an_epub_whose_xhtml_is_not_xml_gets_plain_documents(tmp_path):
    from tests.app.books.conftest import EPUB_DOCS

    broken = [(name, title, body.replace("<p>It began", "<p><br>It began"))
              for name, title, body in EPUB_DOCS]
    data = make_epub(docs=broken)
    source = parse_book(data, fmt="epub")  # the EPUB reader takes HTML as HTML ...
    plan = plan_book(source, voice_id=VOICE)
    assert own_documents(data, source, plan, DEFAULT_LIMITS, tmp_path / "s.zip") is None  # ... XML does not


def test_the_read_along_package_carries_the_books_publication(tmp_path):
    _, _, out = build("epub", tmp_path)  # EPUBCheck passes it in the test of every format above
    with zipfile.ZipFile(out.epub) as z:
        opf = etree.fromstring(z.read(next(n for n in z.namelist() if n.endswith(".opf"))))
    dc = {name: [el.text for el in opf.iter(f"{{http://purl.org/dc/elements/1.1/}}{name}")]
          for name in ("publisher", "date", "identifier", "subject")}
    assert (dc["publisher"], dc["date"]) == (["Lantern House"], ["2019"])
    assert "urn:isbn:9780306406157" in dc["identifier"]
    assert dc["subject"] == ["Fiction", "Fantasy", "Adventure"]


def test_a_books_own_control_characters_are_cleaned_so_its_read_along_epub_is_assembled(tmp_path):
    """A text file may carry a few control characters (under the binary-data share): its title, a chapter
    title and a paragraph with them used to fail the book at assembly (lxml: "All strings must be XML
    compatible"); they are taken out as the book is read."""
    text = ("# The\x01 Quiet\x0c House\n\n## Chapter\x02 One\n\nThe door was open.\x1f Nobody came.\n\n"
            + "The wind rose and the lamps went out. " * 120 + "\n").encode()  # 4 in 4,600 characters
    plan, _, out = build("markdown", tmp_path, data=text)
    assert plan.title == "The Quiet House" and plan.chapters[0].title == "Chapter One"
    assert [m for m in epubcheck(out.epub) if m["severity"] in ("FATAL", "ERROR")] == []
