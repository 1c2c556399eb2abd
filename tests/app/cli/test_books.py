"""The book commands' own pieces (`app.cli.books`); rendering through them is tested in tests/integration."""

from __future__ import annotations

from app.cli.books import bar_label

TITLE = "The Wreck of the Deutschland, a Long Poem in Two Parts"  # 54 characters


def test_a_title_is_whole_on_its_progress_bar_where_the_terminal_has_room() -> None:
    assert bar_label(TITLE, columns=160) == TITLE


def test_a_title_too_long_for_the_terminal_is_cut_with_an_ellipsis_not_at_24() -> None:
    label = bar_label(TITLE, columns=100)
    assert label.endswith("\u2026") and len(label) == 36 and TITLE.startswith(label[:-1])
    assert len(bar_label(TITLE, columns=40)) == 24  # a narrow terminal still shows a useful part


def test_render_hands_the_chapter_selection_to_the_api_as_its_form_field() -> None:
    from app.cli import build_parser
    from app.cli.books import _form

    args = build_parser().parse_args(["book", "render", "novel.epub", "--voice", "0" * 64,
                                      "--chapters", "3-7,12"])
    assert _form(args)["chapters"] == "3-7,12"
    whole = build_parser().parse_args(["book", "render", "novel.epub", "--voice", "0" * 64])
    assert "chapters" not in _form(whole)


def test_render_hands_narrator_mp3_loudness_and_a_lexicon_file_to_the_api(tmp_path) -> None:
    import pytest

    from app.cli import build_parser
    from app.cli.books import _form
    from app.errors import BadInput

    lexicon = tmp_path / "names.yaml"
    lexicon.write_text("words:\n  Nguyen: {phonemes: \"w'In\"}\n", encoding="utf-8")
    args = build_parser().parse_args(["book", "render", "novel.epub", "--voice", "0" * 64, "--mp3", "--epub3",
                                      "--narrator", "Ben Narrow", "--target-lufs", "off",
                                      "--lexicon", str(lexicon)])
    form = _form(args)
    assert (form["mp3"], form["narrator"], form["target_lufs"]) == ("true", "Ben Narrow", "off")
    assert form["epub3"] == "true"
    acx = _form(build_parser().parse_args(["book", "render", "b.md", "--voice", "0" * 64,
                                           "--mp3-bitrate", "192", "--sample-rate", "44100"]))
    assert (acx["mp3_bitrate_kbps"], acx["sample_rate"]) == ("192", "44100") and "bitrate_kbps" not in acx
    assert form["lexicon"] == lexicon.read_text(encoding="utf-8")
    plain = _form(build_parser().parse_args(["book", "render", "novel.epub", "--voice", "0" * 64]))
    assert plain["mp3"] == plain["epub3"] == "false" and "lexicon" not in plain and "target_lufs" not in plain
    lexicon.write_bytes(b"\xff\xfe bad")
    with pytest.raises(BadInput, match="is not UTF-8 text"):
        _form(args)


def test_a_cast_file_names_voices_by_id_or_by_a_reference_file_that_is_uploaded_once(tmp_path) -> None:
    import pytest

    from app.cli.books import cast_ids
    from app.errors import BadInput
    from tests.support.audio import wav_bytes

    class Api:
        def __init__(self) -> None:
            self.uploads: list[bytes] = []

        def add_voice(self, data: bytes) -> dict:
            self.uploads.append(data)
            return {"id": f"{len(self.uploads):064x}", "notes": []}

    (tmp_path / "voices").mkdir()
    (tmp_path / "voices" / "bob.wav").write_bytes(wav_bytes(freq=330.0))
    cast = tmp_path / "cast.yaml"
    cast.write_text(f"Alice: '{'a1' * 32}'\nBob: voices/bob.wav\n")
    api = Api()
    assert cast_ids(api, cast) == {"alice": "a1" * 32, "bob": f"{1:064x}"}
    assert api.uploads == [wav_bytes(freq=330.0)]  # the file beside the cast, uploaded as Bob's voice
    cast.write_text("Carol: voices/carol.wav\n")
    with pytest.raises(BadInput, match="'carol', 'voices/carol.wav', is neither a voice id nor a reference"):
        cast_ids(api, cast)


def test_book_status_names_its_two_lengths_and_says_how_the_audio_was_made(monkeypatch, capsys) -> None:
    import app.cli.books as cli_books
    from app.cli import build_parser

    note = "rendered with dummy weights (...): the audio is noise, not speech"
    chapter = {"index": 0, "title": "One", "segments_done": 5, "segments_total": 5, "audio_seconds": 17.6,
               "seconds": 25.04, "loudness_lufs": None, "true_peak_dbtp": None}
    book = {"id": "3f0c" * 9, "status": "succeeded", "segments_done": 5, "segments_total": 5,
            "audio_seconds": 17.6, "seconds": 25.04, "eta_s": 0.0, "title": "T", "chapters": [chapter],
            "notes": [note], "error": None}

    worst = {"chapter": 0, "key": "ab" * 32, "attempts": 3, "reasons": ["silence: the clip's level is -inf"],
             "text": "It was a dark night.", "audio": "/v1/jobs/j1/audio"}
    gate_note = "dummy weights: only the signal checks ran (...)"
    quality = {"mode": "report", "totals": {"passed": 4, "rerendered": 0, "failed": 1, "unheard": 0},
               "worst": [worst], "notes": [gate_note]}

    class Api:
        def book(self, book_id):
            return book

        def book_quality(self, book_id):
            assert book_id == book["id"]
            return quality

    monkeypatch.setattr(cli_books, "client", lambda args: Api())
    assert cli_books.cmd_book_status(build_parser().parse_args(["book", "status", book["id"]])) == 0
    printed = capsys.readouterr().out
    assert "17.6 s speech, 25.04 s with pauses (M4B)" in printed
    assert "17.6 s speech (25.04 s with pauses)" in printed and f"note: {note}" in printed
    assert "quality (gate report): 4 passed, 0 re-rendered, 1 failed (kept), 0 not heard" in printed
    assert printed.count(gate_note) == 1 and f"quality note: {gate_note}" in printed
    assert ("chapter 1, segment abababababab, 3 renders: silence: the clip's level is -inf; "
            "'It was a dark night.'  /v1/jobs/j1/audio") in printed


def test_book_preview_asks_for_one_chapters_first_seconds_at_a_high_priority_and_writes_its_file(
        monkeypatch, tmp_path, capsys) -> None:
    import pytest

    import app.cli.books as cli_books
    from app.cli import build_parser
    from app.errors import BadInput

    book = tmp_path / "novel.md"
    book.write_text("# T\n\n## One\n\nHello.\n\n## Two\n\nAgain.\n\n## Three\n\nBye.\n", encoding="utf-8")
    sent: dict = {}

    class Api:
        def submit_book(self, data, name, voice, form, base):
            sent.update(form)
            return {"id": "b" * 36}

        def book(self, book_id):
            return {"id": book_id, "status": "succeeded", "segments_total": 1, "segments_done": 1,
                    "title": "T", "audio_seconds": 1.0, "eta_s": None, "notes": [], "error": None}

        def book_file(self, book_id, name, path):
            path.write_text(name)

    monkeypatch.setattr(cli_books, "client", lambda args: Api())
    out = tmp_path / "p" / "preview.flac"
    args = build_parser().parse_args(["book", "preview", str(book), "--voice", "0" * 64, "--chapter", "3",
                                      "--out", str(out)])
    assert cli_books.cmd_book_preview(args) == 0
    assert (sent["chapters"], sent["preview_s"], sent["priority"], sent["m4b"]) == ("3", "20.0", "5", "false")
    assert out.read_text() == "chapter-001.flac"  # the preview's one chapter file
    args = build_parser().parse_args(["book", "preview", str(book), "--voice", "0" * 64, "--out", "p.mp3"])
    with pytest.raises(BadInput, match=r"\.flac or \.wav"):
        cli_books.cmd_book_preview(args)


def test_book_preview_of_a_chapter_the_book_lacks_fails_before_submitting_with_the_count(
        monkeypatch, tmp_path) -> None:
    import pytest

    import app.cli.books as cli_books
    from app.cli import build_parser
    from app.errors import BadInput

    book = tmp_path / "novel.md"
    book.write_text("# T\n\n## One\n\nHello.\n\n## Two\n\nAgain.\n\n## Three\n\nBye.\n", encoding="utf-8")
    monkeypatch.setattr(cli_books, "client", lambda args: pytest.fail("nothing may be submitted"))
    args = build_parser().parse_args(["book", "preview", str(book), "--voice", "0" * 64, "--chapter", "7",
                                      "--out", str(tmp_path / "p.flac")])
    with pytest.raises(BadInput, match="the book has 3 chapters, so there is no chapter 7"):
        cli_books.cmd_book_preview(args)
    rtf = tmp_path / "novel.rtf"
    rtf.write_bytes(b"{\\rtf1\\ansi Hello.}")
    args = build_parser().parse_args(["book", "preview", str(rtf), "--voice", "0" * 64,
                                      "--out", str(tmp_path / "p.flac")])
    with pytest.raises(BadInput, match=r"a \.rtf file is not a book wavefarm reads; it reads \.txt"):
        cli_books.cmd_book_preview(args)


def test_render_hands_publisher_year_isbn_and_repeated_genres_to_the_api() -> None:
    from app.api.local import _publication
    from app.books.submission import Submission
    from app.cli import build_parser
    from app.cli.books import _form

    args = build_parser().parse_args(["book", "render", "novel.epub", "--voice", "0" * 64,
                                      "--publisher", "Owl Press", "--year", "2021", "--isbn", "0-306-40615-2",
                                      "--genre", "Science Fiction", "--genre", "Space Opera"])
    form = _form(args)
    assert (form["publisher"], form["year"], form["isbn"]) == ("Owl Press", "2021", "0-306-40615-2")
    given = _publication(form)  # as the local client (and the API's form reader) takes them
    assert given["genres"] == ["Science Fiction", "Space Opera"]
    Submission(**given).check()
    plain = _form(build_parser().parse_args(["book", "render", "novel.epub", "--voice", "0" * 64]))
    assert not {"publisher", "year", "isbn", "genres"} & plain.keys() and _publication(plain) == {}


def test_the_preview_defaults_the_parser_shows_are_the_services() -> None:
    from app.books import submission
    from app.cli import books

    assert (books.DEFAULT_PREVIEW_S, books.PREVIEW_PRIORITY) == (submission.DEFAULT_PREVIEW_S,
                                                                  submission.PREVIEW_PRIORITY)
