"""The device half of prompt preparation: host features -> an installed `VoicePrompt`.

    install_voice(host, speaker=..., decoder=...)      (install_voices([hosts], ...): B voices, one solve)
        1. S3-quantize the 128-bin log-mel into prompt tokens and run CAM++ on the fbank (`speaker`);
        2. pad (replicate) or crop the 24 kHz prompt mel to 2 x prompt tokens frames;
        3. the setup solve: encode prompt tokens + 3 silence tokens and run the CFM with cond = prompt mel
           and the voice's own seeded noise, keeping the caches it builds.

The result is read-only and shared by every stream of the voice (streams build new cache tensors from
it, never write into it). Its setup noise is drawn from a seed derived from the voice id, so a voice
installs to the same bits on every worker and whether its features were prepared ahead or inline.

`StandInSpeaker` replaces S3 + CAM++ when the worker runs dummy weights (no model folder): cheap,
deterministic, and as meaningless as the dummy's audio.

A voice whose host features or built prompt hold a NaN or an infinity is refused (`check_finite`,
EngineFailure), so the engine fails its jobs instead of decoding garbage.

Not in here: the host half (`app.voices.features`), the cache of installed voices (`voices.py`), side streams.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from app.errors import EngineFailure
from app.voices.features import PromptHostFeatures
from gpu_worker.model.config import LOOKAHEAD_TOKENS, MEL_PER_TOKEN, SILENCE_TOKEN, VOCAB_SIZE
from gpu_worker.model.flow import FlowCache

NOISE_SHAPE = (1, 80, 30000)  # the reference's fixed Gaussian buffer: 600 s of mel frames


class Speaker(Protocol):
    """S3 tokenizer + CAM++ (`gpu_worker.voices.speaker`)."""

    def quantize_and_embed(self, logmel128: Tensor, fbank80: Tensor) -> tuple[Tensor, Tensor]:
        """logmel128 [128, T16], fbank80 [Tf, 80] -> prompt tokens [1, Tp] int64, embedding [1, 192]."""
        ...


class StandInSpeaker:
    """Speaker for dummy-weight runs (no model folder): tokens and embedding are cheap deterministic
    functions of the features, so installs stay reproducible. The audio is noise either way."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def quantize_and_embed(self, logmel128: Tensor, fbank80: Tensor) -> tuple[Tensor, Tensor]:
        n = logmel128.size(1) // 4  # 25 tokens per second from 100 log-mel frames per second
        frames = logmel128[:, : 4 * n].reshape(logmel128.size(0), n, 4).mean(dim=(0, 2))  # [n]
        tokens = (frames.abs() * 7919).long() % VOCAB_SIZE
        embedding = torch.cat([fbank80.mean(dim=0), fbank80.std(dim=0), fbank80.amax(dim=0)[:32]])
        return tokens[None].to(self.device), embedding[None].float().to(self.device)


@dataclass(frozen=True)
class VoicePrompt:
    """A voice installed on a device. Read-only; shared by every stream of the voice."""

    voice_id: str
    spk: Tensor  # [1, 80] projected speaker embedding (F.normalize + affine)
    prompt_len: int  # prompt mel frames, 2 x prompt tokens (300 for 6 s)
    conformer_cnn_cache: Tensor  # [1, C_enc, 6]
    conformer_att_cache: Tensor  # [blocks + up_blocks, 1, H, 2 Tp, 2 d_k]
    estimator_cnn_cache: Tensor  # [steps, depth, 2 (cond | uncond), 2 hidden, 2]
    estimator_att_cache: Tensor  # [steps, depth, 2, H, prompt_len, 2 head_dim]

    @property
    def flow_steps(self) -> int:
        """The Euler steps its setup caches were built for: a decoder with another count cannot use them."""
        return int(self.estimator_att_cache.size(0))

    def flow_cache(self) -> FlowCache:
        return FlowCache(conformer_cnn=self.conformer_cnn_cache, conformer_att=self.conformer_att_cache,
                         estimator_cnn=self.estimator_cnn_cache, estimator_att=self.estimator_att_cache)

    def tensors(self) -> Iterator[Tensor]:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                yield value

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def voice_seed(voice_id: str) -> int:
    """The setup noise seed of a voice: the first 60 bits of its sha256 id."""
    return int(voice_id[:15], 16)


def fit_prompt_mel(mel: Tensor, n_frames: int) -> Tensor:
    """mel [1, Tm, 80] -> [1, n_frames, 80]: replicate the last frame, or crop (the reference's pad)."""
    if n_frames <= mel.size(1):
        return mel[:, :n_frames]
    padded = F.pad(mel.transpose(1, 2), (0, n_frames - mel.size(1)), mode="replicate")
    return padded.transpose(1, 2)


def seeded_noise(seed: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, torch.Generator]:
    """The CFM's (1, 80, 30000) Gaussian buffer drawn from Generator(seed), and that generator after it."""
    generator = torch.Generator(device=device).manual_seed(seed)
    noise = torch.randn(NOISE_SHAPE, generator=generator, device=device, dtype=torch.float32)
    return noise.to(dtype), generator


def _to_device(t: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()  # an asynchronous copy on the installing (side) stream
    return t.to(device=device, dtype=dtype or t.dtype, non_blocking=True)


def check_finite(voice_id: str, what: str, tensors: dict[str, Tensor]) -> None:
    """Refuse a voice (EngineFailure naming the tensors) whose `tensors` hold a NaN or an infinity.

    Only tensors on the host are read, through `numpy()`: no device sync and no scalar read. Host features
    always are. A prompt is on the host on a CPU worker; on a GPU, reading it back would make the engine
    thread wait for the side stream's setup solve (an install needs no host sync), so there a broken
    prompt shows in its jobs' audio instead, which `gpu_worker.worker.job` never records as a success."""
    bad = [name for name, t in tensors.items()
           if t.device.type == "cpu" and not bool(torch.isfinite(t).all().numpy())]
    if bad:
        raise EngineFailure(f"voice {voice_id}: {what} {', '.join(bad)} hold NaN or infinite values; "
                            "its jobs cannot be decoded")


def _named_tensors(prompt: VoicePrompt) -> dict[str, Tensor]:
    named = {f.name: getattr(prompt, f.name) for f in fields(prompt)}
    return {name: value for name, value in named.items() if isinstance(value, Tensor)}


@torch.inference_mode()
def install_voice(host: PromptHostFeatures, *, speaker: Speaker, decoder: Any,
                  seed: int | None = None) -> VoicePrompt:
    """Device half: host features -> VoicePrompt on `decoder.device` in `decoder.dtype`."""
    return install_voices([host], speaker=speaker, decoder=decoder, seeds=[seed])[0]


@torch.inference_mode()
def install_voices(hosts: list[PromptHostFeatures], *, speaker: Speaker, decoder: Any,
                   seeds: list[int | None] | None = None) -> list[VoicePrompt]:
    """The device half of several voices, their setup solves as one batched solve (`Flow.setup_batch`).
    A voice installed in a batch matches its install alone up to float rounding, not bit for bit."""
    device, dtype, flow = decoder.device, decoder.dtype, decoder.model.flow
    silence = torch.full((1, LOOKAHEAD_TOKENS), SILENCE_TOKEN, dtype=torch.int64, device=device)
    tokens, mels, embeddings, noises = [], [], [], []
    for host, seed in zip(hosts, seeds or [None] * len(hosts), strict=True):
        check_finite(host.voice_id, "host features", {"logmel128": host.logmel128, "fbank80": host.fbank80,
                                                      "mel80": host.mel80})
        prompt_tokens, embedding = speaker.quantize_and_embed(host.logmel128, host.fbank80)  # 1.
        prompt_tokens = _to_device(prompt_tokens, device, torch.int64)
        mels.append(fit_prompt_mel(_to_device(host.mel80, device, dtype)[None],  # 2.
                                   MEL_PER_TOKEN * prompt_tokens.size(1)))
        tokens.append(torch.cat([prompt_tokens, silence], dim=1))
        embeddings.append(_to_device(embedding, device, dtype))
        noises.append(seeded_noise(voice_seed(host.voice_id) if seed is None else seed, device, dtype)[0])
    spk, caches = flow.setup_batch(tokens, mels, torch.cat(embeddings), noises)  # 3.
    prompts = []
    for i, (host, mel, cache) in enumerate(zip(hosts, mels, caches, strict=True)):
        assert cache.conformer_cnn is not None and cache.conformer_att is not None
        assert cache.estimator_cnn is not None and cache.estimator_att is not None
        prompts.append(VoicePrompt(
            voice_id=host.voice_id, spk=spk[i : i + 1].clone() if len(hosts) > 1 else spk,
            prompt_len=mel.size(1), conformer_cnn_cache=cache.conformer_cnn,
            conformer_att_cache=cache.conformer_att, estimator_cnn_cache=cache.estimator_cnn,
            estimator_att_cache=cache.estimator_att))
        check_finite(host.voice_id, "installed prompt tensors", _named_tensors(prompts[-1]))
    return prompts
