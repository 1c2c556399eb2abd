"""The guide voice speaks normalised text as 16 kHz PCM, through the wheel or the espeak-ng binary."""

import shutil

import numpy as np
import pytest

from app.errors import BadInput
from app.text import guide_voice
from app.text.guide_voice import GUIDE_SAMPLE_RATE, GuideOptions, identity, speak

SENTENCE = "The lighthouse keeper climbed one hundred thirty-two steps."


def test_a_sentence_becomes_16_khz_speech_of_plausible_length():
    pcm = speak(SENTENCE)
    assert pcm.dtype == np.float32 and pcm.ndim == 1
    seconds = len(pcm) / GUIDE_SAMPLE_RATE
    assert 1.5 < seconds < 8.0  # 8 words at about 165 words a minute
    assert 0.05 < np.abs(pcm).max() <= 1.0 and np.isfinite(pcm).all()


def test_speech_is_repeatable_and_grows_with_the_text():
    once, again = speak(SENTENCE), speak(SENTENCE)
    # libespeak-ng carries a little prosody state from one utterance to the next (a few ms)
    assert abs(len(once) - len(again)) < 0.02 * len(once)
    assert len(speak(f"{SENTENCE} {SENTENCE}")) > 1.6 * len(once)


def test_rate_and_voice_options_change_the_audio():
    slow = speak(SENTENCE, GuideOptions(rate_wpm=100))
    assert len(slow) > 1.3 * len(speak(SENTENCE))
    assert len(speak("Guten Morgen, wie geht es dir?", GuideOptions(voice="de"))) > GUIDE_SAMPLE_RATE // 2


def test_options_follow_the_books_language():
    assert GuideOptions.for_language("en").voice == "en-us"
    assert GuideOptions.for_language("de").voice == "de"
    assert GuideOptions.for_language("pt-BR").voice == "pt-br"
    assert len(speak("Olá, tudo bem?", GuideOptions.for_language("pt-BR"))) > GUIDE_SAMPLE_RATE // 4


def test_identity_names_the_backend_version_and_options():
    ident = identity(GuideOptions(voice="en-gb", rate_wpm=150))
    assert ident["voice"] == "en-gb" and ident["rate_wpm"] == 150
    assert str(ident["backend"]).startswith(("espeakng-loader ", "espeak-ng binary "))
    assert any(ch.isdigit() for ch in str(ident["backend"]))


@pytest.mark.parametrize(
    "text, message", [("   ", "no text"), ("word " * 1000, "too long for the guide voice")]
)
def test_empty_and_over_long_text_is_refused(text, message):
    with pytest.raises(BadInput, match=message):
        speak(text)


def test_an_unknown_voice_is_refused():
    with pytest.raises(BadInput, match="no voice 'xx-nope'|could not speak"):
        speak("Hello.", GuideOptions(voice="xx-nope"))
    with pytest.raises(BadInput, match="not an espeak-ng voice name"):
        speak("Hello.", GuideOptions(voice="../../../etc/passwd"))


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="the Debian espeak-ng binary is not installed")
def test_the_binary_fallback_speaks_the_same_sentence(monkeypatch):
    wheel = speak(SENTENCE)
    monkeypatch.setattr(guide_voice, "_library", lambda: None)
    binary = speak(SENTENCE)
    assert guide_voice.backend().startswith("espeak-ng binary ")
    assert abs(len(binary) - len(wheel)) < 0.25 * len(wheel)  # another espeak-ng version, same speech


def test_threads_speaking_at_once_each_get_their_own_sentence():
    from concurrent.futures import ThreadPoolExecutor

    texts = ["One.", "This sentence is a good deal longer than the first one was.", "Two words.", SENTENCE]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(speak, texts))
    for text, pcm in zip(texts, together, strict=True):
        alone = speak(text)
        assert abs(len(pcm) - len(alone)) < 0.05 * len(alone) + 800
