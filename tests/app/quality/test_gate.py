"""The quality gate on real recordings and on what a broken render looks like."""

from __future__ import annotations

import numpy as np

from app.quality import listeners
from app.quality.gate import Thresholds, check_audio, check_signal

RATE = 16000


def verdicts(report):  # type: ignore[no-untyped-def]
    return {c.name: c.verdict for c in report.checks}


def test_real_audiobook_speech_passes_every_check_in_its_own_voice(librivox) -> None:  # type: ignore[no-untyped-def]
    names = sorted(librivox)
    for i, name in enumerate(names):
        wave, text = librivox[name]
        ref = librivox[names[(i + 1) % len(names)]][0]  # another clip of the same reader
        report = check_audio(wave, RATE, text=text, reference=ref, reference_rate=RATE)
        assert report.passed, (name, report.reasons)
        assert set(verdicts(report).values()) == {"pass"}, verdicts(report)


def test_noise_fails_as_not_speech(librivox) -> None:  # type: ignore[no-untyped-def]
    wave, text = librivox["0870"]
    noise = (np.random.default_rng(0).standard_normal(wave.size) * 0.1).astype(np.float32)
    report = check_audio(noise, RATE, text=text, reference=librivox["0920"][0], reference_rate=RATE)
    assert not report.passed
    got = verdicts(report)
    assert got["quality"] == got["voice"] == got["words"] == "fail", report.reasons
    assert got["length"] == "pass"  # noise of the right length: only the listeners catch it


def test_silence_and_nan_fail_without_listening(librivox) -> None:  # type: ignore[no-untyped-def]
    wave, text = librivox["0870"]
    silent = check_audio(np.zeros_like(wave), RATE, text=text)
    assert verdicts(silent)["silence"] == "fail" and not silent.passed
    assert verdicts(silent)["quality"] == "skipped"
    broken = wave.copy()
    broken[100] = np.nan
    assert verdicts(check_audio(broken, RATE, text=text))["finite"] == "fail"


def test_a_clip_far_too_short_for_its_text_fails(librivox) -> None:  # type: ignore[no-untyped-def]
    wave, text = librivox["0870"]  # 7.1 s of speech; its first 0.8 s is a cut-off sentence
    report = check_audio(wave[: int(0.8 * RATE)], RATE, text=text)
    got = verdicts(report)
    assert got["length"] == "fail" and got["words"] == "fail", report.reasons


def test_a_different_speaker_scores_lower_than_the_same_speaker(librivox, other_speaker) -> None:  # type: ignore[no-untyped-def]
    same = [listeners.embedding(w) for w, _ in librivox.values()]
    other = [listeners.embedding(w) for w in other_speaker]
    within = [float(a @ b) for i, a in enumerate(same) for b in same[i + 1:]]  # type: ignore[operator]
    across = [float(a @ b) for a in same for b in other]  # type: ignore[operator]
    assert min(within) > np.mean(across) and np.mean(within) > max(across) - 0.05, (within, across)
    assert min(within) >= Thresholds().min_similarity


def test_clipping_is_caught_and_words_are_skipped_for_other_languages(librivox) -> None:  # type: ignore[no-untyped-def]
    wave, text = librivox["0920"]
    loud = np.clip(wave * 40.0, -1.0, 1.0)
    report = check_audio(loud, RATE, text=text, language="fr")
    got = verdicts(report)
    assert got["clipping"] == "fail"
    words = next(c for c in report.checks if c.name == "words")
    assert words.verdict == "skipped" and "English only" in words.reason


def test_the_signal_checks_alone_judge_level_and_length_and_leave_the_listeners_unrun(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    def no_listening(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("a listener ran")

    monkeypatch.setattr(listeners, "quality", no_listening)
    t = np.arange(2 * RATE) / RATE
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    fine = check_signal(tone, RATE, expected_s=2.0)
    assert fine.passed and verdicts(fine) == {"finite": "pass", "silence": "pass", "clipping": "pass",
                                              "length": "pass", "quality": "skipped", "voice": "skipped",
                                              "words": "skipped"}
    assert verdicts(check_signal(np.zeros_like(tone), RATE, expected_s=2.0))["silence"] == "fail"
    assert verdicts(check_signal(tone, RATE, expected_s=10.0))["length"] == "fail"
    nan = check_signal(np.full_like(tone, np.nan), RATE)
    assert verdicts(nan)["finite"] == "fail" and len(nan.checks) == 7
