"""Assembly: chapter files with pauses, loudness, an M4B read back with PyAV, JSON + WebVTT timings."""

import json
import math
import re
from pathlib import Path

import av
import mutagen.id3
import mutagen.mp3
import mutagen.mp4
import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from app.books.planning.plan import PlanChapter, PlanSegment, plan_book
from app.books.reading.text import parse_markdown
from app.books.writing import loudness
from app.books.writing.assemble import BookTags, assemble_chapter, write_m4b, write_mp3
from app.books.writing.index import write_index
from app.books.writing.output import BookOutput, assemble_book
from app.errors import NotFound
from app.text.segment import SegmentOptions
from tests.app.books.conftest import tiny_png

SR = 24000
TAGS = BookTags(
    "The Lighthouse Keeper", "Ada Quill", "Ben Narrow", "A keeper, a storm.\nAnd a boat that came back."
)
AAC_FRAME = 1024 / SR  # one AAC frame, the tolerance on read-back times


def tone(seconds: float, freq: float, sr: int = SR, amp: float = 0.2) -> np.ndarray:
    t = np.arange(int(round(seconds * sr))) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.fixture
def rendered(markdown_book, tmp_path):
    """The 3-chapter book planned and every segment 'rendered' as a tone of a known length."""
    plan = plan_book(
        parse_markdown(markdown_book),
        voice_id="ab" * 32,
        options=SegmentOptions(sentence_pause_ms=250, paragraph_pause_ms=500, chapter_pause_ms=1000),
    )
    audio, lengths = {}, {}
    for i, key in enumerate(plan.unique_keys()):
        lengths[key] = 0.4 + 0.1 * i
        path = tmp_path / "segments" / f"{key}.wav"
        path.parent.mkdir(exist_ok=True)
        sf.write(path, tone(lengths[key], 200 + 20 * i), SR)
        audio[key] = path
    return plan, audio, lengths


def test_chapter_is_segments_and_pauses_back_to_back(rendered, tmp_path):
    plan, audio, lengths = rendered
    chapter = plan.chapters[0]
    out = assemble_chapter(chapter, audio, tmp_path / "ch1.flac", fmt="flac")
    expected = sum(lengths[s.key] + s.pause_after_ms / 1000 for s in chapter.segments)
    assert out.duration == pytest.approx(expected, abs=1 / SR * len(chapter.segments))
    pcm, rate = sf.read(out.path, dtype="float32")
    assert rate == SR and len(pcm) == out.samples
    cursor = 0.0
    for timing, segment in zip(out.segments, chapter.segments, strict=True):
        assert timing.start == pytest.approx(cursor, abs=1e-3)
        assert timing.end - timing.start == pytest.approx(lengths[segment.key], abs=1e-3)
        cursor = timing.end + segment.pause_after_ms / 1000
        gap = pcm[int(timing.end * SR) + 2 : int(cursor * SR) - 2]
        assert np.abs(gap).max() < 1e-3  # the pause is silence (FLAC is 16-bit)
        assert np.abs(pcm[int(timing.start * SR) : int(timing.end * SR)]).max() > 0.1
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".part"] == []


def test_segments_at_other_rates_and_channels_are_converted(rendered, tmp_path):
    plan, audio, lengths = rendered
    key = plan.chapters[2].segments[0].key
    sf.write(audio[key], np.stack([tone(lengths[key], 300, 16000)] * 2, axis=1), 16000)
    out = assemble_chapter(plan.chapters[2], audio, tmp_path / "ch3.wav", fmt="wav")
    assert out.segments[0].end == pytest.approx(lengths[key], abs=1e-3)


def test_a_missing_segment_is_named(rendered, tmp_path):
    plan, audio, _ = rendered
    missing = plan.chapters[1].segments[1].key
    del audio[missing]
    with pytest.raises(
        NotFound, match=rf"segment 2 of chapter 2 \(key {missing[:12]}\) has no rendered audio"
    ):
        assemble_chapter(plan.chapters[1], audio, tmp_path / "ch2.wav", fmt="wav")
    assert not (tmp_path / "ch2.wav").exists()


def test_loudness_is_normalised_to_the_target_under_the_true_peak_ceiling():
    quiet = tone(3.0, 440, amp=0.01)
    louder, figures = loudness.normalise(quiet, SR, -20.0)
    measured = pyloudnorm.Meter(SR).integrated_loudness(louder.astype(np.float64))
    assert measured == pytest.approx(-20.0, abs=0.1)
    assert figures.integrated_lufs == pytest.approx(measured, abs=1e-6)
    assert figures.gain_db == pytest.approx(-20.0 - loudness.integrated_loudness(quiet, SR), abs=1e-6)
    hot, hot_figures = loudness.normalise(quiet, SR, 0.0)  # would need a peak far above full scale
    assert hot_figures.true_peak_dbtp == pytest.approx(-1.0, abs=0.01)
    assert hot_figures.integrated_lufs < -1.0
    silence = np.zeros(SR, np.float32)
    same, nothing = loudness.normalise(silence, SR, -20.0)
    assert same is silence and nothing.integrated_lufs == nothing.true_peak_dbtp == -math.inf
    assert nothing.as_dict() == {"integrated_lufs": None, "true_peak_dbtp": None, "gain_db": 0.0}


def test_true_peak_finds_the_peak_between_samples():
    """A sine at a quarter of the rate, sampled 45 degrees off its crests: every sample is at 0.707 of
    the amplitude, the waveform between them reaches 1.0 (BS.1770-4's reason for oversampling)."""

    def sine(samples):  # tapered over its first and last 10 ms: an abrupt start would ring past 0.5
        n = np.arange(samples)
        return loudness.fade_edges(0.5 * np.sin(2 * np.pi * (SR / 4) * n / SR + np.pi / 4), SR, 10.0)

    wave = sine(SR)
    middle = wave[SR // 10 : -SR // 10]
    assert 20 * math.log10(np.abs(middle).max()) == pytest.approx(
        20 * math.log10(0.5 / math.sqrt(2)), abs=0.01
    )
    assert 20 * math.log10(np.abs(wave).max()) < -9.0  # every sample well under the waveform's crest
    assert loudness.true_peak(wave, SR) == pytest.approx(20 * math.log10(0.5), abs=0.05)
    long = sine(12 * SR)  # across several oversampling blocks: the same figure, no edge effects
    assert loudness.true_peak(long, SR) == pytest.approx(loudness.true_peak(wave, SR), abs=0.01)


def _largest_step(wave: np.ndarray) -> float:
    return float(np.abs(np.diff(wave.astype(np.float64))).max())


def test_joins_between_segments_do_not_click(tmp_path):
    """Segments that start and end at a crest (the worst case: a step of the full amplitude where they
    meet a pause or each other) are faded: no sample-to-sample step at a join is larger than the
    largest step inside the segments' own waveform."""

    def crest_tone(seconds, freq):  # a cosine: it starts at +amp; the length puts its end at a crest too
        t = np.arange(int(round(seconds * SR))) / SR
        return (0.5 * np.cos(2 * np.pi * freq * t)).astype(np.float32)

    waves = [crest_tone(0.5, 150), crest_tone(0.4, 200), crest_tone(0.6, 120)]
    chapter = PlanChapter(
        0,
        "One",
        tuple(
            PlanSegment(
                key=f"{i:064x}",
                kind="tokens",
                text="",
                tokens=(1,),
                audio=None,
                est_tokens=10,
                pause_after_ms=pause,
                paragraph=i,
            )
            for i, pause in enumerate((0, 300, 0))
        ),
    )
    audio = {}
    for seg, wave in zip(chapter.segments, waves, strict=True):
        audio[seg.key] = tmp_path / f"{seg.key[-4:]}.wav"
        sf.write(audio[seg.key], wave, SR, subtype="FLOAT")
    inside = max(_largest_step(w) for w in waves)
    joins = np.cumsum(
        [0]
        + [len(w) + round(s.pause_after_ms * SR / 1000) for w, s in zip(waves, chapter.segments, strict=True)]
    )
    for fade_ms, expect_click in ((0.0, True), (loudness.FADE_MS, False)):
        out = assemble_chapter(
            chapter, audio, tmp_path / f"ch-{fade_ms}.wav", fmt="wav", target_lufs=None, fade_ms=fade_ms
        )
        pcm, _ = sf.read(out.path, dtype="float32")
        window = 2 * round(loudness.FADE_MS * SR / 1000)
        at_joins = max(_largest_step(pcm[max(0, j - window) : j + window]) for j in joins[:-1])
        at_joins = max(at_joins, abs(float(pcm[0])), abs(float(pcm[-1])))  # the file's own two edges
        if expect_click:  # without fades the step is the whole amplitude: the test can see a click
            assert at_joins > 0.45
        else:
            assert at_joins <= inside * 1.01, (at_joins, inside)
        assert out.samples == joins[-1]  # fades change no length


def test_chapters_are_normalised_by_default_and_measured_either_way(rendered, tmp_path):
    plan, audio, _ = rendered
    chapter = plan.chapters[0]
    default = assemble_chapter(chapter, audio, tmp_path / "default.flac")
    pcm, _ = sf.read(default.path, dtype="float64")
    assert pyloudnorm.Meter(SR).integrated_loudness(pcm) == pytest.approx(
        loudness.DEFAULT_TARGET_LUFS, abs=0.2
    )
    assert default.loudness.integrated_lufs == pytest.approx(loudness.DEFAULT_TARGET_LUFS, abs=0.2)
    assert default.loudness.true_peak_dbtp <= loudness.TRUE_PEAK_CEILING_DBTP + 0.01
    off = assemble_chapter(chapter, audio, tmp_path / "off.flac", target_lufs=None)
    raw, _ = sf.read(off.path, dtype="float64")
    assert off.loudness.gain_db == 0.0
    assert off.loudness.integrated_lufs == pytest.approx(
        pyloudnorm.Meter(SR).integrated_loudness(raw), abs=0.01
    )
    assert abs(default.loudness.gain_db) > 0.1  # one gain is the whole difference between the two
    np.testing.assert_allclose(pcm, raw * 10 ** (default.loudness.gain_db / 20), atol=1e-4)


def test_m4b_has_the_chapters_times_and_metadata_of_its_inputs(rendered, tmp_path):
    plan, audio, _ = rendered
    chapters = [
        assemble_chapter(c, audio, tmp_path / f"ch{c.index + 1}.flac", target_lufs=-18.0)
        for c in plan.chapters
    ]
    book = tmp_path / "book.m4b"
    write_m4b(
        chapters,
        book,
        tags=TAGS,
        cover=tiny_png(),
        cover_type="image/png",
    )
    tagged = mutagen.mp4.MP4(book).tags  # read by another library than the one that wrote it
    assert tagged["\xa9nam"] == tagged["\xa9alb"] == ["The Lighthouse Keeper"]
    assert tagged["\xa9ART"] == tagged["aART"] == ["Ada Quill"]
    assert tagged["\xa9wrt"] == ["Ben Narrow"]  # the narrator, as audiobook players read it
    assert tagged["desc"] == tagged["\xa9cmt"] == [TAGS.description]
    assert tagged["\xa9gen"] == ["Audiobook"]
    assert bytes(tagged["covr"][0]) == tiny_png()
    with av.open(str(book)) as box:
        marks = box.chapters()
        assert box.metadata["title"] == "The Lighthouse Keeper" and box.metadata["artist"] == "Ada Quill"
        assert box.metadata["major_brand"].strip() == "M4B"
        assert [m["metadata"]["title"] for m in marks] == [c.title for c in plan.chapters]
        start = 0.0
        for mark, chapter in zip(marks, chapters, strict=True):
            tb = mark["time_base"]
            assert float(mark["start"] * tb) == pytest.approx(start, abs=AAC_FRAME)
            assert float((mark["end"] - mark["start"]) * tb) == pytest.approx(chapter.duration, abs=AAC_FRAME)
            start += chapter.duration
        stream = box.streams.audio[0]
        assert stream.codec_context.name == "aac" and stream.sample_rate == SR
        assert float(stream.duration * stream.time_base) == pytest.approx(start, abs=AAC_FRAME)
        for chapter in chapters:  # each chapter was normalised to -18 LUFS before encoding
            pcm, _ = sf.read(chapter.path, dtype="float64")
            assert pyloudnorm.Meter(SR).integrated_loudness(pcm) == pytest.approx(-18.0, abs=0.2)
        picture = box.streams.video[0]
        assert picture.disposition & av.stream.Disposition.attached_pic
        assert bytes(next(p for p in box.demux(picture) if p.size)) == tiny_png()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "book.m4b",
        "ch1.flac",
        "ch2.flac",
        "ch3.flac",
    ]  # no temp files left


def parse_vtt(text: str) -> list[tuple[str, float, float, str]]:
    def seconds(stamp: str) -> float:
        h, m, s = stamp.split(":")
        return int(h) * 3600 + int(m) * 60 + float(s)

    cues = re.findall(r"^(c\d+-s\d+)\n([\d:.]+) --> ([\d:.]+)\n(.+)$", text, re.MULTILINE)
    return [(cid, seconds(a), seconds(b), body) for cid, a, b, body in cues]


def test_json_and_webvtt_indexes_agree_with_the_audio(rendered, tmp_path):
    plan, audio, _ = rendered
    chapters = [
        assemble_chapter(c, audio, tmp_path / f"ch{c.index + 1}.wav", fmt="wav") for c in plan.chapters
    ]
    index = write_index(chapters, tmp_path / "index.json", tmp_path / "index.vtt", title="T", author="A")
    assert json.loads((tmp_path / "index.json").read_text()) == index
    vtt = (tmp_path / "index.vtt").read_text()
    assert vtt.startswith("WEBVTT\n")
    notes = re.findall(r"^NOTE (.*)$", vtt, re.MULTILINE)
    assert notes == [c.title for c in plan.chapters]  # each chapter's own title, no prefix added
    cues = parse_vtt(vtt)
    segments = [s for c in index["chapters"] for s in c["segments"]]
    assert len(cues) == len(segments) == sum(len(c.segments) for c in plan.chapters)
    for (_, start, end, text), seg in zip(cues, segments, strict=True):
        assert (start, end) == (
            pytest.approx(seg["book_start"], abs=1e-3),
            pytest.approx(seg["book_end"], abs=1e-3),
        )
        assert text == seg["text"]
    assert all(b[1] >= a[2] for a, b in zip(cues, cues[1:], strict=False))  # in order, never overlapping
    offset = 0.0
    for entry, chapter in zip(index["chapters"], chapters, strict=True):
        assert entry["start"] == pytest.approx(offset, abs=1e-3)
        assert entry["end"] - entry["start"] == pytest.approx(chapter.duration, abs=2e-3)
        assert all(
            entry["start"] <= s["book_start"] < s["book_end"] <= entry["end"] for s in entry["segments"]
        )
        assert sf.info(Path(tmp_path / entry["file"])).duration == pytest.approx(chapter.duration, abs=1e-6)
        offset += chapter.duration
    assert index["duration"] == pytest.approx(offset, abs=1e-3)


def test_an_mp3_per_chapter_carries_id3_tags_the_cover_and_the_chapters_audio(rendered, tmp_path):
    plan, audio, _ = rendered
    chapters = [assemble_chapter(c, audio, tmp_path / f"ch{c.index + 1}.flac") for c in plan.chapters]
    for chapter in chapters:
        out = tmp_path / f"ch{chapter.index + 1}.mp3"
        write_mp3(chapter, out, tags=TAGS, track=(chapter.index + 1, 3), cover=tiny_png(),
                  cover_type="image/png")
        id3 = mutagen.id3.ID3(out)
        assert id3.version[:2] == (2, 3)
        assert str(id3["TIT2"]) == chapter.title and str(id3["TALB"]) == "The Lighthouse Keeper"
        assert str(id3["TPE1"]) == str(id3["TPE2"]) == "Ada Quill"
        assert str(id3["TCOM"]) == "Ben Narrow" and str(id3["TCON"]) == "Audiobook"
        assert str(id3["TRCK"]) == f"{chapter.index + 1}/3"
        assert id3.getall("COMM")[0].text == [TAGS.description]
        picture = id3.getall("APIC")[0]
        assert picture.mime == "image/png" and picture.data == tiny_png()
        mp3 = mutagen.mp3.MP3(out)
        assert mp3.info.sample_rate == SR and mp3.info.channels == 1
        # MP3 frames are 576 samples at 24 kHz; LAME pads the start and the end by less than a few frames.
        assert mp3.info.length == pytest.approx(chapter.duration, abs=0.1)
        with av.open(str(out)) as box:  # it decodes, to about the chapter's loudness
            pcm = np.concatenate([f.to_ndarray().reshape(-1) for f in box.decode(audio=0)])
        original, _ = sf.read(chapter.path, dtype="float64")
        meter = pyloudnorm.Meter(SR)
        assert meter.integrated_loudness(pcm.astype(np.float64)) == pytest.approx(
            meter.integrated_loudness(original), abs=0.5
        )


def test_assemble_book_writes_every_output_beside_each_other(rendered, tmp_path):
    plan, audio, _ = rendered
    out = assemble_book(plan, audio, tmp_path / "book", output=BookOutput(fmt="wav", target_lufs=-20.0))
    assert sorted(p.name for p in (tmp_path / "book").iterdir()) == [
        "book.m4b",
        "book.m4b.json",
        "chapter-001.wav",
        "chapter-001.wav.json",
        "chapter-002.wav",
        "chapter-002.wav.json",
        "chapter-003.wav",
        "chapter-003.wav.json",
        "chapters.json",
        "chapters.vtt",
        "metadata.json",  # for Audiobookshelf (app.books.writing.shelf)
    ]
    index = json.loads(out.index_json.read_text())
    assert [c["title"] for c in index["chapters"]] == [c.title for c in plan.chapters]
    assert [c["file"] for c in index["chapters"]] == ["chapter-001.wav", "chapter-002.wav", "chapter-003.wav"]
    with av.open(str(out.m4b)) as box:
        assert len(box.chapters()) == 3


def test_markdown_to_m4b_with_the_guide_voice_standing_in_for_the_model(markdown_book, tmp_path):
    """The whole pipeline-independent path: parse, plan, speak each unique segment once, assemble."""
    from app.text.guide_voice import GUIDE_SAMPLE_RATE, GuideOptions, identity, speak

    book = parse_markdown(markdown_book)
    options = GuideOptions.for_language(book.language)
    plan = plan_book(book, voice_id="ab" * 32, guide_options=identity(options))
    audio = {}
    for _, segment in plan.segments():
        if segment.key not in audio:
            audio[segment.key] = tmp_path / "segments" / f"{segment.key}.wav"
            audio[segment.key].parent.mkdir(exist_ok=True)
            sf.write(audio[segment.key], speak(segment.text, options), GUIDE_SAMPLE_RATE)
    out = assemble_book(plan, audio, tmp_path / "out", output=BookOutput(fmt="flac", target_lufs=-18.0))
    with av.open(str(out.m4b)) as box:
        marks = box.chapters()
        assert [m["metadata"]["title"] for m in marks] == [c.title for c in plan.chapters]
        ends = np.cumsum([c.duration for c in out.chapters])
        assert [float(m["end"] * m["time_base"]) for m in marks] == pytest.approx(list(ends), abs=AAC_FRAME)
    spoken = sum(s.end - s.start for c in out.chapters for s in c.segments)
    assert 10.0 < spoken < 60.0  # about 14 short sentences of speech
