"""Where a segment's speech tokens come from: the token source its kind names.

    tokens  the segment carries them (a manifest's inline tokens): ready at planning time
    text    its normalised text, spoken by the guide voice (espeak-ng) on a CPU worker: its guide speech
            (`app.text.guide_speech`), which the GPU worker S3-tokenizes in batches with other segments'
    audio   a source recording (a manifest's file, CLI only) to re-voice, S3-tokenized on the CPU worker

`source_for(segment)` gives the source; `ready_at_plan` says whether its tokens can be had while the book
is planned (then the segment's job is made at once) or need a CPU task of their own (`book.tokenize`).
`tokens` gives token ids or guide speech (then the segment's job is a text job whose tokens the GPU worker
makes). Tokens come out as an ordinary synth job's input, 25 per second. The S3 tokenizer is the model
folder's, or the loud stand-in with dummy weights (`app.s3`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import soundfile as sf

from app.audio import resample
from app.books.planning.plan import PlanSegment
from app.errors import BadInput
from app.s3 import speech_tokens, tokenizer_for
from app.speech import S3_SAMPLE_RATE
from app.text.guide_speech import GuideSpeech
from app.text.tokens import segment_speech


@dataclass(frozen=True)
class BookContext:
    """What a source may need besides the segment: the book's language, its manifest's folder (audio
    segments, CLI only) and the model folder whose tokenizer makes the tokens (None: the stand-in)."""

    language: str = "en"
    base_dir: Path | None = None
    model_dir: Path | None = None


class TokenSource(Protocol):
    ready_at_plan: bool

    def tokens(self, segment: PlanSegment, book: BookContext) -> list[int] | GuideSpeech:
        """The segment's speech token ids, or its guide speech for the GPU worker to tokenize; BadInput
        (and kin) when they cannot be made."""
        ...


class OwnTokens:
    ready_at_plan = True

    def tokens(self, segment: PlanSegment, book: BookContext) -> list[int]:
        if segment.tokens is None:
            raise BadInput(f"segment {segment.key[:12]} has no tokens of its own")
        return list(segment.tokens)


class GuideVoiceText:
    ready_at_plan = False

    def tokens(self, segment: PlanSegment, book: BookContext) -> GuideSpeech:
        return segment_speech(segment.spoken, book.language)


class SourceSpeech:
    ready_at_plan = False

    def tokens(self, segment: PlanSegment, book: BookContext) -> list[int]:
        if book.base_dir is None or segment.audio is None:
            raise BadInput(f"audio segment {segment.key[:12]} has no manifest folder to read it from")
        pcm, rate = sf.read(book.base_dir / segment.audio, dtype="float32", always_2d=True)
        return _tokenize(resample(np.ascontiguousarray(pcm.mean(axis=1)), rate, S3_SAMPLE_RATE).numpy(), book)


def _tokenize(wave16k: np.ndarray, book: BookContext) -> list[int]:
    return speech_tokens(wave16k, tokenizer_for(book.model_dir))


SOURCES: dict[str, TokenSource] = {"tokens": OwnTokens(), "text": GuideVoiceText(), "audio": SourceSpeech()}


def source_for(segment: PlanSegment) -> TokenSource:
    return SOURCES[segment.kind]
