"""Subtitle books: one segment per cue, each cue's start kept, and timed chapter files that place them."""

import numpy as np
import pytest
import soundfile as sf

from app.books.planning.plan import plan_book
from app.books.reading.parse import parse_book, sniff_format
from app.books.reading.subtitles import parse_subtitles
from app.books.writing.assemble import assemble_chapter
from app.errors import BadInput

VOICE = "ab" * 32
MARA = "a1" * 32
SR = 24000

SRT = b"""1
00:00:01,000 --> 00:00:02,500
Where is <i>everyone</i>?

2
00:00:04,250 --> 00:00:06,000
{\\an8}They left at dawn. All of them.

3
00:00:09,000 --> 00:00:10,000
Then we wait.
"""

VTT = b"""WEBVTT

intro
00:00.500 --> 00:02.000
<v Mara>Is the boat here?</v>

00:03.000 --> 00:04.000 align:left
No. Not yet.
"""


def test_srt_and_vtt_cues_become_one_segment_each_with_their_start():
    book = parse_subtitles(SRT, fmt="srt")
    (chapter,) = book.chapters
    assert chapter.paragraphs == ("Where is everyone?", "They left at dawn. All of them.", "Then we wait.")
    assert chapter.starts_ms == (1000, 4250, 9000)
    plan = plan_book(book, voice_id=VOICE)
    segments = plan.chapters[0].segments
    assert [s.start_ms for s in segments] == [1000, 4250, 9000]  # two sentences, one cue, one segment
    assert segments[1].text == "They left at dawn. All of them."
    assert sniff_format(SRT, "film.srt") == "srt" and sniff_format(VTT) == "vtt"

    vtt = parse_book(VTT)
    assert vtt.chapters[0].starts_ms == (500, 3000)
    voiced = plan_book(vtt, voice_id=VOICE, cast={"mara": MARA})  # <v Mara> is the cue's voice
    assert [(s.text, voiced.voice_of(s), s.start_ms) for s in voiced.chapters[0].segments] == [
        ("Is the boat here?", MARA, 500), ("No. Not yet.", VOICE, 3000)]


@pytest.mark.parametrize(
    ("data", "fmt", "reason"),
    [
        (b"1\n00:00:01,000 --> nonsense\nHi\n", "srt", "not a valid SRT file"),
        (b"WEBVTT\n\n00:01.000 --> 00:02.000\n\n", "vtt", "no cues with text"),
        (b"not webvtt at all\n00:01.000 --> 00:02.000\nHi\n", "vtt", "not a valid WebVTT file"),
    ],
)
def test_bad_subtitles_are_refused_with_the_reason(data, fmt, reason):
    with pytest.raises(BadInput, match=reason):
        parse_subtitles(data, fmt=fmt)


def test_a_timed_chapter_places_each_cue_at_its_start_and_a_late_one_right_after(tmp_path):
    plan = plan_book(parse_subtitles(SRT, fmt="srt"), voice_id=VOICE)
    chapter = plan.chapters[0]
    lengths = [1.0, 5.5, 0.5]  # the second runs past the third cue's start (4.25 + 5.5 > 9.0)
    audio = {}
    for seg, seconds in zip(chapter.segments, lengths, strict=True):
        audio[seg.key] = tmp_path / f"{seg.key[:8]}.wav"
        t = np.arange(round(seconds * SR)) / SR
        sf.write(audio[seg.key], (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), SR)
    timed = assemble_chapter(chapter, audio, tmp_path / "timed.wav", fmt="wav", timed=True)
    starts = [s.start for s in timed.segments]
    assert starts[:2] == pytest.approx([1.0, 4.25], abs=1 / SR)
    assert starts[2] == pytest.approx(4.25 + 5.5, abs=1 / SR)  # late: right after, never cut or sped up
    pcm, _ = sf.read(timed.path, dtype="float32")
    assert not np.any(pcm[: int(0.99 * SR)])  # silence until the first cue's start
    assert np.any(pcm[int(1.01 * SR):int(1.5 * SR)])
    untimed = assemble_chapter(chapter, audio, tmp_path / "plain.wav", fmt="wav")
    assert untimed.segments[0].start == 0.0 and untimed.segments[1].start < 4.25
