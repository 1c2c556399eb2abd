"""CAM++ with seeded random weights in its released architecture, exported to ONNX, and a speaker that runs
it: what an install's CAM++ really costs on onnxruntime's CPU (the device kit's churn part measures it).

`gpu_worker.checkpoint.write`'s campplus.onnx is a two-layer stand-in with CAM++'s signature, fine for
loading and for tests, but its cost is nothing like the real network's; `StandInSpeaker` has no network
at all. This is 3D-Speaker's CAM++ as the released campplus.onnx holds it (80-bin fbank in, a
192-dim embedding out):
    head      a 2-D front end over (frequency, time): conv 3x3 to 32 channels, two stages of two residual
              blocks (the first of each halving frequency), a conv halving frequency again: 32 x 10 rows
    tdnn      conv k5 stride 2 (time halved) to 128 channels
    3 blocks  densely connected layers (12, 24, 16; kernel 3; dilation 1, 2, 2), each adding 32 channels:
              batch norm, ReLU, 1x1 conv to 128, batch norm, ReLU, then a context-aware mask: a local conv
              to 32 channels times sigmoid(1x1 convs of the utterance mean plus its 100-frame segment
              means); after each block a transit 1x1 conv halving the channels (512 -> 256, 1024 -> 512,
              1024 -> 512)
    pooling   batch norm, ReLU, mean and standard deviation over time, a 1x1 conv to 192 with a batch
              norm without affine parameters
About 7 M weights, as MODEL.md says of the released file.

    write_campplus_onnx(path, seed)          the ONNX file (TorchScript exporter, dynamic time axis)
    python -m bench.engine.campplus      its export time and a 6 s prompt's CAM++ call on onnxruntime
    CampPlusSpeaker(campplus, device)        `gpu_worker.voices.prompt.Speaker`: StandInSpeaker's tokens (the
    S3
        tokenizer runs on the device, not what is measured) and this CAM++'s embedding, each call timed
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.voices.prompt import StandInSpeaker

FBANK_BINS, EMBEDDING, SEGMENT = 80, 192, 100
HEAD_CHANNELS, TDNN_CHANNELS, GROWTH, BOTTLENECK = 32, 128, 32, 128
BLOCKS = ((12, 1), (24, 2), (16, 2))  # (layers, dilation) of each dense block


def _bn_relu(channels: int) -> nn.Module:
    return nn.Sequential(nn.BatchNorm1d(channels), nn.ReLU())


class _Res2d(nn.Module):
    """Two 3x3 convs with batch norm and a shortcut; `stride` halves the frequency rows."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, (stride, 1), 1, bias=False), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False), nn.BatchNorm2d(channels))
        self.short = nn.Identity() if stride == 1 else nn.Sequential(
            nn.Conv2d(channels, channels, 1, (stride, 1), bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.body(x) + self.short(x))


class _DenseLayer(nn.Module):
    """One densely connected layer with its context-aware mask -> GROWTH new channels."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.bottleneck = nn.Sequential(_bn_relu(channels), nn.Conv1d(channels, BOTTLENECK, 1, bias=False),
                                        _bn_relu(BOTTLENECK))
        self.local = nn.Conv1d(BOTTLENECK, GROWTH, 3, padding=dilation, dilation=dilation, bias=False)
        self.context = nn.Sequential(nn.Conv1d(BOTTLENECK, BOTTLENECK // 2, 1), nn.ReLU(),
                                     nn.Conv1d(BOTTLENECK // 2, GROWTH, 1), nn.Sigmoid())

    def forward(self, x: Tensor) -> Tensor:
        # x: [B, C, T] -> [B, GROWTH, T]
        h = self.bottleneck(x)
        frames = h.size(-1)
        segments = F.avg_pool1d(h, SEGMENT, SEGMENT, ceil_mode=True)  # [B, C, ceil(T / 100)]
        spread = segments.unsqueeze(-1).expand(*segments.shape, SEGMENT).flatten(-2)[..., :frames]
        return self.local(h) * self.context(h.mean(-1, keepdim=True) + spread)


class CampPlusNet(nn.Module):
    """fbank [1, T, 80] -> embedding [1, 192] (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        c = HEAD_CHANNELS
        self.head = nn.Sequential(
            nn.Conv2d(1, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
            _Res2d(c, 2), _Res2d(c, 1), _Res2d(c, 2), _Res2d(c, 1),
            nn.Conv2d(c, c, 3, (2, 1), 1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        layers: list[nn.Module] = [nn.Conv1d(c * FBANK_BINS // 8, TDNN_CHANNELS, 5, 2, 2, bias=False),
                                   _bn_relu(TDNN_CHANNELS)]
        channels = TDNN_CHANNELS
        self.blocks = nn.ModuleList()
        for n_layers, dilation in BLOCKS:
            block = nn.ModuleList(_DenseLayer(channels + i * GROWTH, dilation) for i in range(n_layers))
            channels += n_layers * GROWTH
            self.blocks.append(nn.ModuleList([block, nn.Sequential(
                _bn_relu(channels), nn.Conv1d(channels, channels // 2, 1, bias=False))]))
            channels //= 2
        self.tdnn = nn.Sequential(*layers)
        self.out = _bn_relu(channels)
        self.embed = nn.Conv1d(2 * channels, EMBEDDING, 1, bias=False)
        self.embed_norm = nn.BatchNorm1d(EMBEDDING, affine=False)

    def forward(self, fbank: Tensor) -> Tensor:
        x = self.head(fbank.transpose(1, 2).unsqueeze(1))  # [1, 32, 10, T]
        x = self.tdnn(x.flatten(1, 2))  # [1, 128, T / 2]
        for block in self.blocks:
            layers, transit = block[0], block[1]  # type: ignore[index]
            for layer in layers:
                x = torch.cat([x, layer(x)], dim=1)
            x = transit(x)
        x = self.out(x)
        stats = torch.cat([x.mean(-1), x.std(-1)], dim=1)[..., None]  # [1, 2 C, 1]
        return self.embed_norm(self.embed(stats))[..., 0]


def write_campplus_onnx(path: str | Path, seed: int) -> int:
    """The network with weights drawn from `seed` (batch norms' running statistics too), as ONNX at
    `path` -> its number of weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = CampPlusNet().eval()
        for module in net.modules():
            if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
                module.running_mean.normal_(0.0, 0.1)  # type: ignore[union-attr]
                module.running_var.uniform_(0.5, 1.5)  # type: ignore[union-attr]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        # no constant folding: a quarter of the export's time, and onnxruntime folds the batch norms into the
        # convolutions itself when it loads the file (ORT_ENABLE_ALL)
        torch.onnx.export(net, (torch.zeros(1, 200, FBANK_BINS),), str(path), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {1: "T"}},
                          do_constant_folding=False)
    return sum(p.numel() for p in net.parameters())


class CampPlusSpeaker:
    """Tokens from `StandInSpeaker`, the embedding from a CAM++ (`gpu_worker.voices.speaker.CampPlus`, or one
    on
    TensorRT); `seconds` holds each CAM++ call's wall time."""

    def __init__(self, campplus: Any, device: torch.device | str) -> None:
        self.campplus, self.tokens = campplus, StandInSpeaker(device)
        self.seconds: list[float] = []

    def quantize_and_embed(self, logmel128: Tensor, fbank80: Tensor) -> tuple[Tensor, Tensor]:
        tokens, _ = self.tokens.quantize_and_embed(logmel128, fbank80)
        start = time.perf_counter()
        embedding = self.campplus(fbank80)
        self.seconds.append(time.perf_counter() - start)
        return tokens, embedding.to(tokens.device)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import statistics
    import tempfile

    from gpu_worker.voices.speaker import CampPlus

    parser = argparse.ArgumentParser(prog="python -m bench.engine.campplus",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--frames", type=int, default=598, help="fbank frames (598: a 6 s prompt)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        weights = write_campplus_onnx(Path(tmp) / "campplus.onnx", 0)
        export_s = time.perf_counter() - start
        campplus = CampPlus(Path(tmp) / "campplus.onnx")  # one intra-op thread, as the worker's
        fbank = torch.randn(args.frames, FBANK_BINS, generator=torch.Generator().manual_seed(0))
        campplus(fbank)  # the first call pays onnxruntime's own warm-up
        calls = []
        for _ in range(args.calls):
            start = time.perf_counter()
            campplus(fbank)
            calls.append(time.perf_counter() - start)
    print(f"CAM++ ({weights} weights): export {export_s:.1f} s; a {args.frames}-frame call on onnxruntime's "
          f"CPU, 1 thread: median {statistics.median(calls):.3f} s "
          f"(min {min(calls):.3f}, max {max(calls):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
