"""The engine sweep: frames served, first-audio latency, step times and memory, by mode and concurrency.

The `Engine` runs as the GPU worker runs it, with an in-memory feature store and an inline preparer
that runs the host half (`app.voices.features.host_half`) on the voice's PCM; no Celery, Redis or database.

Modes, run one after another on the same jobs:
    a  sequential batch-1, inline preparation: one job at a time (the next is admitted when the previous
       finishes, first come first served), one row per step, a new voice prepared (host + device half)
       inside the step that first needs it
    b  batched, inline preparation: every submitted job admitted, up to `micro_batch_size` rows per step
    c  batched, preparation ahead: the host half was computed before the run (as the CPU workers would);
       the engine installs the voice (device half) when a job first needs it, as the worker does: on CUDA
       from its install lane (a side thread) on its side stream; on a CPU in the engine thread, or with
       `install_lane` on the side thread
    d  as c with every voice already installed

Workload for concurrency C (`clients_for`), closed loop: C clients, each submitting `jobs_per_client`
jobs one after another (the next the moment the previous one's last audio arrives). Even-numbered
clients submit at the start; odd-numbered ones once the service has handed out its first chunk of audio,
so concurrency ramps to C during the run. Job j of client i uses voice (i + j) mod 2: voice 1 is new
when it first arrives mid-run, so in modes a-c it is prepared while other streams are live. Jobs are of
equal length (N chunks) or of mixed lengths. Every (mode, C) run starts with an empty voice cache.
Submission and first-audio times are taken here (the client's view), so in mode a the wait behind other
jobs counts.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from app.voices.features import PromptHostFeatures, host_half
from bench.engine.machine import PeakRss, summarize
from bench.engine.workload import BenchSetup, chunk_tokens
from gpu_worker.engine.core import Engine, EngineConfig
from gpu_worker.engine.streams import Aborted, Audio, EngineJob, Failed, Finished, VoiceInstalled
from gpu_worker.model.config import CHUNK_TOKENS, MEL_PER_TOKEN, SAMPLES_PER_MEL
from gpu_worker.voices.cache import VoiceCache
from gpu_worker.voices.cache import install_lane as lane_for


@dataclass(frozen=True)
class Mode:
    key: str
    title: str
    sequential: bool
    ahead: bool  # host features in the store before the run
    installed: bool  # voices installed before the run


MODES = {m.key: m for m in (
    Mode("a", "sequential batch-1, inline prep", sequential=True, ahead=False, installed=False),
    Mode("b", "batched, inline prep", sequential=False, ahead=False, installed=False),
    Mode("c", "batched, prep ahead", sequential=False, ahead=True, installed=False),
    Mode("d", "batched, voices installed", sequential=False, ahead=True, installed=True),
)}


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    voice: int  # voice index (BenchSetup.voice)
    n_tokens: int
    seed: int


def equal_tokens(chunks: int) -> list[int]:
    return [CHUNK_TOKENS * chunks + 2]  # exactly `chunks` chunks, the last one 27 tokens


def mixed_tokens(chunks: int) -> list[int]:
    """1, chunks, chunks + 1 and about chunks - 1 chunks, with odd tails."""
    n = CHUNK_TOKENS
    return [12, n * chunks + 2, n * (chunks + 1) + 2, n * max(chunks - 1, 1) + 14]


def clients_for(concurrency: int, lengths: list[int], jobs_per_client: int, tag: str) -> list[list[JobSpec]]:
    """Each client's jobs, in the order it submits them."""
    return [[JobSpec(job_id=f"{tag}-{i}-{j}", voice=(i + j) % 2,
                     n_tokens=lengths[(i + j) % len(lengths)], seed=10_000 * concurrency + 100 * i + j)
             for j in range(jobs_per_client)] for i in range(concurrency)]


class MemoryFeatures:
    """FeatureSource: host features computed before the run."""

    def __init__(self, features: dict[str, PromptHostFeatures]) -> None:
        self.features = features

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        return self.features.get(voice_id)


class PcmPreparer:
    """InlinePreparer: the host half on the voice's normalised PCM, timed."""

    def __init__(self, setup: BenchSetup, by_id: dict[str, int]) -> None:
        self.setup, self.by_id = setup, by_id
        self.seconds = 0.0

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        voice = self.setup.voice(self.by_id[job.voice_id])
        start = time.perf_counter()
        host = host_half(voice.pcm, voice.voice_id)
        self.seconds += time.perf_counter() - start
        return host


def _engine(setup: BenchSetup, mode: Mode, voices_used: list[int], micro_batch_size: int,
            lane: Executor | None = None) -> tuple[Engine, PcmPreparer]:
    by_id = {setup.voice(v).voice_id: v for v in voices_used}
    if mode.installed:  # the bench's own installs of these voices, shared read-only as the worker would
        cache = VoiceCache(lambda host: setup.install(by_id[host.voice_id]), device=setup.device)
        for v in voices_used:
            cache.install(setup.host(v))
    else:
        cache = VoiceCache(setup.installer, device=setup.device)
    features = {setup.voice(v).voice_id: setup.host(v) for v in voices_used} if mode.ahead else {}
    preparer = PcmPreparer(setup, by_id)
    config = EngineConfig(micro_batch_size=1 if mode.sequential else micro_batch_size, prep_wait_ms=0)
    engine = Engine(setup.decoder, cache, features=MemoryFeatures(features), preparer=preparer, config=config,
                    install_lane=lane if mode.ahead or setup.device.type == "cuda" else None)  # as the worker
    return engine, preparer


class _Clients:
    """The client side of one run: submissions, admissions, and what came back."""

    def __init__(self, setup: BenchSetup, clients: list[list[JobSpec]], sequential: bool) -> None:
        self.setup = setup
        self.todo = [deque(jobs) for jobs in clients]
        self.client_of = {spec.job_id: i for i, jobs in enumerate(clients) for spec in jobs}
        self.queue: deque[JobSpec] = deque()  # submitted, not yet admitted
        self.sequential = sequential
        self.in_engine = 0
        self.submitted: dict[str, float] = {}
        self.first_audio: dict[str, float] = {}
        self.samples: Counter[str] = Counter()
        self.finished = 0
        self.install_s = 0.0
        self.installs = 0
        self.late = [i for i in range(len(clients)) if i % 2 == 1]  # submit after the first audio
        for i in range(0, len(clients), 2):
            self._submit_next(i, time.perf_counter())

    def _submit_next(self, client: int, now: float) -> None:
        if self.todo[client]:
            spec = self.todo[client].popleft()
            self.submitted[spec.job_id] = now
            self.queue.append(spec)

    def admit(self, engine: Engine) -> None:
        while self.queue and not (self.sequential and self.in_engine > 0):
            spec = self.queue.popleft()
            engine.add(EngineJob(job_id=spec.job_id, voice_id=self.setup.voice(spec.voice).voice_id,
                                 tokens=chunk_tokens(spec.n_tokens, spec.seed), seed=spec.seed))
            self.in_engine += 1

    def take(self, events: list[Any], now: float) -> int:
        rows = 0
        for event in events:
            if isinstance(event, Audio):
                rows += 1
                self.samples[event.job_id] += event.samples.numel()
                if event.chunk_index == 0:
                    self.first_audio[event.job_id] = now
                if self.late:
                    for client in self.late:
                        self._submit_next(client, now)
                    self.late = []
            elif isinstance(event, Finished):
                self.finished += 1
                self.in_engine -= 1
                self._submit_next(self.client_of[event.job_id], now)
            elif isinstance(event, VoiceInstalled):
                self.installs += 1
                self.install_s += event.install_s
            elif isinstance(event, Failed | Aborted):
                raise RuntimeError(f"bench job {event.job_id} did not finish: {event}")
        return rows


def run_mode(setup: BenchSetup, mode: Mode, clients: list[list[JobSpec]], micro_batch_size: int,
             install_lane: bool = False) -> dict[str, Any]:
    """One mode over one workload. Modes c and d install voices on the install lane as the worker does
    (`voices.install_lane`: on CUDA always; on a CPU with `install_lane`)."""
    specs = [spec for jobs in clients for spec in jobs]
    voices_used = sorted({s.voice for s in specs})
    lane = lane_for(setup.device, asked=install_lane)
    try:
        engine, preparer = _engine(setup, mode, voices_used, micro_batch_size, lane)
        return _drive(setup, mode, clients, specs, voices_used, engine, preparer)
    finally:
        if lane is not None:
            lane.shutdown(wait=True)


def _drive(setup: BenchSetup, mode: Mode, clients: list[list[JobSpec]], specs: list[JobSpec],
           voices_used: list[int], engine: Engine, preparer: PcmPreparer) -> dict[str, Any]:
    step_s: list[float] = []
    batches: Counter[int] = Counter()
    with PeakRss() as rss:
        start = time.perf_counter()
        run = _Clients(setup, clients, mode.sequential)
        while run.finished < len(specs):
            run.admit(engine)
            engine.fetch_features()  # the input side, as the worker's loop runs it before each step
            t0 = time.perf_counter()
            events = engine.step()
            now = time.perf_counter()
            rows = run.take(events, now)
            if rows:
                step_s.append(now - t0)
                batches[rows] += 1
            else:  # every live job waits for its voice (the lane): sleep as the worker's loop does
                time.sleep(min(engine.idle_hint_s(), 0.01))
        wall = time.perf_counter() - start
    frames = sum(run.samples.values()) / SAMPLES_PER_MEL
    latency = [run.first_audio[s.job_id] - run.submitted[s.job_id] for s in specs]
    return {
        "mode": mode.key, "mode_title": mode.title, "concurrency": len(clients), "jobs": len(specs),
        "voices": len(voices_used), "tokens": sum(s.n_tokens for s in specs), "frames": frames,
        "frames_expected": MEL_PER_TOKEN * sum(s.n_tokens for s in specs), "rows": sum(batches.elements()),
        "wall_s": wall, "fps": frames / wall, "first_audio_s": summarize(latency),
        "step_s": summarize(step_s), "batch_hist": {str(k): batches[k] for k in sorted(batches)},
        "peak_rss_mib": rss.peak_mib, "rss_at_start_mib": rss.start_mib,
        "prep_paths": {k: v for k, v in engine.counters.items() if v},
        "installs": run.installs, "install_s": run.install_s, "inline_host_half_s": preparer.seconds,
        "prep_share": (run.install_s + preparer.seconds) / wall,
    }


def engine_sweep(setup: BenchSetup, modes: list[str], concurrency: list[int], chunks: int, mixed: int,
                 jobs_per_client: int, micro_batch_size: int, log: Callable[[str], None] = print,
                 on_result: Callable[[dict[str, Any]], None] | None = None, install_lane: bool = False
                 ) -> list[dict[str, Any]]:
    """Every mode at every concurrency on equal-length jobs, then every mode on the mixed set."""
    workloads = [("equal", clients_for(c, equal_tokens(chunks), jobs_per_client, f"eq{c}"))
                 for c in concurrency]
    if mixed:
        workloads.append(("mixed", clients_for(mixed, mixed_tokens(chunks), jobs_per_client, f"mx{mixed}")))
    results = []
    for name, clients in workloads:
        for key in modes:
            result = run_mode(setup, MODES[key], clients, micro_batch_size, install_lane)
            result["workload"] = name
            results.append(result)
            if on_result is not None:
                on_result(result)
            log(f"  engine {name:5s} C={len(clients):2d} mode {key}: {result['fps']:8.1f} frames/s, "
                f"first audio p95 {result['first_audio_s']['p95']:.2f} s, batches {result['batch_hist']}")
    return results
