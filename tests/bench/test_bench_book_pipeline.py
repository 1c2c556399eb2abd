"""scripts/bench_book_pipeline.py's arithmetic on synthetic intervals: the idle share counts each idle instant
of the render window once (overlapping busy intervals are not counted twice, intervals outside the window
are clipped), the CPU counters are interpolated between samples, and a recorded book gives the figures
its definitions say. (The script itself starts real services and takes minutes: it is run by hand.)"""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_book_pipeline as bench  # noqa: E402


def test_overlapping_busy_intervals_are_counted_once() -> None:
    busy = [(1.0, 3.0), (2.0, 4.0), (2.5, 3.5), (6.0, 7.0)]
    assert bench.union_length(busy, 0.0, 10.0) == pytest.approx(4.0)
    assert bench.idle_share((0.0, 10.0), busy) == pytest.approx(0.6)


def test_busy_time_outside_the_window_is_clipped_and_gaps_are_idle() -> None:
    busy = [(-5.0, 1.0), (9.0, 20.0), (4.0, 4.0)]  # one empty interval
    assert bench.union_length(busy, 0.0, 10.0) == pytest.approx(2.0)
    assert bench.idle_share((0.0, 10.0), busy) == pytest.approx(0.8)
    assert bench.idle_share((0.0, 10.0), [(0.0, 10.0)]) == 0.0
    assert bench.idle_share((5.0, 5.0), []) == 0.0


def test_counters_are_interpolated_between_samples_and_clamped_at_the_ends() -> None:
    samples = [(0.0, 1.0), (2.0, 3.0), (4.0, 3.0)]
    assert bench.interpolate(samples, 1.0) == pytest.approx(2.0)
    assert bench.interpolate(samples, 3.0) == pytest.approx(3.0)
    assert (bench.interpolate(samples, -1.0), bench.interpolate(samples, 9.0)) == (1.0, 3.0)


def test_a_recorded_book_gives_its_idle_share_and_cpu_per_audio_second() -> None:
    # Two 100-token jobs (8 s of audio) ready at 10 and 12; the first tokenized over [11, 12] and decoded
    # over [12, 14], the second tokenized over [15, 16] (its claim at 16) and decoded to 18: the window
    # [10, 18] has [10, 11] and [14, 15] idle.
    jobs = [{"id": "a", "n_tokens": 100, "submitted_at": 10.0, "started_at": 12.0, "finished_at": 14.0,
             "tokenize_ms": 1000.0, "timings": {"install_s": 0.5}},
            {"id": "b", "n_tokens": 100, "submitted_at": 12.0, "started_at": 16.0, "finished_at": 18.0,
             "tokenize_ms": 1000.0, "timings": {}}]
    record = {"jobs": jobs, "client_t0": 8.0, "book": {"finished_at": 20.0}, "cpu_idle_rate": 0.01,
              "cpu_samples": [(8.0, 100.0), (18.0, 100.4), (20.0, 101.0)],
              "gpu_samples": [(10.0, 5.0), (18.0, 11.0)]}
    report = bench.build_report(record)
    assert report["gpu_worker_idle_share"] == pytest.approx(0.25)
    assert report["cpu_worker_cpu_s_per_audio_s"] == pytest.approx(0.05)
    assert report["cpu_worker_cpu_s_per_audio_s_book"] == pytest.approx(0.125)
    assert report["gpu_worker"]["tokenize_s"] == pytest.approx(2.0)
    assert report["gpu_worker"]["decode_s"] == pytest.approx(3.5)
    assert report["audio_s_per_wall_s"] == pytest.approx(8.0 / 12.0, abs=1e-3)


def test_a_book_without_phase_records_has_only_its_claims_busy() -> None:
    jobs = [{"id": "a", "n_tokens": 50, "submitted_at": 0.0, "started_at": 1.0, "finished_at": 3.0,
             "tokenize_ms": None, "timings": {}}]
    record = {"jobs": jobs, "client_t0": 0.0, "book": {"finished_at": 4.0}, "cpu_idle_rate": None,
              "cpu_samples": [(0.0, 0.0), (4.0, 1.0)], "gpu_samples": [(0.0, 0.0), (4.0, 1.0)]}
    report = bench.build_report(record)
    assert report["gpu_worker_idle_share"] == pytest.approx(1 / 3, abs=1e-4)
    assert report["gpu_worker"]["tokenized_jobs"] == 0
