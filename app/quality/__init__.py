"""The quality gate: hear a rendered segment and say whether it is fit to keep.

    report.py    `Check` and `Report`: one verdict per check (score, threshold, reason) and the whole
    signal.py    the checks on the samples alone: NaN/Inf, digital silence, clipping, length for the text
    listeners.py the checks that listen, each on a library made for it whose model ships in its package:
                 DNSMOS (speechmos) for quality, GE2E (Resemblyzer) for the voice, pocketsphinx + jiwer
                 for the words
    gate.py      `Thresholds` (from `WAVEFARM_QUALITY_*`), `check_audio`, which runs them all, and
                 `check_signal`, the signal checks alone

Every check runs on a CPU (a CPU worker beside the GPU, or the `wavefarm quality check` command); the
listeners' models are loaded once per process, on first use. How the default thresholds were chosen,
and what a check costs per second of audio: docs/QUALITY.md.
"""
