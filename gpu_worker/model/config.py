"""Model hyper-parameters: one dataclass per component and named presets.

`full()` is the released Step-Audio 2 token2wav configuration (MODEL.md); `tiny()` keeps every
data-facing size (vocabulary, mel bins, speaker dim, rates, streaming constants) and shrinks only the
widths and depths, so tests exercise the same code paths in milliseconds.

The data-facing facts (vocabulary, rates, the silence token) are the service's shared ones, read from
`app.speech` (plain constants, no imports): the model's only import outside torch and math.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.speech import (
    MEL_BINS,
    MEL_PER_TOKEN,
    SAMPLE_RATE,
    SAMPLES_PER_MEL,
    SILENCE_TOKEN,
    TOKEN_RATE,
    VOCAB_SIZE,
)

__all__ = ["MEL_PER_TOKEN", "SAMPLE_RATE", "SAMPLES_PER_MEL", "SILENCE_TOKEN", "TOKEN_RATE", "VOCAB_SIZE",
           "CHUNK_TOKENS", "LOOKAHEAD_TOKENS", "ATT_CACHE_TAIL", "HIFT_MEL_CACHE", "HIFT_SOURCE_CACHE",
           "EncoderArgs", "DiTArgs", "FlowArgs", "HiftArgs", "ModelArgs"]


@dataclass(frozen=True)
class EncoderArgs:
    input_size: int = 512  # token embedding width
    output_size: int = 512
    attention_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead_len: int = 3
    up_stride: int = 2
    up_scale_factor: float = 2.0
    pos_max_len: int = 5000
    layer_norm_eps: float = 1e-12


@dataclass(frozen=True)
class DiTArgs:
    in_channels: int = 320  # [x | mu | spk | cond], 80 each
    out_channels: int = 80
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0
    freq_embed_size: int = 256


@dataclass(frozen=True)
class FlowArgs:
    vocab_size: int = VOCAB_SIZE
    output_size: int = MEL_BINS
    spk_embed_dim: int = 192
    encoder: EncoderArgs = field(default_factory=EncoderArgs)
    dit: DiTArgs = field(default_factory=DiTArgs)
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    noise_frames: int = 30000  # fixed Gaussian buffer (1, 80, 30000): 600 s of mel


@dataclass(frozen=True)
class HiftArgs:
    in_channels: int = MEL_BINS
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = SAMPLE_RATE
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512


@dataclass(frozen=True)
class ModelArgs:
    flow: FlowArgs = field(default_factory=FlowArgs)
    hift: HiftArgs = field(default_factory=HiftArgs)

    @classmethod
    def full(cls) -> ModelArgs:
        return cls()

    @classmethod
    def tiny(cls) -> ModelArgs:
        encoder = EncoderArgs(input_size=64, output_size=64, attention_heads=2, linear_units=128,
                              num_blocks=2, num_up_blocks=2)
        dit = DiTArgs(hidden_size=64, depth=2, num_heads=2, head_dim=32)
        return cls(flow=FlowArgs(encoder=encoder, dit=dit),
                   hift=HiftArgs(base_channels=32, f0_cond_channels=32))

    @classmethod
    def preset(cls, name: str) -> ModelArgs:
        presets = {"full": cls.full, "tiny": cls.tiny}
        if name not in presets:
            raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(presets)}")
        return presets[name]()


# Streaming constants (MODEL.md "Streaming"); data-facing, identical in every preset.
CHUNK_TOKENS = 25
LOOKAHEAD_TOKENS = 3
ATT_CACHE_TAIL = 100  # frames kept after the prompt when trimming attention caches
HIFT_MEL_CACHE = 8
HIFT_SOURCE_CACHE = HIFT_MEL_CACHE * SAMPLES_PER_MEL  # 3840
