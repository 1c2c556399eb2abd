"""`submit -o FILE`: the container is chosen from FILE's extension, and one it cannot write is refused
before anything is submitted.

.wav and .flac are what a job writes itself (its output format is set to match); .mp3, .opus (.ogg)
and .m4a are encoded here from the job's WAV with the codecs the speech endpoint streams
(`app.api.speech_codec`: LAME, Opus, AAC at its bit rate) through PyAV, into a file, so the container
gets its length and index (an M4A's is written at its end).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app.errors import BadInput

JOB_FORMATS = {".wav": "wav", ".flac": "flac"}
# suffix -> (container, codec)
ENCODED = {".mp3": ("mp3", "libmp3lame"), ".opus": ("ogg", "libopus"), ".ogg": ("ogg", "libopus"),
           ".m4a": ("mp4", "aac")}
SUFFIXES = (*JOB_FORMATS, *ENCODED)
BIT_RATE = 64000  # the speech endpoint's

if TYPE_CHECKING:  # numpy, soundfile and PyAV are imported when a file is written: the parser stays light
    import numpy as np


def output_plan(path: Path, output_format: str | None) -> str:
    """The job's output format for writing `path` (`output_format`: --format, if given); BadInput for an
    extension no writer here takes, or a --format that contradicts the extension."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise BadInput(f"-o {str(path)!r}: cannot write a {suffix or 'file without an extension'}; "
                       f"the extension chooses the container: {', '.join(SUFFIXES)}")
    wanted = JOB_FORMATS.get(suffix)
    if wanted and output_format and output_format != wanted:
        raise BadInput(f"--format {output_format} contradicts -o {str(path)!r} (a {wanted} file)")
    return wanted or output_format or "wav"


def write_output(path: Path, audio: bytes) -> None:
    """Write the job's audio (WAV or FLAC bytes) to `path` in the container its extension names."""
    suffix = path.suffix.lower()
    if suffix in JOB_FORMATS:
        path.write_bytes(audio)
        return
    import numpy as np
    import soundfile as sf

    pcm, rate = sf.read(io.BytesIO(audio), dtype="int16", always_2d=False)
    tmp = path.with_name(f".{path.name}.part")
    try:
        _encode(np.asarray(pcm, dtype=np.int16).reshape(1, -1), rate, tmp, *ENCODED[suffix])
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _encode(pcm: np.ndarray, rate: int, path: Path, container: str, codec: str) -> None:
    import av

    with av.open(str(path), mode="w", format=container) as out:
        stream: Any = out.add_stream(codec, rate=rate, layout="mono")  # an audio stream: PyAV's union
        stream.codec_context.bit_rate = BIT_RATE
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = rate
        ctx = stream.codec_context
        resampler = av.AudioResampler(format=ctx.format.name if ctx.format else "s16", layout="mono",
                                      rate=rate, frame_size=ctx.frame_size or None)
        pts = 0
        for piece in [*resampler.resample(frame), *resampler.resample(None)]:
            piece.pts, pts = pts, pts + piece.samples
            out.mux(stream.encode(piece))
        out.mux(stream.encode(None))
