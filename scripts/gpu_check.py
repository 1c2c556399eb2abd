"""CUDA checks of the engine's side-stream voice installs (tiny preset, dummy weights, no services).

    python scripts/gpu_check.py --out report.json [--device cuda] [--strict | --no-strict]

For three voices (16 kHz; 22.05 kHz with noise; 48 kHz stereo) it runs the same jobs through the real
engine, as the worker runs it (installs from the install lane, on the side stream on CUDA), twice: voices
prepared ahead (features in a store, installed with an event the first step waits on) and voices
prepared inline (no features: the engine prepares them itself); on CUDA both once more with installs on
the main stream (one stream). Ahead must equal inline bit for bit on one stream, and within 1e-5 with the
side stream (`bench.kit.verdict`: cuBLAS is bitwise only with one stream active). It also reports the
largest difference to each job decoded alone, step and install timings, and allocated device memory
after each of several repeated rounds. The speaker models are the dummy-mode stand-ins.

The same jobs run once more with the decode step's flow (the encoder's chunk and the solve) and the
vocoder in CUDA graphs (`gpu_worker.accel`'s flow_graphs and graphs, what a worker runs with
WAVEFARM_CUDA_GRAPHS on CUDA): the graphs held and replayed, their capture time and memory, the graph
fallbacks counted (by part and reason), the calls that ran eagerly where a graph should have, and the
largest difference to the eager run (TF32 off: within 1e-5, or the check fails). On a CPU nothing is
captured (the flow still runs in its graph buckets' shapes).

Strict (the default on CUDA): the check also fails when no flow or no vocoder graph was captured, a
fallback counter moved (graphs, the fused attention kernel, a bf16 kernel), or a call missed its graph,
since then it would have compared the slow path with itself. The first line printed says passed or
FAILED and why; the report's `failures` lists the same.

With `--install-batch N` (default 4) it also times N new voices installed one by one against one batched
setup solve (`install_voices`, the engine's WAVEFARM_INSTALL_BATCH) at `--install-preset` (default full
on CUDA), synchronised, medians of `--rounds`: batching setups cannot gain on a CPU (measured 0.98x,
docs/PERFORMANCE.md run 5), this is where it can.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from functools import partial

import numpy as np
import torch

from app.audio import normalise_reference
from app.speech import PROMPT_FRAMES, SAMPLES_PER_TOKEN, VOCAB_SIZE
from app.voices.features import PromptHostFeatures, host_half
from bench.engine.workload import synthetic_voice
from bench.kit import verdict
from gpu_worker import fallbacks
from gpu_worker.accel.flow_graphs import graph_flow
from gpu_worker.accel.graphs import graph_hift
from gpu_worker.checkpoint.load import load_dummy
from gpu_worker.engine.core import Engine, EngineConfig
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.engine.streams import Audio, EngineJob, Failed, Finished
from gpu_worker.model.config import ModelArgs
from gpu_worker.voices.cache import VoiceCache, install_lane
from gpu_worker.voices.prompt import StandInSpeaker, install_voice, install_voices


def references() -> dict[str, tuple[np.ndarray, int]]:
    rng = np.random.default_rng(0)

    def tone(sr: int, f0: float, seconds: float = 3.0) -> np.ndarray:
        t = np.arange(int(seconds * sr)) / sr
        return (0.3 * np.sin(2 * np.pi * f0 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)

    noisy = tone(22050, 170.0) + 0.02 * rng.standard_normal(int(3.0 * 22050)).astype(np.float32)
    stereo = np.stack([tone(48000, 230.0), 0.5 * tone(48000, 231.0)], axis=1)
    return {"16k": (tone(16000, 120.0), 16000), "22k_noise": (noisy, 22050), "48k_stereo": (stereo, 48000)}


class Features:
    """The feature store (ahead) or the inline preparer, in memory."""

    def __init__(self, hosts: dict[str, PromptHostFeatures], ahead: bool) -> None:
        self.hosts, self.ahead, self.inline_calls = hosts, ahead, 0

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        return self.hosts[voice_id] if self.ahead else None

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        self.inline_calls += 1
        return self.hosts[job.voice_id]


def make_engine(decoder: StreamingDecoder, hosts: dict, ahead: bool,
                side_stream: bool = True) -> tuple[Engine, Features]:
    """The engine as the worker builds it (its install lane on CUDA); `side_stream=False`: installs on the
    main stream."""
    speaker = StandInSpeaker(decoder.device)
    voices = VoiceCache(partial(install_voice, speaker=speaker, decoder=decoder), device=decoder.device,
                        side_stream=side_stream)
    features = Features(hosts, ahead)
    return Engine(decoder, voices, features=features, preparer=features,
                  config=EngineConfig(micro_batch_size=8, prep_wait_ms=0),
                  install_lane=install_lane(decoder.device, asked=False)), features


def run_engine(decoder: StreamingDecoder, hosts: dict, jobs: list[EngineJob], ahead: bool,
               engine: Engine | None = None, side_stream: bool = True) -> dict:
    own = engine is None
    if engine is None:
        engine, features = make_engine(decoder, hosts, ahead, side_stream)
    else:
        features = engine.features
    audio: dict[str, list[torch.Tensor]] = {j.job_id: [] for j in jobs}
    for job in jobs:
        engine.add(job)
    steps, start, ended = 0, time.perf_counter(), set()
    while len(ended) < len(jobs) and time.perf_counter() - start < 600:
        engine.fetch_features()
        events = engine.step()
        for event in events:
            if isinstance(event, Audio):
                audio[event.job_id].append(event.samples.cpu())
            elif isinstance(event, (Finished, Failed)):
                ended.add(event.job_id)
        steps += 1
        if not events:  # an install in the lane: wait for it as the worker's loop does
            time.sleep(min(engine.idle_hint_s(), 0.01))
    if decoder.device.type == "cuda":
        torch.cuda.synchronize()
    if own and engine.resolver.install_lane is not None:
        engine.resolver.install_lane.shutdown(wait=True)  # type: ignore[attr-defined]
    return {"audio": {k: torch.cat(v) for k, v in audio.items()}, "steps": steps,
            "seconds": time.perf_counter() - start, "inline_calls": features.inline_calls,
            "counters": dict(engine.snapshot().get("prep_paths", {}))}


def install_batch_timing(device: torch.device, preset: str, voices: int, rounds: int) -> dict:
    """Seconds for `voices` new voices' device halves one by one and in one batched setup solve."""
    decoder = StreamingDecoder(load_dummy(ModelArgs.preset(preset), 0, device=device), device=device,
                               dtype=torch.float32, micro_batch_size=voices)
    speaker = StandInSpeaker(device)
    hosts = [host_half(v.pcm, v.voice_id) for v in (synthetic_voice(i) for i in range(voices))]

    def timed(fn) -> tuple[float, list]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, out

    singles, batched, diff = [], [], 0.0
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up (kernels, allocator), not counted
            s, alone = timed(lambda: [install_voice(h, speaker=speaker, decoder=decoder) for h in hosts])
            b, together = timed(lambda: install_voices(hosts, speaker=speaker, decoder=decoder))
            singles.append(s)
            batched.append(b)
            diff = max(diff, *(float((x - y).abs().max()) for a, c in zip(alone, together, strict=True)
                               for x, y in zip(a.tensors(), c.tensors(), strict=True)))
    one, many = float(np.median(singles[1:])), float(np.median(batched[1:]))
    return {"preset": preset, "voices": voices, "one_by_one_s": one, "batched_s": many,
            "speedup": one / many, "max_abs_diff": diff, "samples": {"one_by_one": singles[1:],
                                                                      "batched": batched[1:]}}


def graphs_check(decoder: StreamingDecoder, hosts: dict, jobs: list[EngineJob], eager: dict) -> dict:
    """The jobs again with the decode step's flow and the vocoder graphed (as a worker with
    WAVEFARM_CUDA_GRAPHS on CUDA): their figures and the largest difference to `eager` (exact shapes,
    no graphs)."""
    flow, hift = decoder.model.flow, decoder.model.hift
    before = verdict.graph_counts()
    lanes = decoder.reserve(PROMPT_FRAMES, decoder.micro_batch_size)
    decoder.model.flow = graph_flow(flow, lanes, lanes.capacity)
    decoder.model.hift = graph_hift(hift, decoder.micro_batch_size)
    try:
        graphed = run_engine(decoder, hosts, jobs, ahead=True)
        stats = decoder.stats()
    finally:
        decoder.model.flow, decoder.model.hift = flow, hift
    diff = max(float((graphed["audio"][j.job_id] - eager["audio"][j.job_id]).abs().max()) for j in jobs)
    return {**stats, **verdict.graph_figures(stats, before), "max_abs_diff_to_eager": diff}


def compare(a: dict, b: dict, jobs: list[EngineJob]) -> tuple[bool, float]:
    """Two runs' audio: (bit for bit, max |difference|)."""
    same = all(torch.equal(a["audio"][j.job_id], b["audio"][j.job_id]) for j in jobs)
    return same, max(float((a["audio"][j.job_id] - b["audio"][j.job_id]).abs().max()) for j in jobs)


def failures(report: dict, strict: bool) -> list[str]:
    """Why the check fails (`bench.kit.verdict`); empty: it passed."""
    out = []
    if not report["lengths_ok"]:
        out.append("audio lengths differ from the tokens'")
    if report["max_abs_diff_to_alone"] >= 1e-4:
        out.append(f"a job differs from its decode alone by {report['max_abs_diff_to_alone']:.2g}")
    memory = report["allocated_bytes_after_rounds"]
    if len(memory) > 2 and memory[-1] > memory[1]:
        out.append("allocated memory grows over the rounds")
    if report["graphs"]["max_abs_diff_to_eager"] > 1e-5:
        out.append(f"graphs differ from eager by {report['graphs']['max_abs_diff_to_eager']:.2g}")
    out += [f"ahead vs inline ({'one stream' if r['one_stream'] else 'side stream'}): not {r['criterion']} "
            f"(max |diff| {r['max_abs_diff']:.2g})" for r in report["ahead_vs_inline"] if not r["ok"]]
    if strict:
        out += verdict.graph_failures(report["graphs"])
        out += verdict.fallback_failures({"worker": {f"{p}/{r}": n for (p, r), n in
                                                     fallbacks.counts("worker").items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--install-batch", type=int, default=4, help="voices per batched setup (0: skip)")
    parser.add_argument("--install-preset", default=None, choices=["full", "tiny"],
                        help="model size of the install timing (default: full on CUDA, tiny on a CPU)")
    parser.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                        help="fail on a fallback or a graph that did not run (default: on CUDA)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    strict = device.type == "cuda" if args.strict is None else args.strict
    torch.backends.cudnn.allow_tf32 = False  # batched and single rows must round alike
    torch.backends.cuda.matmul.allow_tf32 = False
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "strict": strict,
                    "fused_attention": fallbacks.attention_probe(device, torch.float32)}
    hosts = {}
    for pcm, sr in references().values():
        pcm24, voice_id = normalise_reference(pcm, sr)
        hosts[voice_id] = host_half(pcm24, voice_id)
    ids = list(hosts)
    tokens = torch.randint(0, VOCAB_SIZE, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    jobs = [EngineJob(f"j{i}", ids[i % 3], tokens[: 40 + 10 * i], seed=i) for i in range(6)]
    model = load_dummy(ModelArgs.tiny(), 0, device=device)
    decoder = StreamingDecoder(model, device=device, dtype=torch.float32, micro_batch_size=8)
    streams = (True, False) if device.type == "cuda" else (False,)  # a CPU has one stream
    with torch.inference_mode():
        runs = {side: (run_engine(decoder, hosts, jobs, ahead=True, side_stream=side),
                       run_engine(decoder, hosts, jobs, ahead=False, side_stream=side)) for side in streams}
        ahead, inline = runs[streams[0]]  # as the worker runs: the side stream on CUDA
        report["graphs"] = graphs_check(decoder, hosts, jobs, ahead)
        alone = {}
        for job in jobs:
            voice = install_voice(hosts[job.voice_id], speaker=StandInSpeaker(device), decoder=decoder)
            alone[job.job_id] = decoder.decode_offline(voice, job.tokens, job.seed).cpu()
        memory = []
        engine, _ = make_engine(decoder, hosts, ahead=True)  # one persistent engine, as in the worker
        for r in range(args.rounds):  # allocated memory must stop growing after warm-up
            again = [EngineJob(f"r{r}-{j.job_id}", j.voice_id, j.tokens, j.seed) for j in jobs]
            run_engine(decoder, hosts, again, ahead=True, engine=engine)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.synchronize()
                memory.append(torch.cuda.memory_allocated(device))
        if engine.resolver.install_lane is not None:
            engine.resolver.install_lane.shutdown(wait=True)  # type: ignore[attr-defined]
    report["ahead_vs_inline"] = [verdict.ahead_vs_inline(*compare(*runs[side], jobs), one_stream=not side)
                                 for side in streams]
    report["ahead_vs_inline_criterion"] = verdict.CRITERION
    report["max_abs_diff_to_alone"] = max(
        float((ahead["audio"][j.job_id] - alone[j.job_id]).abs().max()) for j in jobs)
    report["lengths_ok"] = all(ahead["audio"][j.job_id].numel() == len(j.tokens) * SAMPLES_PER_TOKEN
                               for j in jobs)
    report["ahead"] = {k: v for k, v in ahead.items() if k != "audio"}
    report["inline"] = {k: v for k, v in inline.items() if k != "audio"}
    report["allocated_bytes_after_rounds"] = memory
    if args.install_batch > 1:
        preset = args.install_preset or ("full" if device.type == "cuda" else "tiny")
        report["install_batch"] = install_batch_timing(device, preset, args.install_batch, args.rounds)
    report["worker_fallbacks"] = {f"{p}/{r}": n for (p, r), n in fallbacks.counts("worker").items()}
    report["failures"] = failures(report, strict)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(verdict.first_line("gpu_check", report["failures"]))
    print(json.dumps(report, indent=2))
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
