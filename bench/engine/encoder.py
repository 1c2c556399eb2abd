"""The encoder's chunk two ways, in one run: per-stream caches (`Flow.encode_chunks` + `trim_cache`, the
decoder's way before the encoder lanes) against the lanes (`Flow.encode_lanes` + `EncoderLanes.commit`).

`python -m bench.engine.encoder [--preset full] [--rows 1,8] [--rounds 5] [--json OUT]`

Streams over two voices (their real setup caches), warmed past the reference's trims (six continuing
chunks: the first stage frozen at (P + tail) / 2 frames, the second stage at [:P] + the last tail), then
`rounds` rounds of one continuing chunk per stream each way, the ways taking turns (which goes first
alternates), medians. Also per stream: the bytes its encoder caches hold each way (the reference layout
tiles the first stage twice along time; the lanes hold it once), and the largest |difference| between
the two ways' mu over every chunk. The voices' setup solves are not timed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.engine.machine import git_info, machine_info
from bench.engine.report import publish
from bench.engine.workload import BenchSetup, chunk_tokens
from gpu_worker.model.config import ATT_CACHE_TAIL, CHUNK_TOKENS, LOOKAHEAD_TOKENS
from gpu_worker.model.encoder_lanes import EncoderShape
from gpu_worker.model.flow import CHUNK_FRAMES, FlowCache, trim_cache
from gpu_worker.model.lanes import Lanes, LaneShape

WARM_CHUNKS = 6
WINDOW = CHUNK_TOKENS + LOOKAHEAD_TOKENS


class TwoWays:
    """`rows` streams encoded both ways from the same voices and tokens."""

    def __init__(self, setup: BenchSetup, rows: int) -> None:
        self.flow, a = setup.decoder.model.flow, setup.args.flow
        prompts = [setup.install(v) for v in (0, 1)]
        p = prompts[0].prompt_len
        shape = LaneShape(a.n_timesteps, a.dit.depth, a.dit.num_heads, a.dit.head_dim, a.dit.hidden_size, p,
                          ATT_CACHE_TAIL, CHUNK_FRAMES)
        self.lanes = Lanes(shape, device=setup.device, dtype=setup.dtype, lanes=rows,
                           encoder=EncoderShape.of(a.encoder, p, ATT_CACHE_TAIL))
        self.caches, self.lane_list, self.prompt_len = [], [], p
        for i in range(rows):
            voice = prompts[i % 2]
            lane = self.lanes.acquire(0)
            lane.encoded = self.lanes.encoder.start(lane.index, voice.conformer_cnn_cache,  # type: ignore[union-attr]
                                                    voice.conformer_att_cache)
            self.lane_list.append(lane)
            self.caches.append(FlowCache(conformer_cnn=voice.conformer_cnn_cache,
                                         conformer_att=voice.conformer_att_cache))
        self.device, self.worst = setup.device, 0.0

    def tokens(self, chunk: int) -> list[torch.Tensor]:
        return [chunk_tokens(WINDOW, seed=1000 * chunk + i) for i in range(len(self.caches))]

    def per_stream(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        mu, caches = self.flow.encode_chunks([t.to(self.device)[None] for t in tokens], self.caches,
                                             [False] * len(tokens))
        self.caches = [trim_cache(c, self.prompt_len, ATT_CACHE_TAIL) for c in caches]
        return torch.cat(mu)

    def lanes_way(self, tokens: list[torch.Tensor]) -> torch.Tensor:
        frames = 2 * CHUNK_TOKENS
        plan = self.lanes.encoder_plan({lane.index: (t, False) for lane, t in zip(self.lane_list, tokens,
                                                                                  strict=True)},
                                       frames, len(tokens))
        mu, encoded = self.flow.encode_lanes(plan.to(self.device), self.lanes.encoder)
        self.lanes.encoder.commit(*encoded)  # type: ignore[union-attr]
        for lane in self.lane_list:
            lane.encoded = self.lanes.encoder.held_after(lane.encoded, CHUNK_TOKENS)  # type: ignore[union-attr]
        return mu

    def both(self, chunk: int) -> None:
        tokens = self.tokens(chunk)
        a, b = self.per_stream(tokens), self.lanes_way(tokens)
        self.worst = max(self.worst, float((a - b).abs().max()))

    def stream_bytes(self) -> dict[str, float]:
        per = self.caches[0]
        return {"per_stream": float(per.stream_nbytes()),
                "lanes": float(self.lanes.encoder.lane_nbytes())}  # type: ignore[union-attr]


def _timed(device: torch.device, run: Any) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(setup: BenchSetup, rows: list[int], rounds: int) -> list[dict[str, Any]]:
    out = []
    with torch.inference_mode():
        for r in rows:
            ways = TwoWays(setup, r)
            for chunk in range(WARM_CHUNKS):
                ways.both(chunk)
            times: dict[str, list[float]] = {"per_stream": [], "lanes": []}
            for k in range(rounds):
                tokens = ways.tokens(WARM_CHUNKS + k)
                order = [("per_stream", ways.per_stream), ("lanes", ways.lanes_way)]
                for name, run in order if k % 2 == 0 else order[::-1]:
                    times[name].append(_timed(setup.device, lambda run=run, t=tokens: run(t)))
            medians = {name: statistics.median(t) for name, t in times.items()}
            out.append({"rows": r, "seconds": medians, "samples": times,
                        "lanes_over_per_stream": medians["lanes"] / medians["per_stream"],
                        "stream_bytes": ways.stream_bytes(), "max_abs_diff_mu": ways.worst})
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| rows | per-stream (ms) | lanes (ms) | lanes / per-stream | encoder bytes per stream, "
             "per-stream / lanes (MiB) | max abs diff of mu |", "|---|---|---|---|---|---|"]
    for r in results:
        b = r["stream_bytes"]
        ms = {name: 1e3 * s for name, s in r["seconds"].items()}
        lines.append(f"| {r['rows']} | {ms['per_stream']:.1f} | {ms['lanes']:.1f} | "
                     f"{r['lanes_over_per_stream']:.2f} | {b['per_stream'] / 2**20:.2f} / "
                     f"{b['lanes'] / 2**20:.2f} | {r['max_abs_diff_mu']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.encoder", description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=["full", "tiny"], default="full")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", dest="json_path", default=None, metavar="OUT")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    setup = BenchSetup.build(preset=args.preset, device=args.device, dtype="fp32", speaker="standin",
                             micro_batch_size=max(rows))
    try:
        results = measure(setup, rows, args.rounds)
    finally:
        setup.close()
    report = {"machine": machine_info(torch.device(args.device)), "git": git_info(), "preset": args.preset,
              "rounds": args.rounds, "results": results}
    publish(report, table(results), args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
