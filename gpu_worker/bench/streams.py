"""What one more stream costs a decoder step: time and memory, with the voices' shared frames copied
beside every row (before) and read where they are (after), in one run.

`python -m gpu_worker.bench.streams [--preset full] [--rows 1,2,4,8] [--rounds 3] [--dtype fp32]`

For each row count R: R streams over two voices, warmed until their caches hold what they hold from then
on (the prompt's last 100 frames and 300 generated ones: `STEADY_CHUNKS` chunks), then `rounds` rounds
in which one steady-state step runs with the frames copied and one with them in place, in turn (both see
the same machine state). Per mode and R:
    step_s          median step time
    buffer_bytes    the solve's attention buffer after the step (`Workspace`: one Euler step's
                    [depth, 2R, H, T + W, 2 D]; W is what each row packs: shared + own frames copied,
                    own frames only in place)
    copied_bytes    what one step copies into that buffer: its packed frames, at every Euler step
    stream_bytes    the streams' own caches (their generated frames, the same in both modes)
and the slopes over R (least squares): seconds, buffer bytes and copied bytes per added stream.
On CUDA the peak of allocated memory during the step is reported too.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from app.speech import MEL_PER_TOKEN, PROMPT_SECONDS, TOKEN_RATE
from gpu_worker.bench.decode import CHUNK_FRAMES, steady_rows, warm_streams
from gpu_worker.bench.machine import Timer, git_info, machine_info
from gpu_worker.bench.report import publish
from gpu_worker.bench.workload import BenchSetup
from gpu_worker.model.kvcache import Workspace

PROMPT_FRAMES = round(PROMPT_SECONDS * TOKEN_RATE * MEL_PER_TOKEN)  # 300: a 6 s reference
MODES = ("copied", "in_place")
# chunks until a stream's estimator cache is [its last 300 generated frames | the prompt's last 100]:
# after every trim it keeps the newest 300 frames of its logical order and the oldest 100 (the prompt's)
STEADY_CHUNKS = -(-(PROMPT_FRAMES + CHUNK_FRAMES) // CHUNK_FRAMES)


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _frame_bytes(setup: BenchSetup) -> int:
    """One frame of one Euler step's attention buffer, over every block, cond and uncond."""
    d = setup.args.flow.dit
    return d.depth * 2 * d.num_heads * 2 * d.head_dim * torch.finfo(setup.dtype).bits // 8


def _copied_bytes(setup: BenchSetup, streams: list[Any], mode: str) -> int:
    packed = 0
    for s in streams:
        shared, own = s.cache.estimator().split()
        packed += len(own) + (len(shared) if mode == "copied" else 0)
    return packed * _frame_bytes(setup) * setup.args.flow.n_timesteps


def _step(setup: BenchSetup, streams: list[Any], mode: str, k: int) -> dict[str, float]:
    decoder = setup.decoder
    decoder.copy_shared_frames = mode == "copied"
    decoder.workspace = Workspace()  # sized by this step alone
    copied = _copied_bytes(setup, streams, mode)
    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    try:
        with Timer(setup.device) as timer:
            decoder.step(steady_rows(streams, step=1000 + k))
    finally:
        decoder.copy_shared_frames = False
    buffer = decoder.workspace.nbytes if decoder.workspace is not None else 0
    out = {"step_s": timer.s, "buffer_bytes": float(buffer), "copied_bytes": float(copied),
           "stream_bytes": float(sum(s.cache.stream_nbytes() for s in streams))}
    if cuda:
        out["peak_step_bytes"] = float(torch.cuda.max_memory_allocated() - before)
    return out


def measure(setup: BenchSetup, rows: list[int], rounds: int) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with torch.inference_mode():
        for r in rows:
            streams = warm_streams(setup, r, chunks=STEADY_CHUNKS)
            samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for k in range(rounds):
                for mode in MODES if k % 2 == 0 else MODES[::-1]:
                    samples[mode].append(_step(setup, streams, mode, 2 * k + (mode == "in_place")))
            for mode in MODES:
                row = {key: statistics.median(s[key] for s in samples[mode]) for key in samples[mode][0]}
                results[mode].append({"rows": r, **row, "step_s_all": [s["step_s"] for s in samples[mode]]})
            del streams
    slopes = {mode: {f"{key}_per_stream": _slope([x["rows"] for x in res], [x[key] for x in res])
                     for key in ("step_s", "buffer_bytes", "copied_bytes", "stream_bytes")}
              for mode, res in results.items()}
    return {"rows": rows, "rounds": rounds, "results": results, "per_added_stream": slopes}


def table(report: dict[str, Any]) -> str:
    lines = ["| rows | mode | step (s) | attention buffer (MiB) | copied per step (MiB) | streams' own "
             "(MiB) |", "|---|---|---|---|---|---|"]
    mib = 2**20
    for mode in MODES:
        for x in report["results"][mode]:
            lines.append(f"| {x['rows']} | {mode} | {x['step_s']:.3f} | {x['buffer_bytes'] / mib:.1f} | "
                         f"{x['copied_bytes'] / mib:.1f} | {x['stream_bytes'] / mib:.1f} |")
    lines.append("\nper added stream:")
    for mode in MODES:
        s = report["per_added_stream"][mode]
        lines.append(f"- {mode}: {s['step_s_per_stream']:.3f} s, buffer "
                     f"{s['buffer_bytes_per_stream'] / mib:.1f} MiB, copied "
                     f"{s['copied_bytes_per_stream'] / mib:.1f} MiB per step, own cache "
                     f"{s['stream_bytes_per_stream'] / mib:.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_worker.bench.streams", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["full", "tiny"], default="full")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    setup = BenchSetup.build(preset=args.preset, device=args.device, dtype=args.dtype, speaker="standin",
                             micro_batch_size=max(rows))
    try:
        report = {"machine": machine_info(torch.device(args.device)), "git": git_info(),
                  "preset": args.preset, "dtype": args.dtype, **measure(setup, rows, args.rounds)}
    finally:
        setup.close()
    publish(report, table(report), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
