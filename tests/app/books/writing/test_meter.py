"""The streaming meter (app.books.writing.meter) against pyloudnorm's whole-signal figure, and a chapter of
many
hours assembled in memory bounded by its segments, not its length."""

from __future__ import annotations

import math
import tracemalloc
from pathlib import Path

import numpy as np
import pyloudnorm
import pytest
import soundfile as sf

from app.books.planning.plan import PlanChapter, PlanSegment
from app.books.writing import loudness
from app.books.writing.assemble import assemble_chapter
from app.books.writing.meter import StreamMeter

SR = 24000


def _speechlike(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    envelope = np.abs(np.sin(np.linspace(0, 9 * np.pi, n))) * np.linspace(0.02, 0.4, n)
    wave = (rng.standard_normal(n) * envelope).astype(np.float32)
    wave[: n // 4] *= 0.001  # a quiet stretch the relative gate drops
    return wave


@pytest.mark.parametrize("seconds", [0.5, 3.0, 7.3, 61.0])
def test_the_meter_fed_in_pieces_gives_pyloudnorms_figure_for_the_whole(seconds: float) -> None:
    wave = _speechlike(seconds, seed=int(seconds * 10))
    meter = StreamMeter(SR)
    rng = np.random.default_rng(1)
    start = 0
    while start < len(wave):
        size = int(rng.integers(1, 40_000))
        meter.add(wave[start:start + size])
        start += size
    expected = pyloudnorm.Meter(SR).integrated_loudness(wave.astype(np.float64))
    assert meter.integrated() == pytest.approx(expected, abs=1e-6)
    assert meter.true_peak() == pytest.approx(loudness.true_peak(wave, SR), abs=1e-9)


def _whole_signal_peak(wave: np.ndarray) -> float:
    from scipy.signal import resample_poly

    x = wave.astype(np.float64)
    return 20 * math.log10(max(float(np.abs(x).max()), float(np.abs(resample_poly(x, 8, 1)).max())))


@pytest.mark.parametrize("kind", ["speechlike", "noise", "a click in quiet", "peaks at block edges"])
def test_the_true_peak_oversampling_only_what_could_raise_it_is_the_whole_signals_to_the_bit(kind) -> None:
    rng = np.random.default_rng(len(kind))
    n = 3 * (1 << 18) + 777  # four blocks of the tracker, the last one partial
    wave = {"speechlike": lambda: _speechlike(n / SR, seed=7),
            "noise": lambda: (0.3 * rng.standard_normal(n)).astype(np.float32),
            "a click in quiet": lambda: np.where(np.arange(n) == n // 3, 0.9, 0.001 * rng.standard_normal(n)),
            "peaks at block edges": lambda: _edges(n, rng)}[kind]()
    meter = StreamMeter(SR)
    start = 0
    while start < n:
        size = int(rng.integers(1, 300_000))
        meter.add(wave[start:start + size])
        start += size
    assert meter.true_peak() == _whole_signal_peak(wave)  # exactly: each point from the same sums


def _edges(n: int, rng: np.random.Generator) -> np.ndarray:
    wave = 0.05 * rng.standard_normal(n)
    for edge in (1 << 18, 2 << 18, 3 << 18):  # alternating full-scale samples: a peak between them
        wave[edge - 3:edge + 3] = [0.7, -0.7, 0.7, -0.7, 0.7, -0.7]
    return wave


def test_silence_is_counted_as_the_same_zeros_would_be_measured() -> None:
    speech = _speechlike(2.0, seed=3)
    counted, fed = StreamMeter(SR), StreamMeter(SR)
    for meter, silence in ((counted, None), (fed, np.zeros(SR * 95 + 123, np.float32))):
        meter.add(speech)
        meter.add_silence(SR * 95 + 123) if silence is None else meter.add(silence)
        meter.add(speech)
    assert counted.samples == fed.samples
    assert counted.integrated() == pytest.approx(fed.integrated(), abs=1e-9)
    assert counted.true_peak() == pytest.approx(fed.true_peak(), abs=1e-9)
    assert StreamMeter(SR).integrated() == StreamMeter(SR).true_peak() == -math.inf


def test_a_timed_chapter_of_hours_is_assembled_in_memory_bounded_by_its_segments(tmp_path: Path) -> None:
    """Three cues over six hours: assembled in one piece in memory this was 2.4 GB an hour (the 99,999 h
    cue of a hostile subtitle file asked for 31 TiB); measured, then written, in pieces, it is a few MB."""
    audio, segments = {}, []
    for i in range(3):
        path = tmp_path / f"s{i}.wav"
        sf.write(path, _speechlike(2.0, seed=i), SR, subtype="FLOAT")
        audio[f"k{i}"] = path
        segments.append(PlanSegment(key=f"k{i}", kind="text", text=f"cue {i}", tokens=None, audio=None,
                                    est_tokens=50, pause_after_ms=300, paragraph=i,
                                    start_ms=i * 3 * 3600_000))
    tracemalloc.start()
    try:
        chapter = assemble_chapter(PlanChapter(0, "Film", tuple(segments)), audio, tmp_path / "out.flac",
                                   timed=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert chapter.samples == 6 * 3600 * SR + 2 * SR + int(0.3 * SR)  # the last cue, its pause after it
    assert [round(s.start) for s in chapter.segments] == [0, 3 * 3600, 6 * 3600]
    assert chapter.loudness is not None and chapter.loudness.integrated_lufs == pytest.approx(-20.0, abs=0.01)
    assert peak < 64 * 1024 * 1024, f"{peak / 2**20:.0f} MB at the peak"
    with sf.SoundFile(tmp_path / "out.flac") as written:
        assert written.frames == chapter.samples
        written.seek(3 * 3600 * SR)
        cue = written.read(2 * SR, dtype="float32")
    gain = 10 ** (chapter.loudness.gain_db / 20)
    expected = loudness.fade_edges(_speechlike(2.0, seed=1), SR) * gain
    assert np.abs(cue - expected).max() < 1e-4  # FLAC's 16 bits
