"""The engine: continuous batching of streaming jobs over one decoder, in the style of vLLM's EngineCore.

`add(job)` and `abort(job_id)` may be called from any thread. The one thread that owns the device calls
`fetch_features()`, the input side: the feature store read for the voices queued and waiting jobs need,
each answer handed to the inbox (`gpu_worker.engine.inbox`) as an event; then `step()`, which reads no
store and does, in order:
1. pump: apply aborts, admit new jobs, take the store's answers, and let the resolver
   (`gpu_worker.engine.resolver`) make each waiting job's voice ready: installed, installed from the
   store's features, or prepared inline once the prep wait ran out (in a pool or the CPU install lane, so
   other rows keep decoding); then the job gets its stream;
2. schedule: the scheduler (`gpu_worker.engine.scheduler`) picks up to `micro_batch_size` rows, one chunk per
   stream. An idle engine first gathers a burst of arrivals for up to `admission_window_ms`, so jobs
   submitted one by one start in one step;
3. execute: one batched decoder step; each row's audio is handed out as an `Audio` event;
4. finish: release finished, failed and aborted jobs, reclaim abandoned installs, evict unpinned voices.

Every way a job's voice became ready is counted (`PREP_PATHS`). A failing job fails alone (`EngineFailure`).
Transport (Celery, Redis, the database) stays outside `step()`: features come through `FeatureSource`,
read by `fetch_features`, inline preparation through `InlinePreparer`, results leave as events.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch

from app.errors import EngineFailure
from gpu_worker.engine.inbox import FeaturesArrived, FeatureSource, Inbox, read_features
from gpu_worker.engine.live import EngineConfig, Live
from gpu_worker.engine.resolver import (
    PREP_PATHS,
    Fail,
    InlinePreparer,
    Outcome,
    Start,
    VoiceResolver,
)
from gpu_worker.engine.scheduler import Scheduler, StreamView, gather_until
from gpu_worker.engine.streams import (
    Aborted,
    Audio,
    ChunkRow,
    EngineEvent,
    EngineJob,
    Failed,
    Finished,
    StreamDecoder,
    VoiceEvicted,
    VoiceReady,
    audio_to_host,
    plan_chunks,
    validate_tokens,
)
from gpu_worker.model.config import SAMPLE_RATE
from gpu_worker.voices.cache import InstalledVoice, VoiceCache

log = logging.getLogger(__name__)

DEFAULT_CONFIG = EngineConfig()


class Engine:
    def __init__(self, decoder: StreamDecoder, voices: VoiceCache, *, features: FeatureSource,
                 preparer: InlinePreparer, config: EngineConfig = DEFAULT_CONFIG,
                 clock: Callable[[], float] = time.monotonic, prep_pool: Executor | None = None,
                 install_lane: Executor | None = None) -> None:
        """`prep_pool`: where inline host halves run beside the decode (None: in the engine thread);
        `install_lane`: the side thread installs run on (`voices.install_lane`: a CUDA worker's always,
        its device work on the side stream; None: installs run here)."""
        self.decoder = decoder
        self.voices = voices
        self.config = config
        self.features = features  # read by the input side, `fetch_features`; never in `step`
        self.resolver = VoiceResolver(voices, preparer=preparer, clock=clock, prep_pool=prep_pool,
                                      install_lane=install_lane, install_batch=config.install_batch)
        self.prep_wait_s = config.prep_wait_ms / 1000.0
        self.admission_window_s = config.admission_window_ms / 1000.0  # 0: an idle engine starts at once
        self.clock = clock
        self.scheduler = Scheduler(micro_batch_size=config.micro_batch_size)
        self.counters: Counter[str] = Counter(dict.fromkeys(PREP_PATHS, 0))
        self.stats: Counter[str] = Counter()  # steps, batches, rows, mel frames; jobs finished/failed/aborted
        self._live: dict[str, Live] = {}
        self._inbox = Inbox()
        self._arrivals = itertools.count()

    # -- called from any thread ----------------------------------------------------------------------
    def add(self, job: EngineJob) -> None:
        """Queue a job for admission at the next step; BadTokens at once if its tokens are unusable."""
        self._inbox.add(job, validate_tokens(job.tokens))

    def abort(self, job_id: str) -> None:
        """Drop a job at the next step (frees its slot and its voice pin); unknown ids are ignored."""
        self._inbox.abort(job_id)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a job or an abort is queued, a job is live or a preparation is in the pool."""
        # resolver.preparing: a preparation whose jobs went away is still collected once it settles
        return self._inbox.wait(lambda: bool(self._live or self.resolver.preparing), timeout)

    def live_jobs(self) -> list[str]:
        return list(self._live)

    def snapshot(self) -> dict[str, Any]:
        """Counters for dashboards: prep paths, steps, rows, jobs, voices, the decoder's (CUDA graphs)."""
        return {"prep_paths": dict(self.counters), **self.stats, "installs": self.resolver.installs,
                "live_jobs": len(self._live), "voices": len(self.voices), "voice_bytes": self.voices.nbytes(),
                **getattr(self.decoder, "stats", dict)()}

    def idle_hint_s(self) -> float:
        """How long the loop may sleep after a step that decoded nothing: an idle engine is gathering a
        burst (at most what is left of it), or every live job is waiting for its voice (the store, a prep
        deadline or a preparation in the pool or the lane)."""
        now = self.clock()
        gather = self._gather_until()
        if gather is not None:
            return min(0.01, max(0.001, gather - now))
        waiting = [lv for lv in self._live.values() if lv.waiting]
        if not waiting:
            return 0.05
        until = [lv.deadline - now for lv in waiting if lv.job.voice_id not in self.resolver.preparing]
        return min(0.01, max(0.001, min(until, default=0.01)))

    # -- the engine thread ---------------------------------------------------------------------------
    def fetch_features(self) -> None:
        """The input side, called before each `step()` by the thread that steps the engine: the store read
        once per voice a queued or waiting job needs from it, each answer queued as `FeaturesArrived`."""
        queued, aborts = self._inbox.pending()
        waiting = [lv.job for lv in self._live.values() if lv.waiting]
        for voice_id in self.resolver.wanted(j for j in waiting + queued if j.job_id not in aborts):
            self._inbox.arrived(FeaturesArrived(voice_id, read_features(self.features, voice_id)))

    def step(self) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        self._pump(events)  # 1. aborts, admissions, voices
        gathering = self._gather_until() is not None
        picked = [] if gathering else self.scheduler.pick(self._views())  # 2. schedule
        if picked:
            self._execute([self._live[v.job_id] for v in picked], events)  # 3. decode
        self._finish(events)  # 4. release, reclaim, evict
        self.stats["steps"] += 1
        return events

    # 1. pump -----------------------------------------------------------------------------------------
    def _pump(self, events: list[EngineEvent]) -> None:
        drained = self._inbox.drain()
        now = self.clock()
        for job, tokens in drained.jobs:
            self._live[job.job_id] = Live(job=job, tokens=tokens, chunks=plan_chunks(tokens.numel()),
                                           arrival=next(self._arrivals), admitted=now,
                                           deadline=now + self.prep_wait_s)
        for job_id in drained.aborts:
            live = self._live.get(job_id)
            if live is not None:
                self._abort_live(live, events)
        for outcome in self.resolver.collect(self._waiting_for, events):  # settled lane/pool preparations
            self._apply(outcome, events)
        for live in list(self._live.values()):
            if live.waiting:  # the answers: mutable, shared by the pump
                self._apply(self.resolver.resolve(live, drained.features, events), events)
        for outcome in self.resolver.flush(self._waiting_for, events):  # stored voices found together
            self._apply(outcome, events)

    def _abort_live(self, live: Live, events: list[EngineEvent]) -> None:
        if live.outcome is not None:
            return
        if live.stream is None:
            live.prep_path = "abandoned"
            self.counters["abandoned"] += 1
        live.outcome = "aborted"
        events.append(Aborted(job_id=live.job.job_id, prep_path=live.prep_path))

    def _apply(self, outcome: Outcome | None, events: list[EngineEvent]) -> None:
        if isinstance(outcome, Start):
            self._start(outcome.live, outcome.path, self.voices.pin(outcome.live.job.voice_id), events,
                        installed=outcome.installed)
        elif isinstance(outcome, Fail):
            self._fail(outcome.live, outcome.error, events, path=outcome.path)

    def _waiting_for(self, voice_id: str) -> list[Live]:
        return [lv for lv in self._live.values()
                if lv.job.voice_id == voice_id and lv.waiting]

    def _start(self, live: Live, path: str, entry: InstalledVoice, events: list[EngineEvent],
               installed: bool = False) -> None:
        """`installed`: the voice was installed for this job just now (its timings get `install_s`)."""
        live.pinned = True
        live.prep_path = path
        self.counters[path] += 1
        now = self.clock()
        live.times["prep_wait_s"] = now - live.admitted
        if installed:
            live.times["install_s"] = entry.install_s
        try:
            live.stream = self.decoder.open_stream(entry.prompt, live.job.seed)
        except Exception as exc:  # e.g. out of device memory for this stream's caches
            self._fail(live, exc, events, path=path)
            return
        events.append(VoiceReady(job_id=live.job.job_id, voice_id=live.job.voice_id, prep_path=path,
                                 wait_s=live.times["prep_wait_s"]))

    # 2. schedule -------------------------------------------------------------------------------------
    def _gather_until(self) -> float | None:
        """When an idle engine's first step may start (`scheduler.gather_until`); None: now."""
        live = [lv for lv in self._live.values() if lv.outcome is None]
        ready = [lv for lv in live if lv.stream is not None]
        return gather_until(
            window_s=self.admission_window_s, micro_batch_size=self.scheduler.micro_batch_size,
            ready=[lv.admitted for lv in ready], arrived=[lv.admitted for lv in live],
            started=any(lv.next_chunk > 0 for lv in ready), now=self.clock())

    def _views(self) -> list[StreamView]:
        return [StreamView(job_id=lv.job.job_id, voice_id=lv.job.voice_id,
                           ready=lv.stream is not None, chunk_index=lv.next_chunk,
                           priority=lv.job.priority, arrival=lv.arrival)
                for lv in self._live.values() if lv.outcome is None]

    # 3. execute --------------------------------------------------------------------------------------
    def _execute(self, batch: list[Live], events: list[EngineEvent]) -> None:
        rows = []
        for live in batch:
            self.voices.wait_ready(live.job.voice_id)
            chunk = live.chunks[live.next_chunk]
            rows.append(ChunkRow(live.stream, live.tokens[chunk.start:chunk.stop], chunk.last))
        try:
            audios = self.decoder.step(rows)
        except Exception as exc:  # isolate the failing row by decoding one by one
            if len(batch) == 1:
                self._fail(batch[0], exc, events)
                return
            log.warning("batched step of %d rows failed (%s); decoding rows one by one", len(batch), exc)
            for live in batch:
                self._execute([live], events)
            return
        self.stats["rows"] += len(rows)
        self.stats["batches"] += 1
        self.stats["mel_frames"] += sum(live.chunks[live.next_chunk].mel_frames for live in batch)
        for live, audio in zip(batch, audio_to_host(audios), strict=True):
            self._hand_out(live, audio, events)

    def _hand_out(self, live: Live, audio: torch.Tensor, events: list[EngineEvent]) -> None:
        now = self.clock()
        if live.next_chunk == 0:
            live.times["first_audio_s"] = now - live.admitted
        index = live.next_chunk
        live.next_chunk += 1
        live.samples += audio.numel()
        last = live.next_chunk == len(live.chunks)
        events.append(Audio(job_id=live.job.job_id, chunk_index=index, n_chunks=len(live.chunks),
                            samples=audio, last=last))
        if last:
            live.outcome = "finished"
            self.voices.mark_used(live.job.voice_id)  # an install that served a whole job is worth keeping
            live.times["total_s"] = now - live.admitted
            self.stats["finished"] += 1
            events.append(Finished(job_id=live.job.job_id, prep_path=live.prep_path or "",
                                   n_samples=live.samples, audio_s=live.samples / SAMPLE_RATE,
                                   timings=dict(live.times)))

    def _fail(self, live: Live, exc: BaseException, events: list[EngineEvent],
              path: str | None = None) -> None:
        error = EngineFailure(f"job {live.job.job_id}: {type(exc).__name__}: {exc}")
        log.error("%s", error, exc_info=exc)
        live.prep_path = live.prep_path or path
        live.outcome = "failed"
        self.stats["failed"] += 1
        events.append(Failed(job_id=live.job.job_id, error=str(error), prep_path=live.prep_path))

    # 4. finish ---------------------------------------------------------------------------------------
    def _finish(self, events: list[EngineEvent]) -> None:
        done = [lv for lv in self._live.values() if lv.outcome is not None]
        for live in done:
            del self._live[live.job.job_id]
            self.scheduler.forget(live.job.job_id)
            if live.stream is not None:
                self.decoder.close_stream(live.stream)  # its lane (the decoder's caches) for the next job
            if live.pinned:
                self.voices.unpin(live.job.voice_id)
                if live.outcome != "finished":
                    self.voices.reclaim_if_unused(live.job.voice_id)
            if live.outcome == "aborted":
                self.stats["aborted"] += 1
        self._inbox.forget(lv.job.job_id for lv in done)
        for voice_id in self.voices.collect():
            self.stats["evictions"] += 1
            events.append(VoiceEvicted(voice_id=voice_id))
