"""Text -> guide speech for a single job, the speech its tokens are made of: the books' `text` source,
for a whole text at once.

    check_text(text, language, max_tokens)   at submission, cheap (no torch, no speech): the text
                                             normalised and cut into segments, its language tag checked
                                             and spoken by a guide voice (espeak-ng is asked, not run),
                                             its estimated length within the job limit; BadInput if not
    text_speech(text, language)              on a CPU worker (`job.tokenize`): each segment spoken by the
                                             guide voice (espeak-ng), followed by its pause in silence
                                             (`app.text.guide_speech`); the GPU worker S3-tokenizes the
                                             segments, many in one forward, and joins their tokens in order
    segment_speech(spoken, language)         one normalised segment as a book speaks it (a book segment's
                                             job: its pause is the chapter's, not its speech's)

The segmentation, normalisation (numbers, abbreviations, compass points) and pauses are the books'
(`app.text.normalise`, `app.text.segment`), so a sentence sounds the same in a job as in a book. Paragraphs
are separated by a blank line. With no model folder the S3 tokenizer is the stand-in (`app.s3`): its tokens
do not say the text, and the job's record says so (`STAND_IN_NOTE`). The token count is known from the
speech's length, so speech over the job's limit fails on the CPU worker, before it is stored.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from app.errors import BadAudio, BadInput, BadTokens
from app.speech import TOKEN_RATE
from app.text.segment import TextSegment, segment_paragraph

if TYPE_CHECKING:
    from app.settings import Settings

if TYPE_CHECKING:  # torch and safetensors load with the speech, on a worker, not at submission
    import numpy as np

    from app.text.guide_speech import GuideSpeech

MAX_TEXT_CHARS = 100_000  # far above any single job's token limit; bounds the work of checking
AS_A_BOOK = ("render it as a book, in chapters: wavefarm book render FILE.txt --voice VOICE --out DIR "
             "(POST /v1/books)")
_LANGUAGE_RE = re.compile(r"[A-Za-z]{2,3}(-[A-Za-z0-9]{1,8}){0,3}")  # a BCP 47 tag such as en, en-GB
_PARAGRAPH_RE = re.compile(r"\n\s*\n")
STAND_IN_NOTE = ("tokens from the stand-in tokenizer (the worker that made them has no WAVEFARM_MODEL_DIR): "
                 "they do not say the text")


def text_job_tokens(settings: Settings) -> int:
    """The estimated tokens a text job may have at submission: `max_text_job_s` of speech, within the
    job limit (the CPU worker holds its real tokens to `max_tokens`: an estimate a little short passes)."""
    return min(settings.max_tokens, int(settings.max_text_job_s * TOKEN_RATE))


def check_language(language: str) -> str:
    if not isinstance(language, str) or not _LANGUAGE_RE.fullmatch(language):
        raise BadInput(f"language must be a tag such as 'en' or 'en-GB', not {str(language)[:40]!r}")
    return language


def check_text(text: str, language: str, *, max_tokens: int) -> list[TextSegment]:
    """The text's segments, as `text_speech` will speak them; BadInput for no text, a bad language tag
    or an estimated length over `max_tokens` (such a text is a book: POST /v1/books)."""
    check_language(language)
    from app.text.guide_voice import options_for  # loads espeak-ng's library once per process

    options_for(language.lower())  # a language no guide voice speaks is refused now, not on a worker
    if not isinstance(text, str) or not text.strip():
        raise BadInput("text is empty")
    if len(text) > MAX_TEXT_CHARS:
        raise BadInput(f"text of {len(text)} characters is over the limit of {MAX_TEXT_CHARS}; {AS_A_BOOK}")
    segments = [segment for i, paragraph in enumerate(_PARAGRAPH_RE.split(text))
                for segment in segment_paragraph(paragraph, i, language=language)]
    if not segments:
        raise BadInput("text has nothing to speak once normalised")
    estimate = sum(s.est_tokens for s in segments)
    if estimate > max_tokens:
        raise BadInput(f"text is about {estimate} tokens of speech ({estimate // TOKEN_RATE} s), over the "
                       f"job limit of {max_tokens} ({max_tokens // TOKEN_RATE} s); {AS_A_BOOK}")
    return segments


def text_speech(text: str, language: str, *, max_tokens: int) -> GuideSpeech:
    """The job's guide speech: every segment through the guide voice, each with its pause (silence), at the
    guide voice's own rate (the GPU worker resamples it). BadInput when the language has no guide voice;
    BadTokens when the speech is longer than `max_tokens`; BadAudio for a segment too short to tokenize."""
    import numpy as np

    from app.text.guide_voice import options_for, speak_native

    segments = check_text(text, language, max_tokens=max_tokens)
    options = options_for(language)
    spoken = [(speak_native(segment.text, options), segment.pause_after_ms) for segment in segments]
    rate = spoken[0][0][1]
    speech = _guide_speech([np.concatenate([pcm, np.zeros(rate * pause_ms // 1000, np.int16)])
                            for (pcm, _), pause_ms in spoken], rate)
    n_tokens = sum(speech.token_counts())
    if n_tokens > max_tokens:
        raise BadTokens(f"the text's speech: {n_tokens} tokens; at most {max_tokens} are accepted")
    return speech


def segment_speech(spoken: str, language: str) -> GuideSpeech:
    """One book segment's guide speech: its normalised text spoken alone, no pause after it, at the guide
    voice's own rate. BadInput when the language has no guide voice; BadAudio when it is too short to
    tokenize."""
    from app.text.guide_voice import options_for, speak_native

    pcm, rate = speak_native(spoken, options_for(language))
    return _guide_speech([pcm], rate)


def _guide_speech(segments: list[np.ndarray], rate: int) -> GuideSpeech:
    from app.text.guide_speech import GuideSpeech

    try:
        return GuideSpeech(segments, rate)
    except ValueError as exc:
        raise BadAudio(str(exc)) from exc
