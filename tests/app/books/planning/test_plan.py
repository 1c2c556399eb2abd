"""Plan keys: stable across runs, following content only, changing exactly where a paragraph changed."""

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from app.books.planning.plan import BookPlan, plan_book
from app.books.reading.manifest import parse_manifest
from app.books.reading.text import parse_markdown
from app.errors import BadInput
from app.text.segment import SegmentOptions
from tests.app.books.conftest import MARKDOWN_BOOK

VOICE = "ab" * 32
OTHER_VOICE = "cd" * 32


def keys_by_paragraph(plan):
    return [(c.index, s.paragraph, s.key) for c, s in plan.segments()]


def test_plan_has_the_books_chapters_and_segments(markdown_book):
    plan = plan_book(parse_markdown(markdown_book), voice_id=VOICE)
    assert [c.title for c in plan.chapters] == [
        "Chapter 1: The Storm",
        "Chapter 2: The Ship",
        "Chapter 3: Morning",
    ]
    texts = [s.text for s in plan.chapters[0].segments]
    assert texts[:3] == [
        "Chapter one: The Storm",
        "Mister Smith climbed the one hundred thirty-two steps on the third of May, eighteen ninety-five.",
        "The lamp cost twelve dollars and fifty cents.",
    ]
    assert all(len(s.key) == 64 for _, s in plan.segments())
    assert plan.est_seconds == pytest.approx(sum(s.est_tokens for _, s in plan.segments()) / 25)
    assert (
        BookPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    )  # plain data for Celery and the DB


def test_keys_are_stable_across_processes(markdown_book):
    script = (
        "import json, sys; from app.books.reading.text import parse_markdown; "
        "from app.books.planning.plan import plan_book; "
        "p = plan_book(parse_markdown(sys.stdin.buffer.read()), voice_id='ab' * 32); "
        "print(json.dumps([p.key] + p.unique_keys()))"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", script],
            input=markdown_book,
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    plan = plan_book(parse_markdown(markdown_book), voice_id=VOICE)
    assert json.loads(runs[0]) == json.loads(runs[1]) == [plan.key] + plan.unique_keys()


def test_changing_one_paragraph_changes_only_its_segments_keys(markdown_book):
    before = plan_book(parse_markdown(markdown_book), voice_id=VOICE)
    edited = MARKDOWN_BOOK.replace("He checked [the log]", "She checked [the log]").encode()
    after = plan_book(parse_markdown(edited), voice_id=VOICE)
    old, new = keys_by_paragraph(before), keys_by_paragraph(after)
    assert [(c, p) for c, p, _ in old] == [(c, p) for c, p, _ in new]
    changed = [(c, p) for (c, p, k1), (_, _, k2) in zip(old, new, strict=True) if k1 != k2]
    assert changed == [(0, 1)]  # chapter 1, paragraph 2, sentence "He/She checked the log twice."
    assert before.key != after.key


def test_voice_and_options_are_in_the_keys_but_pauses_are_not(markdown_book):
    book = parse_markdown(markdown_book)
    base = plan_book(book, voice_id=VOICE, guide_options={"voice": "en-us"})
    keys = set(base.unique_keys())
    assert keys.isdisjoint(
        plan_book(book, voice_id=OTHER_VOICE, guide_options={"voice": "en-us"}).unique_keys()
    )
    assert keys.isdisjoint(plan_book(book, voice_id=VOICE, guide_options={"voice": "en-gb"}).unique_keys())
    assert keys.isdisjoint(
        plan_book(
            book, voice_id=VOICE, guide_options={"voice": "en-us"}, render_options={"seed": 1}
        ).unique_keys()
    )
    slower = plan_book(
        book,
        voice_id=VOICE,
        guide_options={"voice": "en-us"},
        options=SegmentOptions(sentence_pause_ms=999, chapter_pause_ms=5000),
    )
    assert slower.unique_keys() == base.unique_keys()  # same audio per segment ...
    assert slower.key != base.key  # ... but another assembled book


def test_a_repeated_sentence_is_one_render():
    book = parse_markdown(b"# A\n\nYes. No. Yes.\n\n# B\n\nYes.\n")
    plan = plan_book(book, voice_id=VOICE, options=SegmentOptions(speak_titles=False))
    assert [s.text for _, s in plan.segments()] == ["Yes.", "No.", "Yes.", "Yes."]
    assert len(plan.unique_keys()) == 2


def test_chapter_titles_do_not_enter_content_keys_but_enter_the_book_key():
    book = parse_markdown(b"# A\n\nHello.\n\n# B\n\nWorld.\n")
    a = plan_book(book, voice_id=VOICE, options=SegmentOptions(speak_titles=False))
    renamed = replace(book, chapters=(replace(book.chapters[0], title="Renamed"), book.chapters[1]))
    b = plan_book(renamed, voice_id=VOICE, options=SegmentOptions(speak_titles=False))
    assert a.unique_keys() == b.unique_keys() and a.key != b.key


def test_manifest_segments_key_tokens_and_audio_content(tmp_path):
    (tmp_path / "a.wav").write_bytes(b"first take")
    body = b'{"chapters": [{"segments": [{"tokens": [5, 6, 7]}, {"audio": "a.wav"}]}]}'
    plan = plan_book(parse_manifest(body, base_dir=tmp_path), voice_id=VOICE)
    assert BookPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    tokens, audio = plan.chapters[0].segments
    assert (tokens.kind, tokens.tokens, tokens.est_tokens) == ("tokens", (5, 6, 7), 3)
    assert (audio.kind, audio.audio) == ("audio", "a.wav")
    (tmp_path / "a.wav").write_bytes(b"second take")
    again = plan_book(parse_manifest(body, base_dir=tmp_path), voice_id=VOICE)
    assert again.chapters[0].segments[0].key == tokens.key
    assert again.chapters[0].segments[1].key != audio.key  # the key follows the audio's content


def test_bad_voice_id_is_refused(markdown_book):
    with pytest.raises(BadInput, match="not a sha256 hex digest"):
        plan_book(parse_markdown(markdown_book), voice_id="../../etc")


def test_too_many_segments_is_refused(markdown_book):
    from app.books.reading.source import BookLimits

    with pytest.raises(BadInput, match="more than 5 segments"):
        plan_book(parse_markdown(markdown_book), voice_id=VOICE, limits=BookLimits(max_segments=5))
