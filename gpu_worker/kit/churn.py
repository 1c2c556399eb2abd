"""Part 4: churn. The engine as the worker runs it (graphs on, float32 with TF32 off so every job can be
held to its decode alone) through `cycles` rounds, each adding a job on one of two shared voices and one
on a distinct voice, while:
    installs are slowed (on CUDA a sleep kernel on the installing side stream, so a step must wait on the
        install's event; on a CPU a host sleep),
    features arrive late for some voices and never for others (those are prepared inline after the prep
        wait: the inline fallback),
    every fifth round cancels a live job, and the voice cache holds three voices (evictions).
Then every finished job's audio against the same job decoded alone (max |diff|, within 1e-4), and the
device memory allocated after each round past the warm-up (flat: the last no higher than the first
plus 1 MiB)."""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

import torch

from app.features import PromptHostFeatures
from gpu_worker.bench.sweep import PcmPreparer
from gpu_worker.bench.workload import BenchSetup, chunk_tokens
from gpu_worker.engine import Engine, EngineConfig
from gpu_worker.kit import points
from gpu_worker.kit.part import PartRun
from gpu_worker.model.config import CHUNK_TOKENS
from gpu_worker.streams import Aborted, Audio, EngineJob, Failed, Finished
from gpu_worker.voices import VoiceCache

SHARED, DISTINCT, CACHE_VOICES, WARMUP = 2, 6, 3, 5
INSTALL_DELAY_S = 0.02
SLEEP_CYCLES = 20_000_000  # torch.cuda._sleep: about 10 ms at 2 GHz


class LateFeatures:
    """Host features that arrive after `polls` asks (voice index % 3 == 1), or never (% 3 == 2)."""

    def __init__(self, setup: BenchSetup, by_id: dict[str, int], polls: int = 3) -> None:
        self.setup, self.by_id, self.polls = setup, by_id, polls
        self.asked: Counter[str] = Counter()

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        self.asked[voice_id] += 1
        index = self.by_id[voice_id]
        if index % 3 == 2 or (index % 3 == 1 and self.asked[voice_id] <= self.polls):
            return None
        return self.setup.host(index)


def slow_installer(ctx: PartRun, setup: BenchSetup):
    def install(host: PromptHostFeatures):
        if ctx.cuda:
            torch.cuda._sleep(SLEEP_CYCLES)  # on the side stream the cache installs on
        else:
            time.sleep(INSTALL_DELAY_S)
        return setup.installer(host)

    return install


def drive(ctx: PartRun, setup: BenchSetup, cycles: int, private: dict[str, Any]) -> dict[str, Any]:
    """The rounds (module docstring) -> figures; the audio, jobs and endings go into `private`."""
    voices = list(range(SHARED + DISTINCT))
    by_id = {setup.voice(v).voice_id: v for v in voices}
    engine = Engine(setup.decoder, VoiceCache(slow_installer(ctx, setup), device=setup.device,
                                              max_voices=CACHE_VOICES),
                    features=LateFeatures(setup, by_id), preparer=PcmPreparer(setup, by_id),
                    config=EngineConfig(micro_batch_size=setup.decoder.micro_batch_size, prep_wait_ms=30,
                                        admission_window_ms=0))
    rng = random.Random(30)
    jobs: dict[str, EngineJob] = {}
    audio: dict[str, list[torch.Tensor]] = {}
    ended: dict[str, str] = {}
    events_seen: Counter[str] = Counter()
    memory: list[float] = []

    def take(events: list[Any]) -> None:
        for event in events:
            events_seen[type(event).__name__] += 1
            if isinstance(event, Audio):
                audio[event.job_id].append(event.samples)
            elif isinstance(event, Finished | Failed | Aborted):
                ended[event.job_id] = type(event).__name__

    for cycle in range(cycles):
        for k, voice in enumerate((cycle % SHARED, SHARED + cycle % DISTINCT)):
            n = rng.choice([12, CHUNK_TOKENS + 7, 2 * CHUNK_TOKENS + 2, 3 * CHUNK_TOKENS + 14])
            job = EngineJob(f"c{cycle}-{k}", setup.voice(voice).voice_id, chunk_tokens(n, 1000 * cycle + k),
                            seed=1000 * cycle + k)
            jobs[job.job_id], audio[job.job_id] = job, []
            engine.add(job)
        if cycle % 5 == 4:
            live = [j for j in jobs if j not in ended]
            if live:
                engine.abort(rng.choice(live))
        for _ in range(3):
            take(engine.step())
        if ctx.cuda:
            torch.cuda.synchronize()
            memory.append(torch.cuda.memory_allocated() / 2**20)
        if ctx.left() < 10:
            ctx.skipped(f"churn cycles {cycle + 1}..{cycles}")
            break
    for _ in range(20_000):
        if len(ended) == len(jobs):
            break
        events = engine.step()
        take(events)
        if not events:
            time.sleep(min(engine.idle_hint_s(), 0.01))
    private.update(audio=audio, jobs=jobs, ended=ended)
    return {"cycles": cycle + 1, "jobs": len(jobs), "ended": dict(Counter(ended.values())),
            "events": dict(events_seen), "prep_paths": {k: v for k, v in engine.counters.items() if v},
            "memory_mib": memory}


def against_alone(setup: BenchSetup, run: dict[str, Any]) -> dict[str, Any]:
    by_id = {setup.voice(v).voice_id: v for v in range(SHARED + DISTINCT)}
    worst, compared = 0.0, 0
    lengths_ok = True
    with torch.inference_mode():
        for job_id, kind in run["ended"].items():
            if kind != "Finished":
                continue
            job = run["jobs"][job_id]
            alone = setup.decoder.decode_offline(setup.install(by_id[job.voice_id]), job.tokens, job.seed).cpu()
            got = torch.cat(run["audio"][job_id])
            lengths_ok &= got.shape == alone.shape
            if got.shape == alone.shape:
                worst = max(worst, float((got - alone).abs().max()))
            compared += 1
    return {"compared": compared, "max_abs_diff_to_alone": worst, "lengths_ok": lengths_ok,
            "equal_within_1e-4": lengths_ok and worst <= 1e-4}


def run(ctx: PartRun) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    rows = 16 if ctx.preset == "full" else 4
    setup = points.build_recorded(ctx, "build", "fp32", rows, graphs=True)
    if setup is None:
        return
    try:
        private: dict[str, Any] = {}
        with torch.inference_mode():
            result = ctx.attempt("churn", lambda: drive(ctx, setup, ctx.sizes.churn_cycles, private))
        if result is None:
            return
        ctx.attempt("against_alone", lambda: against_alone(setup, private))
        memory = result["memory_mib"][WARMUP:]
        if memory:
            ctx.results["memory_flat"] = memory[-1] <= memory[0] + 1.0
        else:
            ctx.not_applicable("device memory after each round (CUDA allocator)")
        ctx.save()
    finally:
        setup.close()
