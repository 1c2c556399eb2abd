"""The guide voice: espeak-ng speaks one segment's text, as its own int16 PCM at its own rate
(`speak_native`: what a CPU worker stores for the GPU worker) or as 16 kHz mono float32 (`speak`).

This is the first half of the `text` token source (`app.books.planning.tokens`); the S3 tokenizer turns the
guide audio into speech tokens (not here). `options_for(language)` picks the voice that speaks a book's
language. Two backends, the same voice data:
1. the `espeakng-loader` wheel (libespeak-ng + its data, from PyPI: works offline, nothing to install
   on the machine), driven through ctypes - preferred;
2. the Debian `espeak-ng` binary (`--stdout` WAV), when the wheel is missing or fails to load.
`identity()` names the backend's version and the options, for plan keys: another espeak-ng version
may speak differently, so its segments must not share keys.

libespeak-ng keeps global state (one voice, one callback): calls are serialised by a lock; one
process speaks one segment at a time. It also carries a little prosody state from one utterance to
the next, so the same text spoken twice in one process may differ by a few milliseconds (the binary,
a fresh process per call, repeats exactly). Plan keys do not depend on it: a key names the text and
the guide voice, and whichever rendering is stored first is reused.

Languages: any espeak-ng voice name ("en-us", "de", "fr" ...); the text should already be
normalised (`app.text.normalise`). `[[...]]` in the text is espeak-ng phoneme mnemonics (both backends):
only a pronunciation lexicon's entry puts it there (`app.books.planning.lexicon`).
"""

from __future__ import annotations

import ctypes
import io
import re
import shutil
import subprocess
import threading
from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
import soundfile as sf

from app.audio import resample
from app.errors import BadInput
from app.speech import S3_SAMPLE_RATE

GUIDE_SAMPLE_RATE = S3_SAMPLE_RATE  # what the S3 tokenizer reads
MAX_CHARS = 4000  # a segment is a few hundred characters; this bounds one call's work
_VOICE_RE = re.compile(r"[a-z]{2,3}(-[a-z0-9]{1,8}){0,3}(\+[a-z0-9]{1,16})?")  # never a path

_SYNC_OUTPUT = 2  # AUDIO_OUTPUT_SYNCHRONOUS
_DONT_EXIT = 0x8000  # espeakINITIALIZE_DONT_EXIT: report errors instead of exiting the process
_CHARS_UTF8 = 1
_PHONEMES = 0x100  # espeakPHONEMES: [[...]] is phoneme mnemonics, as the espeak-ng binary reads it too
_RATE, _PITCH = 1, 3  # espeak_PARAMETER
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


@dataclass(frozen=True)
class GuideOptions:
    voice: str = "en-us"
    rate_wpm: int = 165
    pitch: int = 50  # 0..99

    @classmethod
    def for_language(cls, language: str) -> GuideOptions:
        """A book's language ("en", "de", "pt-BR") -> the espeak-ng voice of that name."""
        code = language.lower()
        return cls(voice="en-us" if code in ("en", "") else code)


class _Library:
    """libespeak-ng from the espeakng-loader wheel, initialised once per process."""

    def __init__(self) -> None:
        import espeakng_loader

        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Info.restype = ctypes.c_char_p
        lib.espeak_Info.argtypes = [ctypes.c_void_p]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                     ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.sample_rate = lib.espeak_Initialize(_SYNC_OUTPUT, 0, espeakng_loader.get_data_path().encode(),
                                                 _DONT_EXIT)
        if self.sample_rate <= 0:
            raise OSError(f"espeak_Initialize failed ({self.sample_rate})")
        self.version = (lib.espeak_Info(None) or b"?").decode()
        self._chunks: list[np.ndarray] = []
        self._callback = _CALLBACK(self._collect)  # kept referenced: the library holds the pointer
        lib.espeak_SetSynthCallback(self._callback)
        self.lib = lib
        self.lock = threading.Lock()

    def _collect(self, wav: ctypes._Pointer, count: int, _events: int) -> int:
        if count > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0

    def has_voice(self, voice: str) -> bool:
        with self.lock:
            return bool(self.lib.espeak_SetVoiceByName(voice.encode()) == 0)

    def speak(self, text: str, options: GuideOptions) -> np.ndarray:
        """[T] int16 at `sample_rate`, as espeak-ng made it."""
        with self.lock:
            if self.lib.espeak_SetVoiceByName(options.voice.encode()) != 0:
                raise BadInput(f"espeak-ng has no voice {options.voice!r}")
            self.lib.espeak_SetParameter(_RATE, options.rate_wpm, 0)
            self.lib.espeak_SetParameter(_PITCH, options.pitch, 0)
            self._chunks = []
            data = text.encode()
            status = self.lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, _CHARS_UTF8 | _PHONEMES, None, None)
            self.lib.espeak_Synchronize()
            if status != 0:
                raise RuntimeError(f"espeak_Synth failed ({status})")
            chunks, self._chunks = self._chunks, []
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


_LOAD_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def _load_library() -> _Library | None:
    try:
        return _Library()
    except (ImportError, OSError, AttributeError):
        return None


def _library() -> _Library | None:
    # lru_cache alone could initialise libespeak-ng twice from two threads; its callback is global.
    with _LOAD_LOCK:
        return _load_library()


def _binary() -> str | None:
    return shutil.which("espeak-ng")


def backend() -> str:
    """'espeakng-loader <version>' or 'espeak-ng binary <version>'; RuntimeError when neither exists."""
    lib = _library()
    if lib is not None:
        return f"espeakng-loader {lib.version}"
    return f"espeak-ng binary {_binary_version()}"


@lru_cache(maxsize=1)
def _binary_version() -> str:
    binary = _binary()
    if binary is None:
        raise RuntimeError("no guide voice: install the espeakng-loader wheel (or the espeak-ng package)")
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True)
    words = out.stdout.split()
    return words[words.index("text-to-speech:") + 1] if "text-to-speech:" in words else out.stdout.strip()


def identity(options: GuideOptions = GuideOptions()) -> dict[str, object]:
    """What decides the guide audio: goes into the plan's text keys (`plan_book(guide_options=...)`)."""
    return {"backend": backend(), **asdict(options)}


@lru_cache(maxsize=64)
def options_for(language: str) -> GuideOptions:
    """The espeak-ng voice for a book's language: the tag itself, else its primary language ("en-gb" ->
    "en", "pt-pt" -> "pt"); BadInput when espeak-ng speaks neither."""
    first = GuideOptions.for_language(language)
    candidates = dict.fromkeys([first.voice, language.split("-")[0]])
    for voice in candidates:
        if _VOICE_RE.fullmatch(voice) and has_voice(voice):
            return GuideOptions(voice=voice, rate_wpm=first.rate_wpm, pitch=first.pitch)
    raise BadInput(f"no guide voice speaks language {language!r} (espeak-ng has none of {list(candidates)})")


def has_voice(voice: str) -> bool:
    """Whether espeak-ng has this voice, asked without speaking (no audio, nothing resampled)."""
    lib = _library()
    if lib is not None:
        return lib.has_voice(voice)
    binary = _binary()
    if binary is None:
        raise RuntimeError("no guide voice: install the espeakng-loader wheel (or the espeak-ng package)")
    done = subprocess.run([binary, "-q", "-v", voice, "--", "a"], capture_output=True, timeout=60,
                          check=False)
    return done.returncode == 0 and not done.stderr.strip()


def speak(text: str, options: GuideOptions = GuideOptions()) -> np.ndarray:
    """Normalised text -> [T] float32 mono PCM at 16 kHz (GUIDE_SAMPLE_RATE)."""
    pcm, rate = speak_native(text, options)
    return resample(pcm.astype(np.float32) / 32768.0, rate, GUIDE_SAMPLE_RATE).numpy().astype(np.float32,
                                                                                            copy=False)


def speak_native(text: str, options: GuideOptions = GuideOptions()) -> tuple[np.ndarray, int]:
    """Normalised text -> ([T] int16 mono PCM, its rate) as espeak-ng speaks it (22,050 Hz), not resampled:
    what a CPU worker stores for the GPU worker (`app.text.guide_speech`), which resamples it."""
    text = " ".join(text.split())
    if not _VOICE_RE.fullmatch(options.voice):
        raise BadInput(f"{options.voice[:40]!r} is not an espeak-ng voice name such as 'en-us'")
    if not text:
        raise BadInput("the guide voice was given no text")
    if len(text) > MAX_CHARS:
        raise BadInput(f"a segment of {len(text)} characters is too long for the guide voice "
                       f"(limit {MAX_CHARS})")
    lib = _library()
    if lib is not None:
        return lib.speak(text, options), lib.sample_rate
    return _speak_binary(text, options)


def _speak_binary(text: str, options: GuideOptions) -> tuple[np.ndarray, int]:
    binary = _binary()
    if binary is None:
        raise RuntimeError("no guide voice: install the espeakng-loader wheel (or the espeak-ng package)")
    command = [binary, "--stdout", "-v", options.voice, "-s", str(options.rate_wpm), "-p", str(options.pitch),
               "--", text]
    done = subprocess.run(command, capture_output=True, timeout=120, check=False)
    if done.returncode != 0 or not done.stdout:
        raise BadInput(f"espeak-ng could not speak with voice {options.voice!r}: "
                       f"{done.stderr.decode(errors='replace').strip()}")
    pcm, rate = sf.read(io.BytesIO(done.stdout), dtype="int16", always_2d=False)
    return pcm, rate
