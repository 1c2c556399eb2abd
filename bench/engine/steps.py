"""What fewer Euler steps (WAVEFARM_FLOW_STEPS) buy and cost: speed and mel deviation from 10 steps.

`python -m bench.engine.steps [--preset full] [--rows 8] [--rounds 3] [--chunks 3] [--json OUT]`

One model folder, loaded once per step count (so every count runs the very same weights), each with its
own decoder. Per step count:

    deviation   voice 0, one stream, seed 0, `chunks` steady-state chunks of the same tokens; the chunk
                mels (what the flow hands HiFT) against the 10-step run's: max and mean |diff|, the
                10-step mel's range, and the audio's SNR against the 10-step audio
    speed       `rows` warm streams (caches trimmed), one steady-state step per round; the step counts
                take turns within each round, so all of them see the same machine state; medians

The weights are random (no checkpoint can be downloaded here), so the deviation says how far a coarser
solve moves this model's output, not what it does to speech: a trained flow's velocity field is smoother
than a random one, and WER or speaker similarity need real weights and an ASR model.
"""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import replace
from typing import Any

import torch

from app.settings import FLOW_STEPS
from bench.engine.decode import decoder_sweep, warm_streams
from bench.engine.machine import git_info, machine_info
from bench.engine.precision import decode_chunks
from bench.engine.report import publish
from bench.engine.workload import BenchSetup
from gpu_worker.accel.onednn import use_cpu_linear
from gpu_worker.checkpoint.load import load_model_folder, prepare_hift
from gpu_worker.engine.decoder import StreamingDecoder

REFERENCE_STEPS = 10


def with_steps(base: BenchSetup, steps: int, rows: int) -> BenchSetup:
    """`base`'s weights, voices and host features with a decoder whose flow runs `steps` Euler steps."""
    args = replace(base.args, flow=replace(base.args.flow, n_timesteps=steps))
    model = load_model_folder(base.folder, device=base.device, dtype=base.dtype, args=args)
    prepare_hift(model.hift)
    use_cpu_linear(model, "onednn")
    decoder = StreamingDecoder(model, device=base.device, dtype=base.dtype, micro_batch_size=rows)
    return replace(base, args=args, model=model, decoder=decoder, _tmp=None, _prompts={})


def _compare(mel: torch.Tensor, audio: torch.Tensor, mel10: torch.Tensor, audio10: torch.Tensor
             ) -> dict[str, float]:
    diff = (mel - mel10).abs()
    noise, signal = float(((audio - audio10) ** 2).sum()), float((audio10**2).sum())
    return {"mel_max_abs": float(diff.max()), "mel_mean_abs": float(diff.mean()),
            "mel_range": float(mel10.max() - mel10.min()),
            "audio_snr_db": math.inf if noise == 0 else 10 * math.log10(signal / noise)}


def measure(preset: str, rows: int, rounds: int, chunks: int, device: str = "cpu") -> dict[str, Any]:
    base = BenchSetup.build(preset=preset, device=device, dtype="fp32", speaker="standin",
                            micro_batch_size=rows)
    try:
        setups = {steps: with_steps(base, steps, rows) for steps in sorted(set(FLOW_STEPS))}
        fps: dict[int, list[float]] = {steps: [] for steps in setups}
        with torch.inference_mode():
            runs = {steps: decode_chunks(s, s.decoder, chunks) for steps, s in setups.items()}
            mel10, audio10 = runs[REFERENCE_STEPS]
            streams = {steps: warm_streams(s, rows) for steps, s in setups.items()}
            for _ in range(rounds):
                for steps, s in setups.items():
                    [row] = decoder_sweep(s, streams[steps], [rows], 1, log=lambda _: None)
                    fps[steps].append(row["fps"])
    finally:
        base.close()
    results = []
    for steps in setups:
        mel, audio = runs[steps]
        results.append({"steps": steps, "fps": statistics.median(fps[steps]), "fps_samples": fps[steps],
                        "speedup": statistics.median(fps[steps]) / statistics.median(fps[REFERENCE_STEPS]),
                        **_compare(mel, audio, mel10, audio10)})
    return {"preset": preset, "rows": rows, "rounds": rounds, "chunks": chunks, "frames": mel10.size(2),
            "results": results}


def table(report: dict[str, Any]) -> str:
    lines = [f"| steps | mel frames/s ({report['rows']} rows) | speed-up vs 10 | mel max abs diff | "
             "mel mean abs diff | audio SNR vs 10 (dB) |", "|---|---|---|---|---|---|"]
    for r in report["results"]:
        lines.append(f"| {r['steps']} | {r['fps']:.0f} | {r['speedup']:.2f}x | {r['mel_max_abs']:.3g} | "
                     f"{r['mel_mean_abs']:.3g} | {r['audio_snr_db']:.1f} |")
    lines.append(f"\n10-step mel range: {report['results'][-1]['mel_range']:.3g} over {report['frames']} "
                 "frames")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.steps", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["full", "tiny"], default="full")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    report = {"machine": machine_info(device), "git": git_info(),
              **measure(args.preset, args.rows, args.rounds, args.chunks, args.device)}
    publish(report, table(report), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
