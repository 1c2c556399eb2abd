"""Before and after of each CPU speed-up, in one run, on the same inputs.

`python -m bench.engine.speedups [--decoder full]`:

    snake          HiFT's Snake at the full model's vocoder shapes: the formula (five passes, four
                   temporary tensors; what runs with autograd on) against the inference path (one buffer)
    hift           one HiFT forward over a steady-state chunk (58 mel frames): weight norm as
                   parametrizations + the Snake formula (before) against weight norm folded at load + the
                   inference Snake (after); the outputs must be the same bits
    hift bf16      the same forward in float32 against `prepare_hift(bf16)`, with the audio's SNR
    linear         a DiT linear ([2 x rows x 50, 512] x [512, 2048]): the BLAS (`F.linear`) against
                   oneDNN (`gpu_worker.accel.onednn`)
    fc1 + gelu     the DiT MLP's first half, float32 and bf16: F.linear + F.gelu against one oneDNN
                   linear with the GELU as a post-op (`onednn.OneDnnLinearGelu`)
    decoder        (with --decoder PRESET) the whole thing where it counts, every variant and the fp32
                   reference in turn, `--rounds` times (`rotation.py`: the variants and their pairs)
    setup batch    (with --decoder PRESET --setup-batch N) N new voices' device halves one by one against
                   one batched setup solve (`install_voices`, the engine's WAVEFARM_INSTALL_BATCH), and
                   how far the batched voices' caches are from the ones installed alone
    causal_conv    a DiT causal conv (k = 3, 512 channels) through mkldnn against the same conv as one
                   matmul over the three shifted frames: the idea the profile suggested, measured (on an
                   AVX-512 CPU the mkldnn kernel wins; the model keeps the conv)

Each figure is the median of `reps` timed calls after warm-up, in milliseconds, with the max difference
between the two outputs. The machine, thread count and git revision are printed with them.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.engine.machine import git_info, machine_info
from bench.engine.rotation import rotation
from bench.engine.workload import BenchSetup
from gpu_worker.accel import onednn
from gpu_worker.checkpoint.load import fuse_weight_norm, prepare_hift
from gpu_worker.model.config import ModelArgs
from gpu_worker.model.hift import HiFTGenerator, Snake
from gpu_worker.voices.prompt import install_voice, install_voices


def _median_ms(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _pair(name: str, before: Callable[[], torch.Tensor], after: Callable[[], torch.Tensor], reps: int,
          **extra: Any) -> dict[str, Any]:
    with torch.inference_mode():
        diff = float((before() - after()).abs().max())
        b, a = _median_ms(before, reps), _median_ms(after, reps)
    return {"name": name, "before_ms": b, "after_ms": a, "speedup": b / a, "max_abs_diff": diff, **extra}


def snake(rows: int, reps: int) -> list[dict[str, Any]]:
    """Snake at the three upsampled widths of the full HiFT for a 58-frame chunk."""
    out = []
    gen = torch.Generator().manual_seed(0)
    for channels, samples in ((256, 58 * 8), (128, 58 * 40), (64, 58 * 120)):
        act = Snake(channels).requires_grad_(False)
        with torch.no_grad():
            act.alpha.uniform_(0.2, 3.0, generator=gen)
        x = torch.randn(rows, channels, samples, generator=gen)

        def formula(act: Snake = act, x: torch.Tensor = x) -> torch.Tensor:
            with torch.enable_grad():  # nothing requires grad: no graph, just the formula's passes
                return act(x)

        def one_buffer(act: Snake = act, x: torch.Tensor = x) -> torch.Tensor:
            return act(x)

        out.append(_pair(f"snake [{rows}, {channels}, {samples}]", formula, one_buffer, reps))
    return out


VOCODER_FRAMES = 58  # mel frames the vocoder sees for a steady-state chunk (module docstring)


def hift(rows: int, reps: int, frames: int = VOCODER_FRAMES) -> dict[str, Any]:
    args = ModelArgs.full().hift
    models = []
    for _ in range(2):  # the same seeded weights twice
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            models.append(HiFTGenerator(args).eval().requires_grad_(False))
    before_model, after_model = models[0], fuse_weight_norm(models[1])
    mel = torch.randn(rows, 80, frames, generator=torch.Generator().manual_seed(1)) - 4.0
    noise = before_model.draw_noise([torch.Generator().manual_seed(10 + i) for i in range(rows)], frames)

    def before() -> torch.Tensor:
        with torch.enable_grad():
            return before_model(mel, noise=noise)[0]

    return _pair(f"hift forward, {rows} rows x {frames} frames", before,
                 lambda: after_model(mel, noise=noise)[0], reps)


def causal_conv(rows: int, reps: int) -> dict[str, Any]:
    dim, frames = 512, 52  # a 50-frame chunk + the 2 cached frames, CFG doubles the rows
    conv = torch.nn.Conv1d(dim, dim, 3)
    bias = conv.bias
    assert bias is not None
    x = torch.randn(2 * rows, dim, frames, generator=torch.Generator().manual_seed(2))
    weight = conv.weight.permute(2, 1, 0).reshape(3 * dim, dim).contiguous()  # [k C_in, C_out]

    def as_matmul() -> torch.Tensor:
        xt = x.transpose(1, 2)
        shifted = torch.cat([xt[:, k:frames - 2 + k] for k in range(3)], dim=2)
        out = torch.addmm(bias, shifted.reshape(-1, 3 * dim), weight)
        return out.view(x.size(0), frames - 2, dim).transpose(1, 2)

    return _pair(f"DiT causal conv [{2 * rows}, {dim}, {frames}] k3",
                 lambda: F.conv1d(x, conv.weight, conv.bias), as_matmul, reps,
                 note="before = mkldnn conv (kept), after = matmul formulation (rejected)")


def hift_bf16(rows: int, reps: int, frames: int = VOCODER_FRAMES) -> dict[str, Any]:
    """The full vocoder, weight norm folded, in float32 against `prepare_hift(bf16)` (its F0 predictor,
    source and conv_post kept float32); the difference is reported as the audio's SNR too."""
    args = ModelArgs.full().hift
    models = []
    for dtype in (torch.float32, torch.bfloat16):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = HiFTGenerator(args).eval().requires_grad_(False)
        with torch.no_grad():
            model.f0_predictor.classifier.bias.fill_(100.0)  # voiced, as the dummy's (loading.py)
        models.append(prepare_hift(model, dtype))
    mel = torch.randn(rows, 80, frames, generator=torch.Generator().manual_seed(1)) - 4.0
    noise = models[0].draw_noise([torch.Generator().manual_seed(10 + i) for i in range(rows)], frames)
    with torch.inference_mode():
        ref, low = models[0](mel, noise=noise)[0], models[1](mel.bfloat16(), noise=noise)[0]
    snr = 10 * math.log10(float((ref**2).sum()) / float(((low - ref) ** 2).sum()))
    return _pair(f"hift {rows} rows: fp32 -> bf16 body", lambda: models[0](mel, noise=noise)[0],
                 lambda: models[1](mel.bfloat16(), noise=noise)[0], reps, audio_snr_db=snr)


def gelu_fused(rows: int, reps: int) -> list[dict[str, Any]]:
    """The DiT MLP's fc1 + tanh-GELU: F.linear then F.gelu against one oneDNN linear with the GELU fused."""
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        layer = onednn.OneDnnLinearGelu(512, 2048).requires_grad_(False).to(dtype)
        x = torch.randn(2 * rows, 50, 512, generator=torch.Generator().manual_seed(4)).to(dtype)
        name = f"fc1 + gelu [{2 * rows}, 50, 512] {str(dtype).removeprefix('torch.')}: apart -> fused"
        if not onednn.fused_gelu_available(dtype):
            name += " (no fused kernel on this CPU: both apart)"

        def apart(x: torch.Tensor = x, layer: torch.nn.Linear = layer) -> torch.Tensor:
            return F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh")

        def fused(x: torch.Tensor = x, layer: torch.nn.Linear = layer) -> torch.Tensor:
            return layer(x)

        out.append(_pair(name, apart, fused, reps))
    return out


def linear_layer(rows: int, reps: int) -> dict[str, Any]:
    dim, hidden = 512, 2048
    layer = torch.nn.Linear(dim, hidden).requires_grad_(False)
    x = torch.randn(2 * rows * 50, dim, generator=torch.Generator().manual_seed(3))
    return _pair(f"DiT linear [{2 * rows * 50}, {dim}] x [{dim}, {hidden}]",
                 lambda: F.linear(x, layer.weight, layer.bias),
                 lambda: onednn.onednn_linear(x, layer.weight, layer.bias), reps)


def setup_batch(preset: str, voices: int, rounds: int) -> dict[str, Any]:
    """The device half of `voices` new voices: one install each (`install_voice`) against one batched
    setup solve (`install_voices`), alternating, `rounds` times; seconds, medians."""
    bench = BenchSetup.build(preset=preset, device="cpu", dtype="fp32", speaker="standin",
                             micro_batch_size=voices)
    try:
        hosts = [bench.host(i) for i in range(voices)]
        speaker, decoder = bench.speaker, bench.decoder
        singles, batched, diff = [], [], 0.0
        for _ in range(rounds):
            start = time.perf_counter()
            alone = [install_voice(h, speaker=speaker, decoder=decoder) for h in hosts]
            singles.append(time.perf_counter() - start)
            start = time.perf_counter()
            together = install_voices(hosts, speaker=speaker, decoder=decoder)
            batched.append(time.perf_counter() - start)
            diff = max(diff, *(float((a - b).abs().max()) for x, y in zip(alone, together, strict=True)
                               for a, b in zip(x.tensors(), y.tensors(), strict=True)))
    finally:
        bench.close()
    before, after = statistics.median(singles), statistics.median(batched)
    return {"name": f"install {voices} voices: one by one -> one batched setup solve (s)", "before": before,
            "after": after, "speedup": before / after, "max_abs_diff": diff,
            "samples": {"one_by_one": singles, "batched": batched}}


def run(rows: int, reps: int, decoder_preset: str | None = None, rounds: int = 2, bf16: bool = False,
        vocoder_frames: int = VOCODER_FRAMES, setup_voices: int = 0) -> dict[str, Any]:
    results = [*snake(rows, reps), hift(rows, reps, vocoder_frames), hift_bf16(rows, reps, vocoder_frames),
               linear_layer(rows, reps),
               *gelu_fused(rows, reps), causal_conv(rows, reps)]
    if decoder_preset:
        results += rotation(decoder_preset, rows, rounds, bf16)
        if setup_voices > 1:
            results.append(setup_batch(decoder_preset, setup_voices, rounds))
    return {"machine": machine_info(torch.device("cpu")), "git": git_info(), "rows": rows, "reps": reps,
            "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.speedups",
                                description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8, help="streams in the step (default 8)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decoder", choices=["full", "tiny"], default=None,
                   help="also the whole decoder (install + steps) with each linear path")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the decoder part")
    p.add_argument("--bf16", action="store_true",
                   help="the decoder part also runs the flow in bf16, and the flow and vocoder in bf16")
    p.add_argument("--vocoder-frames", type=int, default=VOCODER_FRAMES,
                   help=f"mel frames of the vocoder micro-benchmarks (default {VOCODER_FRAMES}, a chunk's)")
    p.add_argument("--setup-batch", type=int, default=0, metavar="N",
                   help="with --decoder: also N new voices installed one by one and in one setup solve")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args.rows, args.reps, args.decoder, args.rounds, args.bf16, args.vocoder_frames,
                 args.setup_batch)
    m = report["machine"]
    print(f"{m['cpu_model']} ({m['cpu_cores']} cores), {m['torch_threads']} threads, "
          f"torch {m['torch_version']}, git {str(report['git'].get('revision'))[:12]}")
    print(f"{'':44} {'before ms':>10} {'after ms':>10} {'speed-up':>9} {'max |diff|':>11}")
    for r in report["results"]:
        if "before_ms" in r:
            snr = f"  audio SNR {r['audio_snr_db']:.1f} dB" if "audio_snr_db" in r else ""
            print(f"{r['name']:44} {r['before_ms']:10.2f} {r['after_ms']:10.2f} {r['speedup']:8.2f}x "
                  f"{r['max_abs_diff']:11.3g}{snr}")
        else:  # decoder rows: seconds or frames/s, medians of two alternating rounds
            diff = f"  max |diff| {r['max_abs_diff']:.3g}" if "max_abs_diff" in r else ""
            print(f"{r['name']:66} {r['before']:8.2f} -> {r['after']:8.2f}  {r['speedup']:.2f}x{diff}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
