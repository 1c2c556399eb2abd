"""HiFTGenerator: the neural-source-filter + iSTFT vocoder (80-bin mel at 50 Hz -> 24 kHz audio).

Parameter names equal the released `hift.pt` after its `generator.` prefix is stripped, with weight norm
held as parametrizations (`*.parametrizations.weight.original0/1`). The only randomness is in the
harmonic source (one initial phase per harmonic and one Gaussian draw per sample and harmonic); it is
never taken from the global RNG: pass a `SourceNoise` (drawn with `draw_source_noise` from one
`torch.Generator` per row), so each row of a batch is reproducible and independent of its neighbours.

Precision: the convolution body runs in the dtype of `conv_pre`; the F0 predictor, the harmonic source
and `conv_post` run in their own dtypes (inputs cast to them), and the STFT/iSTFT in float32. So a
reduced-precision vocoder can keep those parts float32 (`gpu_worker.checkpoint.load.prepare_hift`): pitch and
the iSTFT's log-magnitude and phase are where bf16 rounding shows most.

Not in here: streaming state (mel/source/speech tails, cross-fade), device choice, checkpoint files.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.parametrizations import weight_norm

from gpu_worker.model.config import HiftArgs


class SourceNoise(NamedTuple):
    """The random draws of the harmonic source for a batch of rows."""

    phase: Tensor  # [B, H]: uniform [0, 1), initial phase in cycles; column 0 (the fundamental) is ignored
    noise: Tensor  # [B, H, N]: standard normal, one value per harmonic and output sample


def draw_source_noise(generators: Sequence[torch.Generator], n_samples: int, n_harmonics: int) -> SourceNoise:
    """Draws each row's source noise from that row's own generator (phase first, then noise).

    A row's draws depend only on its generator and length, never on the other rows. The reference
    draws the same shapes from the global RNG (in another memory order), so parity tests hand it these
    values instead of seeding it. Tensors are on the generators' device; move them if that differs.
    """
    phases, noises = [], []
    for gen in generators:
        phases.append(torch.rand(1, n_harmonics, generator=gen, device=gen.device))
        noises.append(torch.randn(1, n_harmonics, n_samples, generator=gen, device=gen.device))
    return SourceNoise(torch.cat(phases), torch.cat(noises))


def overlap_add(frames: Tensor, hop: int) -> Tensor:
    """frames [B, n, F] -> [B, n + hop (F - 1)]: frame f added in at sample f * hop (the sum ATen's istft
    makes, with the same op, so the same bits)."""
    b, n, f = frames.shape
    return torch.ops.aten.unfold_backward(frames.transpose(1, 2), [b, n + hop * (f - 1)], 1, n, hop)


def inverse_stft(spec: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """`torch.istft(spec, n_fft, hop, n_fft, window=window)` (centred, one-sided) without its check that
    the window's overlap-add is nowhere zero: that check reads a value back to the host, which a CUDA
    graph cannot capture. The window here is fixed (a periodic Hann at a quarter hop, never zero where
    it counts), so the check can only pass; everything else is istft's own arithmetic in its order.
    spec [B, n_fft / 2 + 1, F] complex -> audio [B, (F - 1) * hop]."""
    frames = torch.fft.irfft(spec, n_fft, dim=1) * window[:, None]  # [B, n_fft, F]
    envelope = overlap_add(window.square()[None, :, None].expand(1, n_fft, spec.size(2)), hop)
    edge = n_fft // 2  # centred frames: their first and last half frame are padding
    return overlap_add(frames, hop)[:, edge:-edge] / envelope[:, edge:-edge]


def _padding(kernel_size: int, dilation: int = 1) -> int:
    return (kernel_size * dilation - dilation) // 2


def _wn_conv(c_in: int, c_out: int, kernel_size: int, dilation: int = 1) -> nn.Module:
    conv = nn.Conv1d(c_in, c_out, kernel_size, dilation=dilation, padding=_padding(kernel_size, dilation))
    return weight_norm(conv)


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one learnt alpha per channel."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, T]
        alpha = self.alpha[None, :, None]
        if torch.is_grad_enabled():
            return x + torch.sin(x * alpha).pow(2) / (alpha + 1e-9)
        # Inference: the same operations in the same order (so the same bits), in one buffer instead of
        # four; these are the largest tensors of a decode step (docs/PERFORMANCE.md).
        h = x * alpha
        return h.sin_().pow_(2).div_(alpha + 1e-9).add_(x)


class ResBlock(nn.Module):
    """Dilated residual stack: per dilation, snake -> conv(d) -> snake -> conv(1), added back."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList([_wn_conv(channels, channels, kernel_size, d) for d in dilations])
        self.convs2 = nn.ModuleList([_wn_conv(channels, channels, kernel_size) for _ in dilations])
        self.activations1 = nn.ModuleList([Snake(channels) for _ in dilations])
        self.activations2 = nn.ModuleList([Snake(channels) for _ in dilations])

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, T]
        for conv1, conv2, act1, act2 in zip(self.convs1, self.convs2, self.activations1, self.activations2,
                                            strict=True):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class F0Predictor(nn.Module):
    """Mel -> F0 in Hz: five weight-normed k3 convs with ELU, a linear head, abs."""

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [_wn_conv(in_channels if i == 0 else channels, channels, 3), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        # mel: [B, 80, T] -> f0: [B, T]
        h = self.condnet(mel).transpose(1, 2)
        return self.classifier(h).squeeze(-1).abs()


class HarmonicSource(nn.Module):
    """F0 at the audio rate -> one excitation signal: sines of H harmonics plus noise, merged by a linear."""

    def __init__(self, args: HiftArgs, upsample_scale: int):
        super().__init__()
        self.n_harmonics = args.nb_harmonics + 1
        self.sampling_rate = args.sampling_rate
        self.sine_amp = args.nsf_alpha
        self.noise_std = args.nsf_sigma
        self.voiced_threshold = args.nsf_voiced_threshold
        self.upsample_scale = upsample_scale
        self.l_linear = nn.Linear(self.n_harmonics, 1)

    def sines(self, f0: Tensor, phase: Tensor) -> Tensor:
        # f0: [B, 1, N] Hz, phase: [B, H] -> [B, H, N]
        harmonics = torch.arange(1, self.n_harmonics + 1, device=f0.device, dtype=f0.dtype)
        cycles = (f0 * harmonics[:, None] / self.sampling_rate) % 1  # [B, H, N] cycles per sample
        phase = torch.cat([torch.zeros_like(phase[:, :1]), phase[:, 1:]], dim=1)
        cycles = torch.cat([cycles[:, :, :1] + phase[:, :, None], cycles[:, :, 1:]], dim=2)
        # Integrate at the frame rate and interpolate back, as the released model was trained.
        frames = F.interpolate(cycles, scale_factor=1 / self.upsample_scale, mode="linear")
        angle = torch.cumsum(frames, dim=2) * 2 * math.pi  # [B, H, T]
        angle = F.interpolate(angle * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear")
        return torch.sin(angle)

    def forward(self, f0: Tensor, noise: SourceNoise) -> Tensor:
        # f0: [B, 1, N] Hz -> source: [B, 1, N]
        f0 = f0.float()
        sine = self.sines(f0, noise.phase.float()) * self.sine_amp
        voiced = (f0 > self.voiced_threshold).float()
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        excitation = (sine * voiced + noise_amp * noise.noise.float()).transpose(1, 2)  # [B, N, H]
        merged = F.linear(excitation, self.l_linear.weight.float(), self.l_linear.bias.float())
        return torch.tanh(merged).transpose(1, 2)


class HiFTGenerator(nn.Module):
    """Mel [B, 80, T] -> audio [B, T * 480]; batch-first, rows independent."""

    def __init__(self, args: HiftArgs):
        super().__init__()
        self.args = args
        self.n_fft = args.istft_n_fft
        self.hop = args.istft_hop_len
        self.upsample_scale = math.prod(args.upsample_rates) * args.istft_hop_len  # 480 samples per frame
        self.num_kernels = len(args.resblock_kernel_sizes)
        base = args.base_channels
        spec_channels = self.n_fft + 2  # 9 magnitudes + 9 phases

        self.m_source = HarmonicSource(args, self.upsample_scale)
        self.conv_pre = weight_norm(nn.Conv1d(args.in_channels, base, 7, padding=3))
        self.ups = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(args.upsample_rates, args.upsample_kernel_sizes, strict=True)):
            up = nn.ConvTranspose1d(base >> i, base >> (i + 1), kernel, rate, padding=(kernel - rate) // 2)
            self.ups.append(weight_norm(up))

        # The source enters each upsampling stage after being strided down to that stage's rate.
        down_rates = [1, *reversed(args.upsample_rates[1:])]
        cum_rates = [math.prod(down_rates[: i + 1]) for i in range(len(down_rates))][::-1]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (rate, kernel, dilations) in enumerate(zip(cum_rates, args.source_resblock_kernel_sizes,
                                                          args.source_resblock_dilation_sizes, strict=True)):
            ch = base >> (i + 1)
            if rate == 1:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(spec_channels, ch, rate * 2, rate, padding=rate // 2))
            self.source_resblocks.append(ResBlock(ch, kernel, dilations))

        self.resblocks = nn.ModuleList()
        for i in range(len(self.ups)):
            for kernel, dilations in zip(args.resblock_kernel_sizes, args.resblock_dilation_sizes,
                                         strict=True):
                self.resblocks.append(ResBlock(base >> (i + 1), kernel, dilations))
        self.conv_post = weight_norm(nn.Conv1d(base >> len(self.ups), spec_channels, 7, padding=3))
        self.f0_predictor = F0Predictor(args.in_channels, args.f0_cond_channels)

    def draw_noise(self, generators: Sequence[torch.Generator], n_frames: int) -> SourceNoise:
        return draw_source_noise(generators, n_frames * self.upsample_scale, self.m_source.n_harmonics)

    def source(self, mel: Tensor, noise: SourceNoise) -> Tensor:
        # mel: [B, 80, T] -> source: [B, 1, T * 480] float32
        f0 = self.f0_predictor(mel.to(self.f0_predictor.classifier.weight.dtype))  # [B, T]
        f0 = f0.repeat_interleave(self.upsample_scale, dim=1)[:, None]  # [B, 1, N]
        return self.m_source(f0, noise)

    def _window(self, device: torch.device) -> Tensor:
        return torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64, device=device).float()

    def _stft(self, source: Tensor) -> Tensor:
        # source: [B, N] float32 -> [B, n_fft + 2, N / hop + 1]
        spec = torch.stft(source, self.n_fft, self.hop, self.n_fft, window=self._window(source.device),
                          return_complex=True)
        return torch.cat([spec.real, spec.imag], dim=1)

    def _istft(self, x: Tensor) -> Tensor:
        # x: [B, n_fft + 2, F] -> audio [B, (F - 1) * hop]
        half = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :half]).clamp(max=1e2)
        phase = torch.sin(x[:, half:])
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return inverse_stft(spec, self.n_fft, self.hop, self._window(x.device))

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        # mel: [B, 80, T], source: [B, 1, T * 480] -> audio [B, T * 480]
        dtype = self.conv_pre.weight.dtype
        s = self._stft(source.squeeze(1).float()).to(dtype)
        x = self.conv_pre(mel.to(dtype))
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.args.lrelu_slope))
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            blocks = self.resblocks[i * self.num_kernels:(i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        x = self.conv_post(F.leaky_relu(x).to(self.conv_post.weight.dtype))  # default slope 0.01, as trained
        audio = self._istft(x.float())
        return audio.clamp(-self.args.audio_limit, self.args.audio_limit)

    def forward(self, mel: Tensor, cache_source: Tensor | None = None, *,
                noise: SourceNoise | None = None,
                generators: Sequence[torch.Generator] | None = None) -> tuple[Tensor, Tensor]:
        """mel [B, 80, T] -> (audio [B, T * 480], source [B, 1, T * 480]).

        `cache_source` [B, 1, Nc] replaces the first Nc source samples (the previous chunk's tail),
        which keeps the excitation continuous across streaming chunks. Randomness comes from `noise`,
        or is drawn from `generators` (one per row) when `noise` is not given.
        """
        if noise is None:
            if generators is None or len(generators) != mel.shape[0]:
                raise ValueError("HiFTGenerator needs `noise` or one torch.Generator per row")
            noise = self.draw_noise(generators, mel.shape[2])
            noise = SourceNoise(noise.phase.to(mel.device), noise.noise.to(mel.device))
        source = self.source(mel, noise)
        if cache_source is not None and cache_source.shape[2] > 0:
            n = cache_source.shape[2]
            source = torch.cat([cache_source.to(source.dtype), source[:, :, n:]], dim=2)
        return self.decode(mel, source), source
