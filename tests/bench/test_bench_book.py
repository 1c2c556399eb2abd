"""scripts/bench_book.py's report on synthetic records: the phases add up to the wall time, preparation
is counted only for a voice prepared for the book, and the table renders. (The script itself starts real
services and takes minutes: it is run by hand, see docs/PERFORMANCE.md.)"""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import bench_book  # noqa: E402

T0 = 1_000.0


def job(started: float, ready_after: float, first_audio: float, finished: float, **timings: float) -> dict:
    return {"id": f"j{started}", "n_tokens": 250, "attempts": 1, "started_at": started,
            "first_audio_at": first_audio, "finished_at": finished,
            "timings": {"prep_wait_s": ready_after, **timings}}


def record(label: str, voice: dict, jobs: list[dict]) -> dict:
    return {"label": label, "client_t0": T0,
            "prep_paths": {"prepared_ahead": 1, "already_installed": 1, "late": 0},
            "book": {"status": "succeeded", "submitted_at": T0 + 0.1, "started_at": T0 + 0.2,
                     "finished_at": T0 + 12.0},
            "chapters": [{"index": 0, "scheduled_at": T0 + 0.3, "assembled_at": T0 + 11.5, "seconds": 20.0}],
            "voice": voice, "jobs": jobs}


def test_a_new_voice_books_phases_add_up_to_its_wall_time() -> None:
    voice = {"id": "v", "prepare_started_at": T0 + 0.2, "prepared_at": T0 + 0.4, "prepare_ms": 150.0}
    # the second job was admitted after the install's step: its own claim + wait is no readiness time
    jobs = [job(T0 + 1.0, 2.0, T0 + 3.5, T0 + 7.0, install_s=1.5), job(T0 + 1.1, 0.01, T0 + 3.6, T0 + 11.0)]
    r = bench_book.build_report(record("new voice", voice, jobs))
    assert r["wall_s"] == 12.0 and r["audio_s"] == 20.0
    assert r["audio_min_per_wall_min"] == pytest.approx(20 / 12, abs=1e-3)
    assert r["phases_s"] == {"submit_to_gpu": 1.0, "voice_on_gpu": 2.0, "decoding": 8.0, "assembly": 1.0}
    assert sum(r["phases_s"].values()) == pytest.approx(r["wall_s"])
    assert sum(r["summary_s"].values()) == pytest.approx(r["wall_s"])
    assert r["summary_s"] == {"preparation": 2.0, "decoding": 8.0, "other": 2.0}
    assert r["install_s"] == 1.5 and r["gpu_wait_for_features_s"] == 0.5
    assert r["assembly_s"] == {"chapters": 0.5, "book": 0.5}
    assert r["host_half"] == {"queued_s": 0.2, "span_s": 0.2, "host_half_ms": 150.0,
                              "done_before_gpu_claim": True}
    assert r["first_audio_s"] == 3.5 and r["started_to_finished_s"] == 11.8
    assert r["prep_paths"] == {"prepared_ahead": 1, "already_installed": 1}
    assert "new voice" in bench_book.render_table([r]) and "install 1.500 s" in bench_book.render_phases(r)


def test_a_voice_prepared_before_the_book_counts_no_preparation() -> None:
    voice = {"id": "v", "prepare_started_at": T0 - 50.0, "prepared_at": T0 - 49.0, "prepare_ms": 150.0}
    jobs = [job(T0 + 1.0, 0.0, T0 + 1.5, T0 + 11.0)]
    r = bench_book.build_report(record("prepared voice", voice, jobs))
    assert r["host_half"] is None and r["install_s"] == 0.0 and r["summary_s"]["preparation"] == 0.0
    assert r["summary_shares"]["decoding"] == pytest.approx(10 / 12, abs=1e-3)
    assert "prepared voice" in bench_book.render_table([r])


def test_the_manifest_is_the_integration_tests_token_book() -> None:
    book = bench_book.token_manifest(1, 20, 250, salt=3)
    segments = book["chapters"][0]["segments"]
    assert len(segments) == 20 and all(len(s["tokens"]) == 250 for s in segments)
    assert len({tuple(s["tokens"]) for s in segments}) == 20  # no repeats: 20 jobs
    assert all(0 <= t < 6561 for s in segments for t in s["tokens"])
