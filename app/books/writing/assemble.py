"""Rendered segments -> chapter WAV/FLAC files and one M4B audiobook.

`assemble_chapter` concatenates a planned chapter's segment files (looked up by content key) with
each segment's pause after it and a 5 ms fade at each segment's edges (no click where a segment
starts or ends away from zero), normalises its loudness to a target (`app.books.writing.loudness`: -20 LUFS
integrated by default, true peak at most -1 dBTP), measures what it wrote, and records where every
segment lies. A chapter is never whole in memory: it is measured as its segments are read, then written
with its gain as they are read again (a timed chapter's hours of silence cost a count, not samples).
`write_m4b` encodes the chapter files to AAC in an MP4 ("M4B " brand) with PyAV: chapter markers
at the exact sample where each chapter starts, the book's tags (`BookTags`) and a JPEG/PNG cover as
an attached picture. `write_m4a` encodes one chapter file to AAC in MP4 for a read-along EPUB.
`write_mp3` encodes one chapter file to MP3 with ID3v2.3 tags (chapter title,
book, author, narrator, track n/N, the cover as APIC). No ffmpeg binary is run.

Tags, as audiobook players read them, are `app.books.writing.tags` (an MP3's title: its chapter).
The M4B, the M4A and the MP3s are encoded at the bitrate and sample rate given (`app.books.writing.encoding`;
PyAV resamples). Every file is written to a temporary name beside
its target and renamed into place (`os.replace`), so a reader never sees half a file.
The chapter index (JSON + WebVTT) is `app.books.writing.index`; the whole book, reusing the chapter files
whose inputs have not changed, is `app.books.writing.output`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

import av
import numpy as np
import soundfile as sf
from mutagen import id3

from app.audio import commit_output, open_output, resample
from app.books.planning.plan import PlanChapter
from app.books.writing import loudness
from app.books.writing.loudness import Loudness
from app.books.writing.meter import StreamMeter
from app.books.writing.tags import BookTags, write_mp4_extra_tags
from app.errors import BadInput, NotFound
from app.speech import SAMPLE_RATE, OutputFormat
from app.storage.artifacts import atomic_path

if TYPE_CHECKING:
    from av.container.core import Chapter  # a TypedDict, only in PyAV's stubs

_BLOCK = 1 << 16  # samples per read while encoding
_COVER_CODECS = {"image/jpeg": ("mjpeg", "yuvj420p"), "image/png": ("png", "rgb24")}
_OWN_FRAMES = {"LANGUAGE": id3.TLAN, "PUBLISHER": id3.TPUB}  # custom tags with an ID3 frame of their own


@dataclass(frozen=True)
class SegmentTiming:
    key: str
    text: str
    start: float  # seconds from the start of the chapter file
    end: float  # end of the segment's own audio, before its pause


@dataclass(frozen=True)
class ChapterAudio:
    index: int
    title: str
    path: Path
    sample_rate: int
    samples: int  # whole file, trailing pause included
    segments: tuple[SegmentTiming, ...]
    loudness: Loudness | None = None  # as written (after normalisation); None in files made before it

    @property
    def duration(self) -> float:
        return self.samples / self.sample_rate


def assemble_chapter(chapter: PlanChapter, audio: Mapping[str, Path], out: Path, *,
                     fmt: str = OutputFormat.FLAC, sample_rate: int = SAMPLE_RATE,
                     target_lufs: float | None = loudness.DEFAULT_TARGET_LUFS,
                     fade_ms: float = loudness.FADE_MS, timed: bool = False) -> ChapterAudio:
    """Concatenate a chapter's segments (audio[key] -> file), each faded in and out over `fade_ms`, with
    their pauses into `out`; normalised to `target_lufs` unless it is None. Measured either way.

    `timed` (subtitles): a segment with a cue start begins there, or right after the one before it when
    that one runs late; the gap is silence, and no pause is added before a timed segment.

    Two passes over the segments, never the whole chapter in memory: the first measures it
    (`app.books.writing.meter`) and records where each segment lies, the second writes it with the one
    gain."""
    meter = StreamMeter(sample_rate)
    timings: list[SegmentTiming] = []
    for piece in _pieces(chapter, audio, sample_rate, fade_ms, timed):
        if isinstance(piece, int):
            meter.add_silence(piece)
        else:
            timings.append(piece[0])
            meter.add(piece[1])
    measured = Loudness(meter.integrated(), meter.true_peak())
    scale = None
    if target_lufs is not None and math.isfinite(measured.integrated_lufs):
        gain_db = loudness.gain_for(measured, target_lufs)
        scale, measured = 10.0 ** (gain_db / 20.0), loudness.after_gain(measured, gain_db)
    handle, tmp = open_output(out, fmt, sample_rate)
    try:
        for piece in _pieces(chapter, audio, sample_rate, fade_ms, timed):
            if isinstance(piece, int):
                for start in range(0, piece, _BLOCK):
                    handle.write(np.zeros(min(_BLOCK, piece - start), np.float32))
            else:
                wave = piece[1]
                handle.write(wave if scale is None else (wave * scale).astype(np.float32))
    except BaseException:
        handle.close()
        tmp.unlink(missing_ok=True)
        raise
    commit_output(handle, tmp, out)
    return ChapterAudio(chapter.index, chapter.title, out, sample_rate, meter.samples, tuple(timings),
                        measured)


def _pieces(chapter: PlanChapter, audio: Mapping[str, Path], sample_rate: int, fade_ms: float,
            timed: bool) -> Iterator[int | tuple[SegmentTiming, np.ndarray]]:
    """The chapter as it plays, in order: (timing, faded audio) for each segment, and silences (gaps
    before a timed cue, pauses) as sample counts."""
    cursor = 0
    segments = chapter.segments
    for i, segment in enumerate(segments):
        where = f"segment {i + 1} of chapter {chapter.index + 1}"
        wave = loudness.fade_edges(read_segment(audio, segment.key, sample_rate, where=where), sample_rate,
                                   fade_ms)
        if timed and segment.start_ms >= 0:
            start = round(segment.start_ms * sample_rate / 1000)
            if start > cursor:
                yield start - cursor
                cursor = start
        next_timed = timed and i + 1 < len(segments) and segments[i + 1].start_ms >= 0
        pause = 0 if next_timed else round(segment.pause_after_ms * sample_rate / 1000)
        yield SegmentTiming(segment.key, segment.text, cursor / sample_rate,
                            (cursor + len(wave)) / sample_rate), wave
        if pause:
            yield pause
        cursor += len(wave) + pause


def read_segment(audio: Mapping[str, Path], key: str, sample_rate: int, *, where: str) -> np.ndarray:
    """A rendered segment file -> mono float32 at `sample_rate`; NotFound if it was never rendered."""
    path = audio.get(key)
    if path is None or not Path(path).is_file():
        raise NotFound(f"{where} (key {key[:12]}) has no rendered audio")
    pcm, rate = sf.read(path, dtype="float32", always_2d=True)
    mono = pcm.mean(axis=1)
    if rate != sample_rate:
        mono = resample(mono, rate, sample_rate).numpy()
    return np.ascontiguousarray(mono, dtype=np.float32)


# --- M4B -----------------------------------------------------------------------------------------

def write_m4b(chapters: Sequence[ChapterAudio], out: Path, *, tags: BookTags,
              cover: bytes | None = None, cover_type: str | None = None, bitrate: int = 64000,
              sample_rate: int | None = None) -> None:
    """Encode the chapter files, in order, into one AAC M4B with a chapter marker per file; at
    `sample_rate` (PyAV's resampler) when given, else at the chapters' own rate."""
    if not chapters:
        raise BadInput("an audiobook needs at least one chapter")
    rate = chapters[0].sample_rate
    if any(c.sample_rate != rate for c in chapters):
        raise ValueError("chapters have different sample rates")
    with atomic_path(out) as tmp:
        with av.open(str(tmp), "w", format="mp4", options={"brand": "M4B "}) as box:
            box.metadata.update({"title": tags.title, **tags.common()})
            if tags.description:
                box.metadata["description"] = tags.description
            stream = box.add_stream("aac", rate=sample_rate or rate, layout="mono")
            stream.bit_rate = bitrate
            picture = _cover_stream(box, cover_type) if cover else None
            box.set_chapters(_markers(chapters, rate))
            pts = 0
            for chapter in chapters:
                pts = _encode_file(box, stream, chapter.path, rate, pts)
            for packet in stream.encode(None):
                box.mux(packet)
            if picture is not None and cover is not None:
                packet = av.Packet(cover)
                packet.stream, packet.pts, packet.dts = picture, 0, 0
                box.mux(packet)
        write_mp4_extra_tags(tmp, tags)


def write_m4a(chapter: ChapterAudio, out: Path, *, bitrate: int = 64000,
              sample_rate: int | None = None) -> None:
    """One chapter file -> AAC in an MP4 (no tags): the audio of a read-along EPUB's chapter."""
    rate = chapter.sample_rate
    with atomic_path(out) as tmp, av.open(str(tmp), "w", format="mp4") as box:
        stream = box.add_stream("aac", rate=sample_rate or rate, layout="mono")
        stream.bit_rate = bitrate
        _encode_file(box, stream, chapter.path, rate, 0)
        for packet in stream.encode(None):
            box.mux(packet)


def write_mp3(chapter: ChapterAudio, out: Path, *, tags: BookTags, track: tuple[int, int],
              cover: bytes | None = None, cover_type: str | None = None, bitrate: int = 64000,
              sample_rate: int | None = None) -> None:
    """One chapter file -> an MP3 (LAME, constant bitrate) with ID3v2.3 tags: the chapter's title, the
    book's tags, `track` (its number, of how many), the description as a comment, the cover as the front
    cover.

    PyAV encodes; mutagen writes the tags (ffmpeg's ID3 writer keeps a comment as a TXXX frame, which
    players do not show as the comment)."""
    if cover and cover_type not in _COVER_CODECS:
        raise BadInput(f"cover type {cover_type!r} is not one of {sorted(_COVER_CODECS)}")
    rate = chapter.sample_rate
    with atomic_path(out) as tmp:
        with av.open(str(tmp), "w", format="mp3", options={"write_id3v2": "0"}) as box:
            stream = box.add_stream("libmp3lame", rate=sample_rate or rate, layout="mono")
            stream.bit_rate = bitrate
            _encode_file(box, stream, chapter.path, rate, 0)
            for packet in stream.encode(None):
                box.mux(packet)
        common = tags.common()
        number, of = track
        frames: list[id3.Frame] = [id3.TIT2(encoding=3, text=chapter.title or f"Chapter {number}"),
                  id3.TRCK(encoding=3, text=f"{number}/{of}")]
        for key, kind in (("album", id3.TALB), ("artist", id3.TPE1), ("album_artist", id3.TPE2),
                           ("composer", id3.TCOM), ("genre", id3.TCON), ("date", id3.TYER)):
            if key in common:
                frames.append(kind(encoding=3, text=common[key]))
        if tags.comment:
            frames.append(id3.COMM(encoding=3, lang="eng", desc="", text=tags.comment))
        custom = tags.custom()
        frames += [id3.TXXX(encoding=3, desc=k, text=v) for k, v in custom.items() if k not in _OWN_FRAMES]
        frames += [kind(encoding=3, text=custom[k]) for k, kind in _OWN_FRAMES.items() if k in custom]
        if tags.grouping:
            frames.append(id3.TIT1(encoding=3, text=tags.grouping))
        if cover and cover_type:
            frames.append(id3.APIC(encoding=3, mime=cover_type, type=id3.PictureType.COVER_FRONT,
                                   desc="cover", data=cover))
        tagged = id3.ID3()
        for each in frames:
            tagged.add(each)
        tagged.save(tmp, v2_version=3)


def _markers(chapters: Sequence[ChapterAudio], rate: int) -> list[Chapter]:
    marks: list[Chapter] = []
    start = 0
    for i, chapter in enumerate(chapters):
        marks.append({"id": i + 1, "start": start, "end": start + chapter.samples,
                      "time_base": Fraction(1, rate), "metadata": {"title": chapter.title}})
        start += chapter.samples
    return marks


def _cover_stream(box: Any, cover_type: str | None) -> Any:
    if cover_type not in _COVER_CODECS:
        raise BadInput(f"cover type {cover_type!r} is not one of {sorted(_COVER_CODECS)}")
    codec, pix_fmt = _COVER_CODECS[cover_type]
    picture = box.add_stream(codec)
    picture.width, picture.height, picture.pix_fmt = 16, 16, pix_fmt  # the muxer copies the bytes as they are
    picture.disposition = av.stream.Disposition.attached_pic
    return picture


def _encode_file(box: Any, stream: Any, path: Path, rate: int, pts: int) -> int:
    with sf.SoundFile(path) as handle:
        if handle.samplerate != rate:
            raise ValueError(f"{path} is {handle.samplerate} Hz, not {rate}")
        for block in handle.blocks(blocksize=_BLOCK, dtype="float32", always_2d=True):
            mono = np.ascontiguousarray(block.mean(axis=1)[None, :], dtype=np.float32)
            frame = av.AudioFrame.from_ndarray(mono, format="flt", layout="mono")
            frame.sample_rate, frame.pts = rate, pts
            pts += frame.samples
            for packet in stream.encode(frame):
                box.mux(packet)
    return pts
