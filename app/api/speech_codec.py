"""Encoding a stream of 16-bit mono PCM (24 kHz, what the GPU worker writes) into the formats OpenAI's
speech API names, chunk by chunk, so the encoded bytes can be sent while the job still renders.

pcm is the samples as they are (OpenAI's pcm: 24 kHz, 16-bit signed, little-endian); wav is a RIFF
header whose sizes say "unknown" (the length is not known when it is sent) followed by those samples;
flac, mp3, opus (in Ogg) and aac (ADTS) are encoded by PyAV (FFmpeg's encoders, no binary needed) into
a non-seekable sink. It does not read files or talk to the job: `app.api.speech_stream` does.

A non-seekable FLAC's STREAMINFO says "length unknown" (total samples 0), which libsndfile reads as an
endless file (soundfile: "array is too big") and ffprobe as no duration. A job's length is known before
its audio starts (its tokens times 960 samples), so given `total_samples` the FLAC encoder writes that
into the header and sends exactly that many samples (cut or padded with silence, should the job's audio
differ). The WAV header keeps the usual "unknown" sizes, which soundfile and FFmpeg read to the end.
"""

from __future__ import annotations

import struct
from typing import Any

import av
import numpy as np

from app.errors import BadInput
from app.speech import SAMPLE_RATE

# Ogg pages of at most 0.1 s (the muxer's default holds a page for a second): Opus streams as it comes.
MUX_OPTIONS = {"ogg": {"page_duration": "100000"}}
# format -> (container, codec, media type); pcm and wav need no encoder.
ENCODED = {"flac": ("flac", "flac", "audio/flac"), "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
           "opus": ("ogg", "libopus", "audio/ogg"), "aac": ("adts", "aac", "audio/aac")}
MEDIA_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", **{k: v[2] for k, v in ENCODED.items()}}
FORMATS = tuple(MEDIA_TYPES)


def check_format(fmt: str) -> str:
    if fmt not in MEDIA_TYPES:
        raise BadInput(f"response_format {fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    return fmt


class _Sink:
    """Where the muxer writes: collected until taken. No seek: FFmpeg treats it as a stream."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        self.data += data
        return len(data)

    def take(self) -> bytes:
        out, self.data = bytes(self.data), bytearray()
        return out


def wav_stream_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length (RIFF and data sizes 0xFFFFFFFF)."""
    unknown = 0xFFFFFFFF
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt " + struct.pack("<I", 16) + fmt + \
        b"data" + struct.pack("<I", unknown)


def with_total_samples(flac: bytes, total: int) -> bytes:
    """FLAC bytes whose STREAMINFO (the first metadata block) says `total` samples."""
    # "fLaC", a 4-byte block header, then STREAMINFO: block sizes (4 bytes), frame sizes (6), and 8 bytes
    # of sample rate (20 bits), channels (3), bits per sample (5) and total samples (36)
    assert flac[4] & 0x7F == 0 and len(flac) >= 26, "STREAMINFO comes first"
    packed = int.from_bytes(flac[18:26], "big")
    packed = (packed & ~((1 << 36) - 1)) | (total & ((1 << 36) - 1))
    return flac[:18] + packed.to_bytes(8, "big") + flac[26:]


class Encoder:
    """feed(pcm bytes) -> encoded bytes ready now; finish() -> the rest. pcm bytes must be whole samples."""

    def __init__(self, fmt: str, sample_rate: int = SAMPLE_RATE, total_samples: int | None = None) -> None:
        self.fmt = check_format(fmt)
        self.sample_rate = sample_rate
        self.total = total_samples if fmt == "flac" else None
        self.sent = 0  # samples taken in
        self.header_due = self.total is not None  # the first bytes out hold STREAMINFO, to be patched
        self.started = False
        self.container: Any = None
        if fmt in ENCODED:
            container, codec, _ = ENCODED[fmt]
            self.sink = _Sink()
            self.container = av.open(self.sink, mode="w", format=container,
                                     options=MUX_OPTIONS.get(container, {}))
            self.stream = self.container.add_stream(codec, rate=sample_rate, layout="mono")
            self.stream.codec_context.bit_rate = 64000 if fmt != "flac" else 0
            self.resampler: Any = None
            self.pts = 0

    def feed(self, pcm: bytes) -> bytes:
        head = b""
        if not self.started:
            self.started = True
            head = wav_stream_header(self.sample_rate) if self.fmt == "wav" else b""
        if self.container is None:
            return head + pcm
        if self.total is not None:
            pcm = pcm[:max(0, self.total - self.sent) * 2]
        self.sent += len(pcm) // 2
        if pcm:
            self._encode(np.frombuffer(pcm, dtype="<i2"))
        return head + self._take()

    def finish(self) -> bytes:
        head = self.feed(b"") if not self.started else b""
        if self.container is None:
            return head
        while self.total is not None and self.sent < self.total:  # a second of silence at a time
            head += self.feed(bytes(2 * min(self.total - self.sent, self.sample_rate)))
        if self.resampler is not None:
            self._mux(self.resampler.resample(None))
        self.container.mux(self.stream.encode(None))
        self.container.close()
        return head + self._take()

    def _take(self) -> bytes:
        out = self.sink.take()
        if self.header_due and out:
            assert self.total is not None and out.startswith(b"fLaC"), "the muxer writes its header first"
            out, self.header_due = with_total_samples(out, self.total), False
        return out

    def _encode(self, samples: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate
        if self.resampler is None:  # the codec's own sample format and frame size (opened on first use)
            ctx = self.stream.codec_context
            self.resampler = av.AudioResampler(format=ctx.format.name if ctx.format else "s16", layout="mono",
                                               rate=self.sample_rate, frame_size=ctx.frame_size or None)
        self._mux(self.resampler.resample(frame))

    def _mux(self, frames: list[Any]) -> None:
        for frame in frames:
            frame.pts = self.pts
            self.pts += frame.samples
            self.container.mux(self.stream.encode(frame))
