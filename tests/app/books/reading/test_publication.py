"""Publisher, year, ISBN and genres: read from an EPUB's package document and a DOCX's core properties,
given or overridden by a request (checked), and written where Audiobookshelf reads them: the M4B's and
MP3s' tags as FFmpeg (Audiobookshelf's ffprobe) reads them back, and metadata.json."""

import json

import av
import pytest

from app.books.intake_child import ChildLimits, ParseJob, plan_submission
from app.books.planning.plan import BookPlan, plan_book
from app.books.reading.epub import parse_epub
from app.books.reading.publication import Publication, check_isbn
from app.books.reading.text import parse_markdown
from app.books.reading.word import parse_docx
from app.books.submission import BookOptions, Submission, SubmittedFiles
from app.books.writing.output import BookOutput, assemble_book
from app.errors import BadInput
from tests.app.books.conftest import MARKDOWN_BOOK, make_docx, make_epub
from tests.app.books.writing.test_output import VOICE, render

OPF_NS = 'xmlns:opf="http://www.idpf.org/2007/opf"'
PUBLISHED = (
    f'<dc:identifier {OPF_NS} opf:scheme="UUID">urn:uuid:5f0c7a52-0000-4000-8000-000000000001</dc:identifier>'
    "<dc:identifier>urn:isbn:9780306406158</dc:identifier>"  # its check digit fails: left out
    f'<dc:identifier {OPF_NS} opf:scheme="ISBN">978-0-306-40615-7</dc:identifier>'
    "<dc:publisher>Lantern House</dc:publisher><dc:date>2019-03-01</dc:date>"
    "<dc:subject>Fiction / Fantasy</dc:subject><dc:subject>Adventure</dc:subject>"
)
GUIDE = {"voice": "guide", "v": 1}  # the guide voice's identity, as a parent hands it to the child


def test_an_epub_gives_its_publisher_year_isbn_and_subjects_as_genres():
    book = parse_epub(make_epub(opf_extra=PUBLISHED))
    assert book.publication == Publication("Lantern House", "2019", "9780306406157",
                                           ("Fiction", "Fantasy", "Adventure"))
    prefixed = parse_epub(make_epub(opf_extra="<dc:identifier>urn:isbn:0-306-40615-2</dc:identifier>"
                                    "<dc:date>not a date</dc:date>"))
    assert (prefixed.publication.isbn, prefixed.publication.year) == ("0306406152", "")
    refined = parse_epub(make_epub(  # EPUB 3: an identifier typed by a refinement (ONIX list 5: 15 ISBN-13)
        opf_extra='<dc:identifier id="pub-id">9780306406157</dc:identifier>'
        '<meta refines="#pub-id" property="identifier-type" scheme="onix:codelist5">15</meta>'
        '<dc:identifier id="other">9780306406157</dc:identifier>'))
    assert refined.publication.isbn == "9780306406157"
    untyped = parse_epub(make_epub(opf_extra="<dc:identifier>9780306406157</dc:identifier>"))
    assert untyped.publication.isbn == ""  # a bare number is not known to be an ISBN
    plain = parse_epub(make_epub())
    assert plain.publication == Publication()


def test_a_docx_gives_an_isbn_and_genres_from_its_core_properties():
    data = make_docx([("Heading 1", "One"), ("", "Text.")],
                     core={"identifier": "ISBN 0-8044-2957-X", "category": "Mystery, Crime"})
    assert parse_docx(data).publication == Publication(isbn="080442957X", genres=("Mystery", "Crime"))
    data = make_docx([("Heading 1", "One"), ("", "Text.")], core={"identifier": "report-7"})
    assert parse_docx(data).publication == Publication()


def _assembled(plan: BookPlan, tmp_path):
    out = assemble_book(plan, render(plan, tmp_path / "segments"), tmp_path / "out",
                        output=BookOutput(mp3=True))
    with av.open(str(out.m4b)) as box:
        m4b = {k.lower(): v for k, v in box.metadata.items()}
    with av.open(str(out.mp3s[0])) as box:
        mp3 = {k.lower(): v for k, v in box.metadata.items()}
    return m4b, mp3, json.loads((out.m4b.parent / "metadata.json").read_text())


def test_an_epubs_publication_reads_back_from_the_m4b_the_mp3s_and_metadata_json(tmp_path):
    plan = plan_book(parse_epub(make_epub(opf_extra=PUBLISHED)), voice_id=VOICE)
    m4b, mp3, meta = _assembled(plan, tmp_path)
    for tags in (m4b, mp3):  # Audiobookshelf: publisher, date (its publishedYear), isbn, genre split at ";"
        assert (tags["publisher"], tags["date"], tags["isbn"]) == ("Lantern House", "2019", "9780306406157")
        assert tags["genre"].split(";") == ["Fiction", "Fantasy", "Adventure"]
    assert (meta["publisher"], meta["publishedYear"], meta["isbn"]) == ("Lantern House", "2019",
                                                                        "9780306406157")
    assert meta["genres"] == ["Fiction", "Fantasy", "Adventure"]


def test_a_book_without_genres_keeps_the_audiobook_genre_and_no_date(tmp_path):
    plan = plan_book(parse_markdown(MARKDOWN_BOOK.encode()), voice_id=VOICE)
    m4b, mp3, meta = _assembled(plan, tmp_path)
    assert m4b["genre"] == mp3["genre"] == "Audiobook" and meta["genres"] == ["Audiobook"]
    assert not {"date", "publisher", "isbn"} & (m4b.keys() | mp3.keys())
    assert (meta["publisher"], meta["publishedYear"], meta["isbn"]) == (None, None, None)


def _planned(tmp_path, data: bytes, submission: Submission) -> BookPlan:
    """The child's own reading of a stored upload (`app.books.intake_child`), with what the request gave."""
    folder = tmp_path / "book"
    folder.mkdir(parents=True)
    (folder / "source").write_bytes(data)
    job = ParseJob(folder=str(folder), voice_id=VOICE, render_options={}, limits=ChildLimits(60, 2048, 64),
                   max_timed_span_s=3600, lexicon_budget_s=5, guide=GUIDE)
    submission.check()
    return plan_submission(SubmittedFiles(folder), submission, job)[0]


def test_a_requests_publication_overrides_the_books_own_and_reads_back(tmp_path):
    given = Submission(filename="b.epub", publisher="  Owl   Press ", year="2021", isbn="0-306-40615-2",
                       genres=["Science Fiction", "Space Opera", "Science Fiction"])
    plan = _planned(tmp_path, make_epub(opf_extra=PUBLISHED), given)
    assert plan.publication == Publication("Owl Press", "2021", "0306406152",
                                           ("Science Fiction", "Space Opera"))
    stored = BookPlan.from_dict(json.loads(json.dumps(plan.to_dict())))  # plan.json, as assembly reads it
    assert stored.publication == plan.publication
    m4b, mp3, meta = _assembled(stored, tmp_path)
    for tags in (m4b, mp3):
        assert (tags["publisher"], tags["date"], tags["isbn"]) == ("Owl Press", "2021", "0306406152")
        assert tags["genre"].split(";") == ["Science Fiction", "Space Opera"]
    assert (meta["publisher"], meta["publishedYear"], meta["genres"]) == ("Owl Press", "2021",
                                                                          ["Science Fiction", "Space Opera"])
    only_year = _planned(tmp_path / "2", make_epub(opf_extra=PUBLISHED), Submission(year="1999"))
    assert only_year.publication == Publication("Lantern House", "1999", "9780306406157",
                                                ("Fiction", "Fantasy", "Adventure"))


@pytest.mark.parametrize(("fields", "reason"), [
    ({"year": "99"}, "four digits"),
    ({"year": "3000"}, "four digits, 1000 to 2100"),
    ({"year": "2019-03"}, "four digits"),
    ({"isbn": "978-0-306-40615-8"}, "check digit does not match"),
    ({"isbn": "0-306-40615-3"}, "check digit does not match"),
    ({"isbn": "123-4567"}, "10 or 13 digits"),
    ({"isbn": "1" * 41}, "the limit is 40"),
    ({"genres": ["Fantasy/Horror"]}, "holds '/' or ';'"),
    ({"genres": ["x" * 101]}, "the limit is 100"),
    ({"genres": [f"Genre {i}" for i in range(21)]}, "21 genres; the limit is 20"),
    ({"publisher": "p" * 501}, "the limit is 500"),
])
def test_a_publication_no_player_could_use_is_refused_with_the_reason(fields, reason):
    with pytest.raises(BadInput, match=reason):
        Submission(options=BookOptions(), **fields).check()


def test_isbns_as_people_write_them_are_read_to_their_digits():
    assert check_isbn("ISBN 978-0-306-40615-7") == check_isbn("9780306406157") == "9780306406157"
    assert check_isbn("0 8044 2957 x") == "080442957X"
    with pytest.raises(BadInput, match="check digit"):
        check_isbn("9790306406157")  # a 979 prefix with 978's check digit
