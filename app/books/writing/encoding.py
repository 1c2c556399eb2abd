"""How a book's compressed outputs are encoded: the M4B's (and the read-along EPUB's) AAC and the MP3s'
bitrate, and the sample rate of both.

Defaults follow what audiobooks of speech are usually given: mono AAC at 64 kbit/s, and the render's
own 24 kHz (nothing resampled; speech from the model has nothing above 12 kHz to keep). An MP3 for a
store that asks more can be given it: ACX (Audible's) asks for MP3 at 192 kbit/s or more, constant
bitrate, 44.1 kHz, which is `mp3_bitrate_kbps=192, sample_rate=44100`. Encoding is mono, constant
bitrate for MP3 (LAME). What can be asked is checked before a book is read:

- the sample rate one of 16, 22.05, 24, 32, 44.1 or 48 kHz (rates both encoders take);
- a bitrate one of the MP3 bitrates, 32 to 320 kbit/s; an MP3 at 16 to 24 kHz (MPEG-2) at most 160;
- AAC at most 6 bits per sample per channel (6144 bits per 1024-sample frame, which FFmpeg's AAC
  encoder clamps to), so at 24 kHz at most 144 kbit/s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.errors import BadInput
from app.speech import SAMPLE_RATE

SAMPLE_RATES = (16000, 22050, 24000, 32000, 44100, 48000)
BITRATES = (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)  # kbit/s, MPEG-1 layer III
MPEG2_MAX_KBPS = 160  # layer III at 16, 22.05 and 24 kHz
DEFAULT_KBPS = 64


@dataclass(frozen=True)
class Encoding:
    bitrate_kbps: int = DEFAULT_KBPS  # the M4B's AAC (and the read-along EPUB's)
    mp3_bitrate_kbps: int = DEFAULT_KBPS
    sample_rate: int | None = None  # None: the chapter files' own rate (the render's, 24 kHz)

    def rate(self, source_rate: int = SAMPLE_RATE) -> int:
        return self.sample_rate or source_rate

    def check(self) -> None:
        """BadInput with the reason for a choice the encoders cannot honour."""
        rate = self.rate()
        if rate not in SAMPLE_RATES:
            raise BadInput(f"sample rate {rate} Hz is not one of {list(SAMPLE_RATES)}")
        for what, kbps in (("bitrate", self.bitrate_kbps), ("MP3 bitrate", self.mp3_bitrate_kbps)):
            if isinstance(kbps, bool) or kbps not in BITRATES:
                raise BadInput(f"{what} {kbps!r} kbit/s is not one of {list(BITRATES)}")
        if rate < 32000 and self.mp3_bitrate_kbps > MPEG2_MAX_KBPS:
            raise BadInput(f"an MP3 at {rate} Hz takes at most {MPEG2_MAX_KBPS} kbit/s; "
                           f"ask 32000 Hz or more for {self.mp3_bitrate_kbps}")
        aac_max = 6 * rate // 1000
        if self.bitrate_kbps > aac_max:
            raise BadInput(f"AAC at {rate} Hz mono takes at most {aac_max} kbit/s, not {self.bitrate_kbps}")

    def describe(self, source_rate: int, *, mp3: bool) -> dict[str, Any]:
        """What the outputs were encoded with, for chapters.json."""
        out: dict[str, Any] = {"m4b": {"codec": "aac", "bitrate_kbps": self.bitrate_kbps,
                                       "sample_rate": self.rate(source_rate), "channels": 1}}
        if mp3:
            out["mp3"] = {"codec": "mp3", "bitrate_kbps": self.mp3_bitrate_kbps, "mode": "cbr",
                          "sample_rate": self.rate(source_rate), "channels": 1}
        return out


DEFAULT_ENCODING = Encoding()
