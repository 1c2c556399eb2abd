"""Part 2's tokenization points: the S3 tokenizer v2 tokenizing book segments in batches on the device,
as the GPU worker's tokenize lane does (`app.s3.S3Quantizer.batch`), beside the engine sweep's decoder.

    sweep(ctx, engine)        results: per batch size the segments/s and seconds of speech tokenized per
                              second, and the tokenizer's device time per second of speech against the
                              decoder's (the sweep's fastest point): `tokenize_per_decode` and
                              `share_of_step` (the tokenizer's part of the time a second of audio costs)
    share(tokenize_audio_s_per_s, decode_frames_per_s)   that arithmetic alone

Random weights at the preset's size: "full" is the real tokenizer's shape (1280 wide, 6 layers, 123.7 M
parameters; the arithmetic, not the values, sets the time), "tiny" the CPU rehearsal's. Segments are 3-10 s
of speech (a book's sentence groups), mixed lengths in every batch, so padding costs what it costs in the
lane. fp32 as the lane runs it; the tokenizer's own written-out attention (what the worker loads) and,
where the budget lasts, PyTorch's fused attention (`use_sdpa`) beside it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from app.s3 import S3_MELS, S3Quantizer
from app.speech import TOKEN_RATE
from bench.kit.part import PartRun

FRAMES_PER_S = 100  # log-mel frames per second of 16 kHz speech
BATCHES = {"full": (1, 8, 32, 64), "tiny": (1, 4)}
SEGMENT_S = {"full": (3.0, 10.0), "tiny": (1.0, 2.0)}
ROUNDS = 3


def tokenizer_config(preset: str, sdpa: bool) -> Any:
    from s3tokenizer.model_v2 import ModelConfig

    if preset == "full":
        return ModelConfig(use_sdpa=sdpa)
    # the rotary embedding is built for 64-wide heads: the small shape keeps that width
    return ModelConfig(n_audio_state=128, n_audio_head=2, n_audio_layer=1, use_sdpa=sdpa)


def build(preset: str, device: str, sdpa: bool) -> S3Quantizer:
    from s3tokenizer.model_v2 import S3TokenizerV2

    torch.manual_seed(0)
    with torch.device(device):
        module = S3TokenizerV2("speech_tokenizer_v2_25hz", tokenizer_config(preset, sdpa))
    return S3Quantizer(module.requires_grad_(False))


def segments(preset: str, count: int, seed: int) -> list[torch.Tensor]:
    """`count` log-mels of 3-10 s (full) in the S3 range: [128, T_i] each."""
    low, high = SEGMENT_S[preset]
    g = torch.Generator().manual_seed(seed)
    seconds = low + (high - low) * torch.rand(count, generator=g)
    return [torch.rand(S3_MELS, int(s * FRAMES_PER_S), generator=g) * 3 - 1.5 for s in seconds.tolist()]


def time_batch(quantizer: S3Quantizer, logmels: list[torch.Tensor], cuda: bool) -> float:
    """Median seconds of one batched forward, the host-to-device copy included (the lane does it too)."""
    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    quantizer.batch(logmels)  # first sight: kernels chosen, memory pooled
    sync()
    took = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        quantizer.batch(logmels)
        sync()
        took.append(time.perf_counter() - start)
    return statistics.median(took)


def share(tokenize_audio_s_per_s: float, decode_frames_per_s: float) -> dict[str, float]:
    """The tokenizer's device seconds per second of speech against the decoder's."""
    tokenize_s = 1.0 / tokenize_audio_s_per_s
    decode_s = TOKEN_RATE / decode_frames_per_s
    return {"tokenize_per_decode": tokenize_s / decode_s,
            "share_of_step": tokenize_s / (tokenize_s + decode_s)}


def fastest(engine: dict[str, Any] | None) -> tuple[str, float] | None:
    """The sweep's fastest point (name, codec frames/s), if it measured any."""
    fps = {name: p["fps"] for name, p in (engine or {}).items() if isinstance(p, dict) and p.get("fps")}
    return max(fps.items(), key=lambda kv: kv[1]) if fps else None


def batch_point(quantizer: S3Quantizer, preset: str, batch: int, cuda: bool) -> dict[str, Any]:
    logmels = segments(preset, batch, seed=batch)
    seconds = time_batch(quantizer, logmels, cuda)
    audio_s = sum(m.size(1) for m in logmels) / FRAMES_PER_S
    return {"segments": batch, "audio_s": round(audio_s, 2), "batch_s": seconds,
            "segments_per_s": batch / seconds, "audio_s_per_s": audio_s / seconds}


def attention_points(ctx: PartRun, sdpa: bool, best: tuple[str, float] | None) -> dict[str, Any]:
    quantizer = build(ctx.preset, ctx.device, sdpa)
    parameters = sum(p.numel() for p in quantizer.module.parameters())
    out: dict[str, Any] = {"parameters_m": round(parameters / 1e6, 1)}
    last = 0.0
    for batch in BATCHES[ctx.preset]:
        if ctx.left() < 3 * last + 2.0:
            ctx.skipped(f"tokenize{'_sdpa' if sdpa else ''} B{batch}")
            continue
        started = time.monotonic()
        point = batch_point(quantizer, ctx.preset, batch, ctx.cuda)
        if best is not None:
            point.update(share(point["audio_s_per_s"], best[1]), against=best[0])
        out[f"B{batch}"] = point
        last = time.monotonic() - started
    del quantizer
    if ctx.cuda:
        torch.cuda.empty_cache()
    return out


def sweep(ctx: PartRun, engine: dict[str, Any] | None) -> dict[str, Any]:
    best = fastest(engine)
    with torch.inference_mode():
        result: dict[str, Any] = {"written_out": attention_points(ctx, False, best)}
        if ctx.left() > 10.0:
            result["sdpa"] = attention_points(ctx, True, best)
        else:
            ctx.skipped("tokenize with use_sdpa")
    result["decoder"] = {"point": best[0], "fps": best[1]} if best else None
    return result
