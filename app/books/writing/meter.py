"""Loudness and true peak of a signal fed in pieces, in memory bounded by its length in 100 ms steps, not
in samples: a chapter of many hours is measured without ever being whole in memory.

    meter = StreamMeter(rate)
    meter.add(piece); meter.add_silence(n); ...
    meter.integrated()  -> LUFS (ITU-R BS.1770-4, gated), -inf for silence or under one 400 ms block
    meter.true_peak()   -> dBTP (the signal oversampled to >= 192 kHz), -inf for silence

The K-weighting filters are pyloudnorm's (its `IIRfilter` stages, as its "K-weighting" meter builds
them), run with their state carried from one piece to the next; the gating is BS.1770-4's as pyloudnorm
computes it, on 400 ms blocks every 100 ms, here summed from 100 ms steps. A test holds it to
pyloudnorm's own figure for whole signals. Silence (the gaps of a timed chapter, pauses) costs nothing
once the filters have settled: its steps are counted, not computed.
"""

from __future__ import annotations

import math
from array import array
from functools import lru_cache

import numpy as np

TRUE_PEAK_RATE = 192_000  # oversample to at least this rate to find inter-sample peaks
BLOCK_S, STEP_S = 0.4, 0.1  # BS.1770-4 gating blocks, and the step between them (75 % overlap)
ABSOLUTE_GATE, RELATIVE_GATE = -70.0, -10.0
_PEAK_BLOCK = 1 << 18  # samples oversampled at a time
_PEAK_CONTEXT = 64  # samples on each side of a block; the polyphase filter needs fewer
_SUPPORT = 12  # samples on either side an oversampled point depends on (resample_poly's filter: 10)
_CHUNK = 64  # samples bounded together when deciding what to oversample
_JOIN = 1024  # stretches to oversample closer than this are one call (a call costs about 500 samples' work)
_SETTLED = 1e-12  # filter state this small: the filters' output on silence is silence
SILENT = -math.inf


class StreamMeter:
    def __init__(self, rate: int) -> None:
        from pyloudnorm.iirfilter import IIRfilter

        self.rate = rate
        self.step = round(STEP_S * rate)
        if not math.isclose(self.step, STEP_S * rate):
            raise ValueError(f"a rate of {rate} Hz has no whole 100 ms step")
        shelf = IIRfilter(4.0, 1 / np.sqrt(2), 1500.0, rate, "high_shelf")  # BS.1770's K-weighting
        high_pass = IIRfilter(0.0, 0.5, 38.0, rate, "high_pass")
        self._stages = [(f.b, f.a, f.passband_gain) for f in (shelf, high_pass)]
        self._state = [np.zeros(2) for _ in self._stages]
        self._steps = array("d")  # sum of squared K-weighted samples per whole 100 ms step
        self._partial, self._filled = 0.0, 0  # the step being filled
        self.samples = 0
        self._peak = _PeakTracker(rate)

    def add(self, piece: np.ndarray) -> None:
        from scipy.signal import lfilter

        x = np.asarray(piece, dtype=np.float64)
        if not len(x):
            return
        self._peak.add(x)
        for i, (b, a, gain) in enumerate(self._stages):
            x, self._state[i] = lfilter(b, a, x, zi=self._state[i])
            x = gain * x
        self._count(np.square(x))

    def add_silence(self, n: int) -> None:
        """`n` samples of silence, counted without being made once the filters have settled."""
        while n > 0 and max(float(np.abs(s).max()) for s in self._state) > _SETTLED:
            piece = min(n, self.step)
            self.add(np.zeros(piece))
            n -= piece
        if n <= 0:
            return
        self._peak.add_silence(n)
        self.samples += n
        head = min(n, self.step - self._filled)  # finish the step being filled
        self._filled += head
        n -= head
        if self._filled < self.step:
            return
        self._steps.append(self._partial)
        self._steps.extend(array("d", bytes(8 * (n // self.step))))  # whole silent steps: zeros
        self._partial, self._filled = 0.0, n % self.step

    def _count(self, squares: np.ndarray) -> None:
        self.samples += len(squares)
        head = min(len(squares), self.step - self._filled)
        self._partial += float(squares[:head].sum())
        self._filled += head
        rest = squares[head:]
        if self._filled < self.step:
            return
        self._steps.append(self._partial)
        whole = len(rest) // self.step
        if whole:
            self._steps.extend(rest[:whole * self.step].reshape(whole, self.step).sum(axis=1).tolist())
        tail = rest[whole * self.step:]
        self._partial, self._filled = float(tail.sum()), len(tail)

    def integrated(self) -> float:
        """Gated integrated loudness, LUFS; -inf for silence or a signal of at most one block."""
        per_block = round(BLOCK_S / STEP_S)
        if self.samples <= int(BLOCK_S * self.rate):
            return SILENT
        steps = np.frombuffer(self._steps, dtype=np.float64)
        if self._filled:
            steps = np.append(steps, self._partial)
        blocks = int(round((self.samples / self.rate - BLOCK_S) / STEP_S)) + 1
        padded = np.concatenate([steps, np.zeros(max(0, blocks + per_block - len(steps)))])
        sums = np.convolve(padded, np.ones(per_block), mode="valid")[:blocks]
        z = sums / (BLOCK_S * self.rate)
        with np.errstate(divide="ignore"):
            levels = -0.691 + 10.0 * np.log10(z)
        gated = z[levels >= ABSOLUTE_GATE]
        if not len(gated):
            return SILENT
        relative = -0.691 + 10.0 * np.log10(gated.mean()) + RELATIVE_GATE
        kept = z[(levels > relative) & (levels > ABSOLUTE_GATE)]
        value = -0.691 + 10.0 * math.log10(kept.mean()) if len(kept) and kept.mean() > 0 else SILENT
        return value if math.isfinite(value) else SILENT

    def true_peak(self) -> float:
        return self._peak.result()


class _PeakTracker:
    """The largest absolute value of the signal oversampled to >= 192 kHz, fed in pieces: each block is
    oversampled with `_PEAK_CONTEXT` samples of the signal on either side, as if it were whole.

    Only the stretches that could raise the peak are oversampled: an oversampled point is a weighted sum
    of the `_SUPPORT` samples on either side, so it is at most `bound` (the filter's largest sum of
    absolute weights over its phases, about 2.24) times their largest magnitude (bounded here per chunk
    of 64 samples with its neighbours). Where that is no more than the peak so far, nothing there can be
    larger, and the result is the same number the whole block oversampled gives (each point is computed
    from the same samples with the same weights). Speech is near its peak in a few per cent of its
    samples; noise everywhere."""

    def __init__(self, rate: int) -> None:
        self.factor = max(1, math.ceil(TRUE_PEAK_RATE / rate))
        self.bound = _bound(self.factor) * (1 + 1e-9)  # rounding in the filter's sums
        self.peak = 0.0
        self.before = np.zeros(0)  # the context before the pending samples
        self.pending = np.zeros(0)

    def add(self, x: np.ndarray) -> None:
        self.peak = max(self.peak, float(np.abs(x).max()))  # the samples themselves are points of it
        self.pending = np.concatenate([self.pending, x])
        while len(self.pending) >= _PEAK_BLOCK + _PEAK_CONTEXT:
            self._oversample(_PEAK_BLOCK)

    def add_silence(self, n: int) -> None:
        """Silence whose oversampled peak is zero, but next to the pending samples."""
        self.add(np.zeros(min(n, _PEAK_CONTEXT)))
        if n > _PEAK_CONTEXT:
            self.result()  # flush what was pending, then the rest of the silence is context only
            self.before = np.zeros(_PEAK_CONTEXT)

    def _oversample(self, count: int) -> None:
        from scipy.signal import resample_poly

        block, after = self.pending[:count], self.pending[count:count + _PEAK_CONTEXT]
        if self.factor > 1 and count:
            x = np.concatenate([self.before, block, after])
            start = len(self.before)
            for first, last in self._could_raise(block, after):
                lo, hi = max(0, start + first - _PEAK_CONTEXT), min(len(x), start + last + _PEAK_CONTEXT)
                up = resample_poly(x[lo:hi], self.factor, 1, window=_filter(self.factor))
                keep = up[(start + first - lo) * self.factor:(start + last - lo) * self.factor]
                self.peak = max(self.peak, float(np.abs(keep).max()))
        self.before = np.concatenate([self.before, block])[-_PEAK_CONTEXT:]
        self.pending = self.pending[count:]

    def _could_raise(self, block: np.ndarray, after: np.ndarray) -> list[tuple[int, int]]:
        """[first, last) stretches of the block whose oversampled points could exceed the peak so far:
        the block in chunks of `_CHUNK` samples (more than `_SUPPORT`), each bounded by the largest sample
        in it and its two neighbours (the context next to the first and the last)."""
        chunks = np.maximum.reduceat(np.abs(block), np.arange(0, len(block), _CHUNK))
        edges = [float(np.abs(side).max()) if len(side) else 0.0 for side in (self.before, after)]
        near = np.maximum(chunks, np.maximum(np.concatenate([edges[:1], chunks[:-1]]),
                                             np.concatenate([chunks[1:], edges[1:]])))
        stretches = _runs(np.flatnonzero(near * self.bound > self.peak), gap=_JOIN // _CHUNK)
        return [(first * _CHUNK, min(len(block), last * _CHUNK)) for first, last in stretches]

    def result(self) -> float:
        if len(self.pending):
            self._oversample(len(self.pending))
        return 20.0 * math.log10(self.peak) if self.peak > 0 else SILENT


@lru_cache(maxsize=8)
def _filter(factor: int) -> np.ndarray:
    """The low-pass filter `resample_poly(x, factor, 1)` designs on every call (its default Kaiser window),
    designed once; given as its `window` it is used as is, so the samples are the same."""
    from scipy.signal import firwin

    half = 10 * factor
    taps = firwin(2 * half + 1, 1.0 / factor, window=("kaiser", 5.0))
    taps.setflags(write=False)  # resample_poly copies it
    return taps


@lru_cache(maxsize=8)
def _bound(factor: int) -> float:
    """The largest magnitude `resample_poly(x, factor, 1)` gives per unit of the largest |x| near it: the
    largest sum of absolute weights over the filter's phases, read from its impulse response."""
    from scipy.signal import resample_poly

    impulse = np.zeros(4 * _SUPPORT + 1)
    impulse[2 * _SUPPORT] = 1.0
    response = resample_poly(impulse, factor, 1, window=_filter(factor))
    assert not response[:_SUPPORT * factor].any() and not response[-_SUPPORT * factor:].any()  # its support
    return max(float(np.abs(response[phase::factor]).sum()) for phase in range(factor))


def _runs(indices: np.ndarray, *, gap: int) -> list[tuple[int, int]]:
    """Sorted indices -> [first, last + 1) stretches, joined where fewer than `gap` apart."""
    if not len(indices):
        return []
    breaks = np.flatnonzero(np.diff(indices) > gap)
    firsts = np.concatenate([indices[:1], indices[breaks + 1]])
    lasts = np.concatenate([indices[breaks], indices[-1:]]) + 1
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))
