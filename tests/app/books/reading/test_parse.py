"""Book files -> SourceBook: chapters, order, titles; refusals of bad books with clear reasons."""

import io
import json
import zipfile

import pytest

from app.books.reading.epub import parse_epub
from app.books.reading.manifest import parse_manifest
from app.books.reading.parse import parse_book, sniff_format
from app.books.reading.safezip import SafeArchive
from app.books.reading.source import BookLimits
from app.books.reading.text import parse_markdown, parse_text
from app.errors import BadInput, BadTokens
from tests.app.books.conftest import make_epub, replace_entry, tiny_png


def test_markdown_book_has_three_chapters_in_order_with_heading_titles(markdown_book):
    book = parse_markdown(markdown_book)
    assert (book.title, book.author, book.language) == ("The Lighthouse Keeper", "Ada Quill", "en")
    assert [c.title for c in book.chapters] == [
        "Chapter 1: The Storm",
        "Chapter 2: The Ship",
        "Chapter 3: Morning",
    ]
    first, second, third = book.chapters
    assert first.paragraphs == (
        "Mr. Smith climbed the 132 steps on the 3rd of May, 1895. The lamp cost $12.50.",
        "It was very cold. He checked the log twice.",
    )  # emphasis and link target dropped
    assert second.paragraphs == ("The first mate waved.", "The second mate did not.")  # list items; no code
    assert third.paragraphs == ("Dr. Watson arrived at 7:30, i.e. early. The end.",)


@pytest.mark.timeout(60)
def test_markdown_full_of_unclosed_brackets_comments_and_delimiters_parses_in_linear_time():
    hostile = b"# T\n\n" + b"[" * 3_000_000 + b"<!--" * 500_000 + b"<a" * 500_000 + b"*_`" * 300_000
    with pytest.raises(BadInput, match="characters; the limit is"):  # one giant paragraph, refused at the end
        parse_markdown(hostile)


def test_markdown_without_a_single_title_heading_splits_at_its_top_level():
    book = parse_markdown(b"# One\n\nA.\n\n### deep\n\nB.\n\n# Two\n\nC.\n\nSetext\n======\n\nD.\n")
    assert [c.title for c in book.chapters] == ["One", "Two", "Setext"]
    assert book.chapters[0].paragraphs == ("A.", "deep", "B.")  # deeper headings are read as text


def test_plain_text_starts_chapters_at_chapter_lines():
    text = (
        b"My Novel\n\nCHAPTER I. The Start\n\nFirst line\nwrapped here.\n\nSecond.\n\nChapter 2\n\nThird.\n"
    )
    book = parse_text(text, author="Me")
    assert book.title == "My Novel"
    assert [c.title for c in book.chapters] == ["CHAPTER I. The Start", "Chapter 2"]
    assert book.chapters[0].paragraphs == ("First line wrapped here.", "Second.")


def test_plain_text_without_blank_lines_has_one_paragraph_per_line():
    book = parse_text(b"Line one.\nLine two.\r\nLine three.", title="T")
    assert book.chapters[0].paragraphs == ("Line one.", "Line two.", "Line three.")


def test_epub_chapters_follow_the_spine_with_titles_from_the_nav_document(epub_book):
    book = parse_epub(epub_book)
    assert (book.title, book.author, book.language) == ("The Clockmaker Tales", "Ida North", "en-gb")
    assert [c.title for c in book.chapters] == [
        "Title Page",
        "Chapter One: Dusk",
        "Chapter Two: Dawn",
        "Chapter Three: Noon",
    ]
    assert book.chapters[1].paragraphs == ("It began at dusk.", "The clocks all stopped\u2014every one.")
    assert book.chapters[2].paragraphs == ("Morning came late.",)  # split at the #c3 fragment
    assert book.chapters[3].paragraphs == ("Then it was noon.",)
    assert book.cover == tiny_png() and book.cover_type == "image/png"


def test_epub_spine_order_wins_and_a_document_listed_twice_is_read_once():
    book = parse_epub(make_epub(spine=[0, 2, 1, 2, 2]))
    assert [c.title for c in book.chapters] == [
        "Title Page",
        "Chapter Two: Dawn",
        "Chapter Three: Noon",
        "Chapter One: Dusk",
    ]


OPF_NS = 'xmlns:opf="http://www.idpf.org/2007/opf"'


def test_epub_narrator_and_description_come_from_the_package_document():
    epub2 = make_epub(
        opf_extra=(
            f'<dc:contributor {OPF_NS} opf:role="nrt">Ben  Narrow</dc:contributor>'
            f'<dc:contributor {OPF_NS} opf:role="ill">Ink Hand</dc:contributor>'
            "<dc:description>&lt;p&gt;Three &lt;b&gt;tales&lt;/b&gt; of clocks.&lt;/p&gt;"
            "&lt;p&gt;And one of a bell &amp;amp; its keeper.&lt;/p&gt;</dc:description>"
        )
    )
    book = parse_epub(epub2)
    assert book.author == "Ida North" and book.narrator == "Ben Narrow"
    assert book.description == "Three tales of clocks.\nAnd one of a bell & its keeper."
    epub3 = make_epub(  # EPUB 3: roles refine the element by id; a creator who narrates is not the author
        opf_extra='<dc:creator id="n1">Cara Voice</dc:creator>'
        '<meta refines="#n1" property="role" scheme="marc:relators">nrt</meta>'
    )
    book = parse_epub(epub3)
    assert book.author == "Ida North" and book.narrator == "Cara Voice" and book.description == ""


def test_markdown_and_manifest_carry_a_narrator_and_a_description():
    md = b"---\ntitle: T\nnarrator: Ben Narrow\ndescription: A short one.\n---\n# One\n\nText here."
    book = parse_markdown(md)
    assert (book.narrator, book.description) == ("Ben Narrow", "A short one.")
    manifest = {"title": "M", "narrator": "N", "description": "Line one.\n\n  Line   two.",
                "chapters": [{"segments": [{"tokens": [1, 2]}]}]}
    book = parse_manifest(json.dumps(manifest).encode())
    assert (book.narrator, book.description) == ("N", "Line one.\nLine two.")
    too_long = {**manifest, "description": "x" * 10_001}
    with pytest.raises(BadInput, match="the description is 10001 characters"):
        parse_manifest(json.dumps(too_long).encode())


def test_epub_without_any_text_is_refused():
    docs = [("a.xhtml", "A", "<p>  </p><img src='x.png'/>"), ("b.xhtml", "B", "<script>x = 1</script>")]
    with pytest.raises(BadInput, match="no text to read"):
        parse_epub(make_epub(docs=docs, toc=[("a.xhtml", "A"), ("b.xhtml", "B")]))


def test_epub_with_encrypted_chapters_is_refused_as_drm():
    encryption = (
        b'<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
        b'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData><enc:CipherData>'
        b'<enc:CipherReference URI="OEBPS/text/zz_first.xhtml"/>'
        b"</enc:CipherData></enc:EncryptedData></encryption>"
    )
    with pytest.raises(BadInput, match="DRM-protected"):
        parse_epub(make_epub(extra={"META-INF/encryption.xml": encryption}))
    fonts_only = encryption.replace(b"text/zz_first.xhtml", b"fonts/serif.otf")
    assert len(parse_epub(make_epub(extra={"META-INF/encryption.xml": fonts_only})).chapters) == 4


def test_epub_documents_in_a_declared_legacy_encoding_are_decoded():
    body = "<p>Caf\u00e9 cr\u00e8me \u2014 fin.</p>"
    docs = [("a.xhtml", "A", body)]
    epub = make_epub(docs=docs, toc=[("a.xhtml", "A")])
    xhtml = '<?xml version="1.0" encoding="windows-1252"?><html><body>' + body + "</body></html>"
    epub = replace_entry(epub, "OEBPS/text/a.xhtml", xhtml.encode("cp1252"))
    assert parse_epub(epub).chapters[0].paragraphs == ("Caf\u00e9 cr\u00e8me \u2014 fin.",)


def test_epub2_titles_come_from_toc_ncx_when_there_is_no_nav():
    book = parse_epub(make_epub(nav=False))
    assert [c.title for c in book.chapters][1:] == [
        "Chapter One: Dusk",
        "Chapter Two: Dawn",
        "Chapter Three: Noon",
    ]
    assert book.cover is None


def test_sniff_format_and_parse_book_dispatch(markdown_book, epub_book):
    assert sniff_format(epub_book) == "epub"
    assert sniff_format(markdown_book, "book.md") == "markdown"
    assert sniff_format(b'{"chapters": []}') == "manifest"
    assert sniff_format(b"plain") == "text"
    assert len(parse_book(epub_book).chapters) == 4
    with pytest.raises(BadInput, match="not one of"):
        parse_book(b"x", fmt="odt")


@pytest.mark.parametrize("fmt", ["text", "markdown", "manifest", "epub"])
def test_empty_book_is_refused(fmt):
    with pytest.raises(BadInput, match="empty"):
        parse_book(b"", fmt=fmt)


def test_language_must_be_a_language_tag():
    assert parse_text(b"Hallo.", title="T", language="de_AT").language == "de-at"
    with pytest.raises(BadInput, match="not a language tag"):
        parse_text(b"Hello.", title="T", language="../voices/x")
    with pytest.raises(BadInput, match="not a language tag"):
        parse_markdown(b"---\nlanguage: en us\n---\n# A\n\nHello.\n")


def test_whitespace_only_and_heading_only_books_have_no_text():
    with pytest.raises(BadInput, match="empty"):
        parse_text(b"   \n\n  ")
    with pytest.raises(BadInput, match="no text to read"):
        parse_markdown(b"# Title\n\n## Chapter\n")


def test_binary_junk_is_refused():
    junk = bytes(range(256)) * 64
    with pytest.raises(BadInput, match="not UTF-8 text"):
        parse_text(junk)
    with pytest.raises(BadInput, match="binary data"):
        parse_text(b"text\x00\x01\x02\x03\x04" * 100)


def test_a_50_mb_single_paragraph_is_refused_by_size_before_parsing():
    with pytest.raises(BadInput, match=r"is 52428800 bytes; the limit is 16777216"):
        parse_text(b"a" * (50 * 1024 * 1024))


def test_an_over_long_paragraph_under_the_byte_limit_names_its_paragraph():
    with pytest.raises(
        BadInput, match=r"paragraph 2 of chapter 1 .* is 200004 characters; the limit is 100000"
    ):
        parse_text(b"Short.\n\n" + b"word " * 40000 + b"end.", title="Long")


def test_broken_epub_is_refused():
    good = make_epub()
    with pytest.raises(BadInput, match="zip container is broken"):
        parse_epub(good[: len(good) // 2])
    with pytest.raises(BadInput, match="zip container is broken"):
        parse_epub(b"PK\x03\x04 not really a zip")


def test_epub_missing_its_container_or_spine_is_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("mimetype", "application/epub+zip")
    with pytest.raises(BadInput, match="META-INF/container.xml' is missing"):
        parse_epub(buf.getvalue())


def test_epub_zip_bomb_is_refused_before_inflating():
    bomb = make_epub(extra={"OEBPS/bomb.xhtml": b"\0" * (8 * 1024 * 1024)})  # 8 MiB -> ~8 KiB
    with pytest.raises(
        BadInput, match=r"compressed \d+:1; the limit is 100:1 \(refused as a possible zip bomb\)"
    ):
        parse_epub(bomb)
    with pytest.raises(BadInput, match="unpacks to .* bytes; the limit is 1000000 .*zip bomb"):
        parse_epub(bomb, limits=BookLimits(epub_max_unpacked=1_000_000))


def test_epub_xml_entity_declarations_are_refused():
    laughs = b'<!DOCTYPE x [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">]><x>&b;</x>'
    with pytest.raises(BadInput, match="toc.ncx' declares XML entities"):
        parse_epub(replace_entry(make_epub(nav=False), "OEBPS/toc.ncx", laughs))


def test_epub_with_a_corrupt_entry_is_refused():
    epub = make_epub()
    start = epub.index(b"OEBPS/text/zz_first.xhtml") + len("OEBPS/text/zz_first.xhtml")
    corrupt = epub[: start + 4] + bytes(b ^ 0xFF for b in epub[start + 4 : start + 40]) + epub[start + 40 :]
    with pytest.raises(BadInput, match="zz_first.xhtml' cannot be unpacked"):
        parse_epub(corrupt)


def test_manifest_over_the_api_carries_tokens_inline():
    book = parse_manifest(
        b'{"title": "T", "chapters": [{"title": "A", "segments": [{"tokens": [1, 2, 6560]}]},'
        b'{"segments": [{"tokens": [0]}]}]}'
    )
    assert [c.title for c in book.chapters] == ["A", "Chapter 2"]
    assert book.chapters[0].items[0].tokens == (1, 2, 6560)


def test_manifest_over_the_api_refuses_audio_paths():
    with pytest.raises(BadInput, match="over the API carry speech tokens inline only"):
        parse_manifest(b'{"chapters": [{"segments": [{"audio": "/etc/passwd"}]}]}')


@pytest.mark.parametrize(
    "body, error, message",
    [
        (b'{"chapters": [{"segments": [{"tokens": [6561]}]}]}', BadTokens, "not an integer in 0..6560"),
        (b'{"chapters": [{"segments": [{"tokens": [1.5]}]}]}', BadTokens, "not an integer"),
        (b'{"chapters": [{"segments": [{"tokens": []}]}]}', BadTokens, "non-empty list"),
        (b'{"chapters": [{"segments": [{"tokens": [1], "path": "x"}]}]}', BadInput, "unknown keys"),
        (b'{"chapters": []}', BadInput, "non-empty 'chapters'"),
        (b'{"chapters": [', BadInput, "not valid JSON"),
        (b"[1, 2]", BadInput, "must be a JSON object"),
        (b"[" * 100_000 + b"]" * 100_000, BadInput, "not acceptable JSON: RecursionError"),
        (b'{"title": ' + b"9" * 5000 + b"}", BadInput, "not acceptable JSON"),
    ],
)
def test_malformed_manifests_say_what_is_wrong(body, error, message):
    with pytest.raises(error, match=message):
        parse_manifest(body)


def test_manifest_from_the_cli_resolves_audio_inside_its_folder(tmp_path):
    (tmp_path / "ch1").mkdir()
    (tmp_path / "ch1" / "a.wav").write_bytes(b"RIFF-ish")
    (tmp_path.parent / "outside.wav").write_bytes(b"secret")
    book = parse_manifest(
        b'{"chapters": [{"segments": [{"audio": "ch1/a.wav"}, {"tokens": [3]}]}]}', base_dir=tmp_path
    )
    item = book.chapters[0].items[0]
    assert item.audio == "ch1/a.wav" and len(item.audio_sha256 or "") == 64
    (tmp_path / "link.wav").symlink_to(tmp_path.parent / "outside.wav")
    for bad, message in [
        ("../outside.wav", "without '..'"),
        ("/etc/passwd", "without '..'"),
        ("link.wav", "outside the manifest's folder"),
        ("nope.wav", "does not exist"),
    ]:
        body = json.dumps({"chapters": [{"segments": [{"audio": bad}]}]}).encode()
        with pytest.raises(BadInput, match=message):
            parse_manifest(body, base_dir=tmp_path)


def test_reading_one_entry_many_times_counts_against_the_unpacked_limit():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("a.xhtml", b"x" * 1000)
    archive = SafeArchive(buf.getvalue(), BookLimits(epub_max_unpacked=2500))
    archive.read("a.xhtml")
    archive.read("a.xhtml")
    with pytest.raises(BadInput, match="unpacks more than 2500 bytes"):
        archive.read("a.xhtml")
