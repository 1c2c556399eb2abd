"""The benchmark's fixed inputs: one model folder, the model and decoder built from it, voices, tokens.

    BenchSetup.build(preset=..., device=..., dtype=..., speaker=..., hift_dtype=...)   writes seeded
        random weights in the released layout (`checkpoint_io.write_official_layout`) to a temporary
        folder and loads them the way the worker does (`load_model_folder`, `prepare_hift`, the DiT's
        linears on `cpu_linear`), so the reference can read the same files
    setup.voice(i) -> Voice          6 s synthetic reference i, normalised by `app.audio` (id = sha256)
    setup.host(i) -> PromptHostFeatures   its host half, computed once and kept
    setup.install(i) -> VoicePrompt  its device half on the bench's decoder, computed once and kept
    chunk_tokens(n, seed) -> [n] int64

Everything is seeded: two runs decode the same tokens with the same weights and voices. The weights are
random, so the audio is noise; only the cost is real.

Not in here: timing (each measurement module does its own).
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from app.audio import normalise_reference
from app.speech import CAMPPLUS_ONNX, PROMPT_SAMPLES, SAMPLE_RATE, VOCAB_SIZE
from app.voices.features import PromptHostFeatures, host_half
from bench.engine.campplus import CampPlusSpeaker, write_campplus_onnx
from gpu_worker.accel.onednn import use_cpu_linear
from gpu_worker.checkpoint.load import DTYPES, load_model_folder, prepare_hift
from gpu_worker.checkpoint.write import write_official_layout
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.model import Code2Wav
from gpu_worker.model.config import ModelArgs
from gpu_worker.voices.prompt import Speaker, StandInSpeaker, VoicePrompt, install_voice
from gpu_worker.voices.speaker import CampPlus, SpeakerFrontend

WEIGHT_SEED = 0


@dataclass(frozen=True)
class Voice:
    index: int
    pcm: np.ndarray  # [144000] float32, normalised 24 kHz mono
    voice_id: str


def synthetic_voice(index: int) -> Voice:
    """A 6 s harmonic tone with vibrato and breath noise, different per index, through the project's own
    normalisation (so its id is what an upload of the same samples would get)."""
    rng = np.random.default_rng(1000 + index)
    t = np.arange(PROMPT_SAMPLES) / SAMPLE_RATE
    f0 = 100.0 + 23.0 * (index % 7) + 8.0 * np.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * np.cumsum(f0) / SAMPLE_RATE
    wave = sum(np.sin(h * phase) / h for h in range(1, 9)) * 0.1
    wave = wave * (0.6 + 0.4 * np.sin(2 * math.pi * 2.3 * t) ** 2) + 0.005 * rng.standard_normal(t.size)
    pcm, voice_id = normalise_reference(wave.astype(np.float32), SAMPLE_RATE)
    return Voice(index, pcm, voice_id)


def chunk_tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(seed))


@dataclass
class BenchSetup:
    preset: str
    args: ModelArgs
    device: torch.device
    dtype: torch.dtype
    folder: Path
    model: Code2Wav
    decoder: StreamingDecoder
    speaker: Speaker
    speaker_kind: str  # "s3": S3 tokenizer v2 (full size) + CAM++ stand-in ONNX; "standin": StandInSpeaker;
    # "campplus": StandInSpeaker's tokens + CAM++'s real network (random weights) on onnxruntime's CPU
    _tmp: Any = None
    _voices: dict[int, Voice] = field(default_factory=dict)
    _hosts: dict[int, PromptHostFeatures] = field(default_factory=dict)
    _prompts: dict[int, VoicePrompt] = field(default_factory=dict)

    @classmethod
    def build(cls, *, preset: str, device: str, dtype: str, speaker: str, micro_batch_size: int,
              hift_dtype: str = "fp32", cpu_linear: str = "onednn") -> BenchSetup:
        args = ModelArgs.preset(preset)
        tmp = tempfile.TemporaryDirectory(prefix="wavefarm-bench-")
        folder = Path(tmp.name)
        write_official_layout(folder, args, WEIGHT_SEED, tokenizer=speaker == "s3")
        if speaker == "campplus":  # the real network in place of the layout's two-layer stand-in
            write_campplus_onnx(folder / CAMPPLUS_ONNX, WEIGHT_SEED)
        dev = torch.device(device)
        model = load_model_folder(folder, device=dev, dtype=DTYPES[dtype], args=args)
        prepare_hift(model.hift, DTYPES[hift_dtype])  # as the worker's runtime does
        use_cpu_linear(model, cpu_linear)
        decoder = StreamingDecoder(model, device=dev, dtype=DTYPES[dtype], micro_batch_size=micro_batch_size)
        front: Speaker = StandInSpeaker(dev)
        if speaker == "s3":
            front = SpeakerFrontend.from_folder(folder, device=dev)
        elif speaker == "campplus":  # on onnxruntime's CPU, as a worker without TensorRT runs it
            front = CampPlusSpeaker(CampPlus(folder / CAMPPLUS_ONNX, device=dev), dev)
        return cls(preset, args, dev, DTYPES[dtype], folder, model, decoder, front, speaker, tmp)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def voice(self, index: int) -> Voice:
        if index not in self._voices:
            self._voices[index] = synthetic_voice(index)
        return self._voices[index]

    def host(self, index: int) -> PromptHostFeatures:
        if index not in self._hosts:
            voice = self.voice(index)
            self._hosts[index] = host_half(voice.pcm, voice.voice_id)
        return self._hosts[index]

    def install(self, index: int) -> VoicePrompt:
        if index not in self._prompts:
            self._prompts[index] = install_voice(self.host(index), speaker=self.speaker, decoder=self.decoder)
        return self._prompts[index]

    def adopt(self, index: int, prompt: VoicePrompt) -> None:
        """Keep a prompt installed elsewhere (a timed install) as voice `index`'s."""
        self._prompts[index] = prompt

    def installer(self, host: PromptHostFeatures) -> VoicePrompt:
        """The worker's installer (`install_voice` with this setup's speaker and decoder)."""
        return install_voice(host, speaker=self.speaker, decoder=self.decoder)
