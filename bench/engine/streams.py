"""What one more stream costs the flow's solve: time and memory, with the streams' estimator caches in
lanes (the decoder's way now) and in caches of their own packed at every Euler step (before), in one run.

`python -m bench.engine.streams [--preset full] [--rows 1,2,4,8] [--rounds 3] [--dtype fp32]`

For each row count R: R streams over two voices, each way (`bench.flows`: LaneFlow, PerStreamFlow),
warmed until their caches hold what they hold from then on (the voice's last 100 frames and 300
generated ones: `STEADY_CHUNKS` chunks), then `rounds` rounds in which one steady-state step runs each
way, in turn (both see the same machine state). The flow only: the encoder and the solve, no vocoder
(the same in both). Per way and R:
    step_s          median step time
    stream_bytes    the streams' own caches: a lane (frame slots, conv caches, noise) and the conformer
                    caches, or their own estimator slots and conformer caches
    buffer_bytes    the largest transient the solve adds for its rows' frames: one block's gathered
                    voice frames [2R, H, W, 2 D] (lanes), one Euler step's attention buffer (before)
    copied_bytes    what one step copies for its rows: the voice frames it gathers (lanes; W = 100 in
                    the steady state), the own frames it packs at every Euler step (before)
and the slopes over R (least squares) per added stream. The voices' frames are the voices' (one slot
each in the lanes, `voice_bytes`), not a stream's. On CUDA the peak of allocated memory during the step
is reported too.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from app.speech import PROMPT_FRAMES
from bench.engine.decode import CHUNK_FRAMES
from bench.engine.flows import LaneFlow, PerStreamFlow
from bench.engine.machine import Timer, git_info, machine_info
from bench.engine.report import publish
from bench.engine.workload import BenchSetup, chunk_tokens
from gpu_worker.model.config import ATT_CACHE_TAIL, CHUNK_TOKENS, LOOKAHEAD_TOKENS
from gpu_worker.model.flow import CHUNK_FRAMES as MAX_NEW
from gpu_worker.voices.prompt import seeded_noise

MODES = ("per_stream", "lanes")
# chunks until every stream is past its prompt's length: it reads its last 300 generated frames and the
# voice's last 100, as every later chunk does
STEADY_CHUNKS = -(-PROMPT_FRAMES // CHUNK_FRAMES)


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


def _flows(setup: BenchSetup, rows: int) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    voices = []
    for v in (0, 1):
        prompt = setup.install(v)
        voices.append((prompt.spk, prompt.flow_cache()))
    flow = setup.decoder.model.flow
    flows: dict[str, Any] = {"per_stream": PerStreamFlow(flow, voices, tail=ATT_CACHE_TAIL),
                             "lanes": LaneFlow(flow, voices, tail=ATT_CACHE_TAIL, max_new=MAX_NEW)}
    streams = {mode: [f.open(i % 2, seeded_noise(i, setup.device, setup.dtype)[0]) for i in range(rows)]
               for mode, f in flows.items()}
    return flows, streams


def _rows(streams: list[Any], step: int, device: torch.device) -> list[tuple[Any, torch.Tensor, bool]]:
    window = CHUNK_TOKENS + LOOKAHEAD_TOKENS
    return [(s, chunk_tokens(window, seed=10_000 * step + i).to(device)[None], False)
            for i, s in enumerate(streams)]


def _figures(mode: str, flow: Any, streams: list[Any]) -> dict[str, float]:
    if mode == "lanes":
        lanes = flow.lanes  # a lane holds its encoder caches too
        copied, block = flow.gathered_bytes(len(streams), flow.shape.window([s.lane.frames for s in streams]))
        return {"stream_bytes": float(lanes.lane_nbytes() * len(streams)),
                "buffer_bytes": float(block), "copied_bytes": float(copied),
                "voice_bytes": float(lanes.voice_nbytes())}
    return {"stream_bytes": float(sum(s.cache.stream_nbytes() for s in streams)),
            "buffer_bytes": float(flow.workspace.nbytes), "copied_bytes": float(flow.packed_bytes(streams)),
            "voice_bytes": float(streams[0].cache.estimator().shared.numel()
                                 * streams[0].cache.estimator().shared.element_size())}


def _step(setup: BenchSetup, flow: Any, streams: list[Any], mode: str, k: int) -> dict[str, float]:
    if mode == "per_stream":
        flow.workspace = type(flow.workspace)()  # sized by this step alone
    figures = _figures(mode, flow, streams)  # before the step: what it starts from
    cuda = setup.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with Timer(setup.device) as timer:
        flow.solve(_rows(streams, 1000 + k, setup.device))
    out = {"step_s": timer.s, **figures}
    if mode == "per_stream":
        out["buffer_bytes"] = float(flow.workspace.nbytes)
    if cuda:
        out["peak_step_bytes"] = float(torch.cuda.max_memory_allocated() - before)
    return out


def measure(setup: BenchSetup, rows: list[int], rounds: int) -> dict[str, Any]:
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with torch.inference_mode():
        for r in rows:
            flows, streams = _flows(setup, r)
            for step in range(STEADY_CHUNKS):
                for mode in MODES:
                    flows[mode].solve(_rows(streams[mode], step, setup.device))
            samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for k in range(rounds):
                for mode in MODES if k % 2 == 0 else MODES[::-1]:
                    k_step = 2 * k + (mode == "lanes")
                    samples[mode].append(_step(setup, flows[mode], streams[mode], mode, k_step))
            for mode in MODES:
                row = {key: statistics.median(s[key] for s in samples[mode]) for key in samples[mode][0]}
                results[mode].append({"rows": r, **row, "step_s_all": [s["step_s"] for s in samples[mode]]})
            del flows, streams
    slopes = {mode: {f"{key}_per_stream": _slope([x["rows"] for x in res], [x[key] for x in res])
                     for key in ("step_s", "buffer_bytes", "copied_bytes", "stream_bytes")}
              for mode, res in results.items()}
    return {"rows": rows, "rounds": rounds, "steady_chunks": STEADY_CHUNKS, "results": results,
            "per_added_stream": slopes}


def table(report: dict[str, Any]) -> str:
    lines = ["| rows | way | step (s) | largest transient (MiB) | copied per step (MiB) | streams' own "
             "(MiB) |", "|---|---|---|---|---|---|"]
    mib = 2**20
    for mode in MODES:
        for x in report["results"][mode]:
            lines.append(f"| {x['rows']} | {mode} | {x['step_s']:.3f} | {x['buffer_bytes'] / mib:.1f} | "
                         f"{x['copied_bytes'] / mib:.1f} | {x['stream_bytes'] / mib:.1f} |")
    lines.append("\nper added stream:")
    for mode in MODES:
        s = report["per_added_stream"][mode]
        lines.append(f"- {mode}: {s['step_s_per_stream']:.3f} s, transient "
                     f"{s['buffer_bytes_per_stream'] / mib:.1f} MiB, copied "
                     f"{s['copied_bytes_per_stream'] / mib:.1f} MiB per step, own cache "
                     f"{s['stream_bytes_per_stream'] / mib:.1f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.streams", description=__doc__.split("\n")[0])
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
