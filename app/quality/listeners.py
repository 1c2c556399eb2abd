"""The checks that listen; each model ships inside its package (nothing is downloaded) and is loaded
once per process, on first use, with one thread (a CPU worker is one process a core).

    quality  DNSMOS P.835's overall score (Microsoft's non-intrusive MOS estimate, as `speechmos` ships
             its ONNX models), 1..5
    voice    the cosine similarity of GE2E speaker embeddings (Resemblyzer's pretrained encoder) of the
             clip and its reference voice, -1..1
    words    pocketsphinx's US English recogniser, then the word error rate (jiwer) against the text,
             both sides through the project's own English normalisation

Every function takes 16 kHz mono float32 in [-1, 1].
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from app.quality.report import Check
from app.text.normalise import is_english, normalise

RATE = 16000
_WORD_RE = re.compile(r"[^a-z0-9' ]+")
_ASR_LOCK = threading.Lock()  # one decoder a process; a decoder is not safe across threads


@lru_cache(maxsize=1)
def _dnsmos() -> Any:
    import onnxruntime as ort
    from speechmos import dnsmos

    class OneThread(dnsmos.DNSMOS):  # speechmos's scorer, its sessions on one thread and the CPU
        def __init__(self, primary: str, p808: str) -> None:
            options = ort.SessionOptions()
            options.intra_op_num_threads = options.inter_op_num_threads = 1
            cpu = ["CPUExecutionProvider"]
            self.primary_model_path = primary
            self.onnx_sess = ort.InferenceSession(primary, options, providers=cpu)
            self.p808_onnx_sess = ort.InferenceSession(p808, options, providers=cpu)

    models = Path(dnsmos.__file__).parent / "dnsmos_models"
    return OneThread(str(models / "sig_bak_ovr.onnx"), str(models / "model_v8.onnx"))


@lru_cache(maxsize=1)
def _encoder() -> Any:
    import torch
    from resemblyzer import VoiceEncoder

    torch.set_num_threads(1)
    return VoiceEncoder("cpu", verbose=False)


@lru_cache(maxsize=1)
def _decoder() -> Any:
    from pocketsphinx import Decoder

    return Decoder(samprate=RATE, loglevel="FATAL")


def quality(wave: np.ndarray, *, min_mos: float) -> Check:
    scores = _dnsmos()(np.clip(wave, -1.0, 1.0).astype(np.float32), RATE, False)
    mos = float(scores["ovrl_mos"])
    bound = f">= {min_mos:g} (DNSMOS overall, 1..5)"
    if mos < min_mos:
        return Check("quality", "fail", score=mos, threshold=bound,
                     reason=f"DNSMOS {mos:.2f}: noise or babble, not clean speech")
    return Check("quality", "pass", score=mos, threshold=bound)


def embedding(wave: np.ndarray) -> np.ndarray | None:
    """The clip's GE2E embedding (unit length), or None when no voiced speech is found in it."""
    from resemblyzer import preprocess_wav

    voiced = preprocess_wav(np.asarray(wave, dtype=np.float32), RATE)
    if voiced.size < RATE // 4:
        return None
    return np.asarray(_encoder().embed_utterance(voiced), dtype=np.float32)


def voice(wave: np.ndarray, reference: np.ndarray, *, min_similarity: float) -> Check:
    bound = f">= {min_similarity:g} (GE2E cosine similarity to the reference)"
    ref = embedding(reference)
    if ref is None:
        return Check("voice", "skipped", threshold=bound, reason="no voiced speech in the reference")
    clip = embedding(wave)
    if clip is None:
        return Check("voice", "fail", score=0.0, threshold=bound, reason="no voiced speech in the clip")
    similarity = float(np.dot(clip, ref))
    if similarity < min_similarity:
        return Check("voice", "fail", score=similarity, threshold=bound,
                     reason=f"similarity {similarity:.2f}: another voice than the reference's")
    return Check("voice", "pass", score=similarity, threshold=bound)


def words_of(text: str) -> list[str]:
    """Text as words to compare: the guide voice's normalisation, lower case, no punctuation."""
    return _WORD_RE.sub(" ", normalise(text).lower()).split()


def transcribe(wave: np.ndarray) -> str:
    pcm = (np.clip(wave, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    with _ASR_LOCK:
        decoder = _decoder()
        decoder.start_utt()
        decoder.process_raw(pcm, full_utt=True)
        decoder.end_utt()
        hyp = decoder.hyp()
    return hyp.hypstr if hyp is not None else ""


def words(wave: np.ndarray, text: str, language: str, *, max_wer: float, min_words: int) -> Check:
    import jiwer

    bound = f"<= {max_wer:g} word error rate (texts of {min_words}+ words)"
    if not is_english(language):
        return Check("words", "skipped", threshold=bound,
                     reason=f"no recogniser for language {language!r}: the words are checked in English only")
    expected = words_of(text)
    if len(expected) < min_words:
        return Check("words", "skipped", threshold=bound,
                     reason=f"{len(expected)} words: too few for a word error rate to mean anything")
    heard = words_of(transcribe(wave))
    wer = float(jiwer.wer(" ".join(expected), " ".join(heard))) if heard else 1.0
    if wer > max_wer:
        return Check("words", "fail", score=wer, threshold=bound,
                     reason=f"word error rate {wer:.2f}: heard {' '.join(heard[:12])!r}")
    return Check("words", "pass", score=wer, threshold=bound)
