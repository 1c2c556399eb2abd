"""The facts of the speech format that every process shares (MODEL.md), each defined once here.

Speech tokens and their rates, the reference prompt, the audio wavefarm writes, and the file names of
a released model folder. Plain constants (the standard library only), so the model's configuration
(`gpu_worker.model.config`), the API, the books, the scripts and the tests all read the same numbers.
Streaming details that only the decoder needs (chunk sizes, cache lengths) stay with the model.

`check_tokens` is the one rule for a list of speech tokens, used wherever tokens come in (jobs, book
manifests, segment jobs, the engine's own guard).
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Iterable
from typing import Any

from app.errors import BadTokens

# Speech tokens: S3 tokenizer v2 ids.
VOCAB_SIZE = 6561  # ids 0..6560
SILENCE_TOKEN = 4218
TOKEN_RATE = 25  # tokens per second of speech
MAX_SEED = 2**63 - 1  # a job's (and a book's) noise seed: 0..MAX_SEED


def check_tokens(tokens: Iterable[Any], *, max_tokens: int | None = None, where: str = "") -> list[int]:
    """A non-empty list of integer ids in 0..VOCAB_SIZE - 1, at most `max_tokens` long -> those ids as
    ints; BadTokens otherwise, saying which token is wrong (prefixed with `where`, e.g. a manifest item)."""
    at = f"{where}: " if where else ""
    if isinstance(tokens, str | bytes | bytearray) or not isinstance(tokens, Iterable):
        raise BadTokens(f"{at}tokens must be a non-empty list of integers")
    out = list(tokens)
    if not out:
        raise BadTokens(f"{at}tokens are empty; send a non-empty list of integers")
    if max_tokens is not None and len(out) > max_tokens:
        raise BadTokens(f"{at}{len(out)} tokens; at most {max_tokens} are accepted")
    # Fast path: plain ints in range (what a parsed JSON list holds); anything else is judged one by one.
    if all(type(t) is int for t in out) and 0 <= min(out) and max(out) < VOCAB_SIZE:
        return out
    ids: list[int] = []
    for i, token in enumerate(out):
        integral = isinstance(token, numbers.Integral) and not isinstance(token, bool)
        if not integral or not 0 <= int(token) < VOCAB_SIZE:
            raise BadTokens(f"{at}token {i} is {token!r}, not an integer in 0..{VOCAB_SIZE - 1}")
        ids.append(int(token))
    return ids

# Mel frames and audio.
MEL_BINS = 80
MEL_PER_TOKEN = 2  # 50 mel frames per second
SAMPLE_RATE = 24000  # audio out, and the normalised reference voice
SAMPLES_PER_MEL = 480
SAMPLES_PER_TOKEN = MEL_PER_TOKEN * SAMPLES_PER_MEL  # 960: a job of N tokens is N * 960 samples
S3_SAMPLE_RATE = 16000  # what the S3 tokenizer and the kaldi fbank read

# The reference voice: mono, 24 kHz, exactly this long (a fixed prompt keeps cache shapes fixed).
PROMPT_SECONDS = 6.0
PROMPT_SAMPLES = int(SAMPLE_RATE * PROMPT_SECONDS)
PROMPT_FRAMES = round(PROMPT_SECONDS * TOKEN_RATE * MEL_PER_TOKEN)  # 300: an installed voice's prompt mel

# A released model folder (Step-Audio-2-mini/token2wav, MiniCPM-o-4_5/assets/token2wav).
FLOW_YAML = "flow.yaml"
FLOW_PT = "flow.pt"
HIFT_PT = "hift.pt"
CAMPPLUS_ONNX = "campplus.onnx"
TOKENIZER_ONNX = "speech_tokenizer_v2_25hz.onnx"
MODEL_FILES = (FLOW_YAML, FLOW_PT, HIFT_PT, CAMPPLUS_ONNX, TOKENIZER_ONNX)


class OutputFormat(enum.StrEnum):
    """What a job's (or a book's chapters') audio is written as: 16-bit PCM, mono, 24 kHz."""

    WAV = "wav"
    FLAC = "flac"


MEDIA_TYPES = {OutputFormat.WAV: "audio/wav", OutputFormat.FLAC: "audio/flac"}
