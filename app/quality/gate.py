"""Run every check on one clip: `check_audio(wave, rate, text=..., reference=..., thresholds=...)`, or the
signal checks alone: `check_signal(wave, rate, expected_s=..., thresholds=...)`.

The signal checks run first; a clip that holds NaN/Inf or is silence is not listened to (the listeners
would only add noise to the reasons). Defaults and how they were chosen: docs/QUALITY.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from app.quality import listeners, signal
from app.quality.report import Check, Report
from app.settings import Settings

CHARS_PER_SECOND = 15.0  # the segment planner's estimate of a reader's pace (app.text.segment)


@dataclass(frozen=True)
class Thresholds:
    min_dbfs: float = -50.0
    max_quiet_share: float = 0.6
    max_clipped_share: float = 0.001
    min_length_ratio: float = 0.4
    max_length_ratio: float = 2.5
    min_mos: float = 1.6
    min_similarity: float = 0.6
    max_wer: float = 0.6
    min_words: int = 5

    @classmethod
    def from_settings(cls, settings: Settings) -> Thresholds:
        return cls(min_mos=settings.quality_min_mos, min_similarity=settings.quality_min_similarity,
                   max_wer=settings.quality_max_wer, min_words=settings.quality_min_words,
                   min_length_ratio=settings.quality_min_length_ratio,
                   max_length_ratio=settings.quality_max_length_ratio,
                   min_dbfs=settings.quality_min_dbfs)


def expected_seconds(text: str) -> float | None:
    """About how long a reader takes to say `text` (normalised, so '1999' counts as its words)."""
    spoken = " ".join(listeners.words_of(text))
    return len(spoken) / CHARS_PER_SECOND if spoken else None


def _to_16k(wave: np.ndarray, rate: int) -> np.ndarray:
    if rate == listeners.RATE:
        return np.asarray(wave, dtype=np.float32)
    from app.audio import resample

    return resample(wave, rate, listeners.RATE).numpy()


def _signal_checks(wave: np.ndarray, rate: int, expected_s: float | None, th: Thresholds) -> list[Check]:
    checks = [signal.finite(wave)]
    if checks[0].failed:
        return checks + [Check(n, "skipped", reason="the clip holds NaN/Inf")
                         for n in ("silence", "clipping", "length", "quality", "voice", "words")]
    return checks + [signal.silence(wave, rate, min_dbfs=th.min_dbfs, max_quiet_share=th.max_quiet_share),
                     signal.clipping(wave, max_share=th.max_clipped_share),
                     signal.length(wave.size / rate, expected_s, low=th.min_length_ratio,
                                   high=th.max_length_ratio)]


def check_signal(wave: np.ndarray, rate: int, *, expected_s: float | None = None,
                 thresholds: Thresholds = Thresholds(),
                 unheard_reason: str = "the listeners were not asked for") -> Report:
    """The signal checks alone (microseconds a clip, where the listeners take seconds); the listeners'
    checks are reported skipped, for `unheard_reason`."""
    checks = _signal_checks(np.asarray(wave, dtype=np.float32).reshape(-1), rate, expected_s, thresholds)
    done = {c.name for c in checks}
    return Report(checks + [Check(n, "skipped", reason=unheard_reason)
                            for n in ("quality", "voice", "words") if n not in done])


def check_audio(wave: np.ndarray, rate: int, *, text: str | None = None, reference: np.ndarray | None = None,
                reference_rate: int | None = None, language: str = "en",
                expected_s: float | None = None, thresholds: Thresholds = Thresholds()) -> Report:
    """Every check on one mono clip; `expected_s` (from a token count) wins over the text's estimate."""
    th = thresholds
    wave = np.asarray(wave, dtype=np.float32).reshape(-1)
    checks = _signal_checks(wave, rate, expected_s or (expected_seconds(text) if text else None), th)
    if checks[0].failed:
        return Report(checks)
    if checks[1].failed:
        return Report(checks + [Check(n, "skipped", reason="the clip is silence")
                                for n in ("quality", "voice", "words")])
    clip = _to_16k(wave, rate)
    checks.append(listeners.quality(clip, min_mos=th.min_mos))
    if reference is None:
        checks.append(Check("voice", "skipped", reason="no reference voice given"))
    else:
        ref = _to_16k(np.asarray(reference, dtype=np.float32).reshape(-1), reference_rate or rate)
        checks.append(listeners.voice(clip, ref, min_similarity=th.min_similarity))
    if text:
        checks.append(listeners.words(clip, text, language, max_wer=th.max_wer, min_words=th.min_words))
    else:
        checks.append(Check("words", "skipped", reason="no text given"))
    return Report(checks)
