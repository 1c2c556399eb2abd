"""assemble_book resumes: unchanged chapters and an unchanged M4B are reused, never trusted blindly."""

import json

import numpy as np
import pytest
import soundfile as sf

from app.books.planning.plan import plan_book
from app.books.reading.text import parse_markdown
from app.books.writing.output import BookOutput, assemble_book
from tests.app.books.conftest import MARKDOWN_BOOK

SR = 24000
VOICE = "ab" * 32


def render(plan, folder, audio=None):
    """Stand-in for the GPU: every segment key not rendered yet becomes a short tone file."""
    audio = dict(audio or {})
    folder.mkdir(exist_ok=True)
    for _, segment in plan.segments():
        if segment.key not in audio:
            n = 4000 + int(segment.key[:3], 16)  # length follows the key
            audio[segment.key] = folder / f"{segment.key}.wav"
            sf.write(audio[segment.key], 0.1 * np.sin(np.arange(n) / 9).astype(np.float32), SR)
    return audio


@pytest.fixture
def first_run(tmp_path):
    plan = plan_book(parse_markdown(MARKDOWN_BOOK.encode()), voice_id=VOICE)
    audio = render(plan, tmp_path / "segments")
    out = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(fmt="flac"))
    return plan, audio, out


def stamps(out):
    return {c.path.name: c.path.stat().st_mtime_ns for c in out.chapters} | {
        "m4b": out.m4b.stat().st_mtime_ns
    }


def test_a_second_run_reuses_every_chapter_and_the_m4b(first_run, tmp_path):
    plan, audio, out = first_run
    assert out.reused == () and not out.m4b_reused
    again = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(fmt="flac"))
    assert again.reused == (0, 1, 2) and again.m4b_reused
    assert stamps(again) == stamps(out)
    assert again.chapters == out.chapters  # timings read back from the sidecars, exactly


def test_editing_one_paragraph_reassembles_only_its_chapter(first_run, tmp_path):
    plan, audio, out = first_run
    edited = plan_book(parse_markdown(MARKDOWN_BOOK.replace("did not", "never did").encode()), voice_id=VOICE)
    again = assemble_book(edited, render(edited, tmp_path / "segments", audio), tmp_path / "out",
                          output=BookOutput(fmt="flac"))
    assert again.reused == (0, 2) and not again.m4b_reused
    assert again.chapters[1].duration != out.chapters[1].duration
    index = json.loads(again.index_json.read_text())
    assert index["chapters"][2]["start"] == pytest.approx(
        again.chapters[0].duration + again.chapters[1].duration, abs=1e-3
    )


def test_a_chapter_without_a_matching_sidecar_is_assembled_again(first_run, tmp_path):
    plan, audio, out = first_run
    (tmp_path / "out" / "chapter-001.flac.json").unlink()  # as if the run died before writing it
    sf.write(out.chapters[2].path, np.zeros(100, np.float32), SR)  # a file that is not what was described
    again = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(fmt="flac"))
    assert again.reused == (1,)
    assert again.chapters[2].samples == out.chapters[2].samples
    assert again.m4b_reused  # the same chapters as before, once rebuilt


def test_a_new_title_reencodes_only_the_m4b(first_run, tmp_path):
    plan, audio, out = first_run
    renamed = plan_book(
        parse_markdown(MARKDOWN_BOOK.replace("Ada Quill", "A. Quill").encode()), voice_id=VOICE
    )
    again = assemble_book(renamed, audio, tmp_path / "out", output=BookOutput(fmt="flac"))
    assert again.reused == (0, 1, 2) and not again.m4b_reused


def test_files_of_chapters_that_no_longer_exist_are_removed(first_run, tmp_path):
    plan, audio, _ = first_run
    shorter = plan_book(parse_markdown(MARKDOWN_BOOK.split("## Chapter 3")[0].encode()), voice_id=VOICE)
    assemble_book(shorter, audio, tmp_path / "out", output=BookOutput(fmt="wav", m4b=False))
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert [n for n in names if n.startswith("chapter-")] == [
        "chapter-001.wav",
        "chapter-001.wav.json",
        "chapter-002.wav",
        "chapter-002.wav.json",
    ]
