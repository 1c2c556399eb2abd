"""The installed-voice cache (`gpu_worker.voices.cache`): least recently used unpinned voices are evicted over
capacity, pinned ones never; through the engine with fakes, and with capacity 1, three voices in turn,
through the real engine and tiny model (the evicted voice's tensors are freed; two jobs of one voice
install it once)."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from functools import partial

import numpy as np
import torch

from app.audio import normalise_reference
from app.voices.features import PromptHostFeatures, host_half
from gpu_worker.checkpoint.load import load_dummy
from gpu_worker.engine.core import Engine, EngineConfig
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.engine.streams import EngineJob, Finished, VoiceEvicted, VoiceInstalled
from gpu_worker.model.config import ModelArgs
from gpu_worker.voices.cache import VoiceCache, install_lane
from gpu_worker.voices.prompt import StandInSpeaker, install_voice
from tests.support.fakes import (
    TOKENS,
    features,
    harness,
    job,
)


def voice(f0: float) -> PromptHostFeatures:
    t = np.arange(3 * 24000) / 24000
    pcm, voice_id = normalise_reference((0.3 * np.sin(2 * np.pi * f0 * t)).astype(np.float32), 24000)
    return host_half(pcm, voice_id)


class Features:
    def __init__(self, voices: list[PromptHostFeatures]) -> None:
        self.by_id = {v.voice_id: v for v in voices}

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        return self.by_id.get(voice_id)

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        raise AssertionError("every voice is prepared ahead in this test")


def run_to_end(engine: Engine, job_id: str) -> list:
    events: list = []
    while not any(isinstance(e, Finished) and e.job_id == job_id for e in events):
        engine.fetch_features()
        events += engine.step()
    return events


def test_capacity_one_evicts_the_lru_voice_and_frees_its_tensors() -> None:
    torch.set_num_threads(1)
    voices = [voice(f) for f in (110.0, 180.0, 260.0)]
    features = Features(voices)
    decoder = StreamingDecoder(load_dummy(ModelArgs.tiny(), 0), device="cpu", dtype=torch.float32,
                               micro_batch_size=4)
    cache = VoiceCache(partial(install_voice, speaker=StandInSpeaker("cpu"), decoder=decoder), max_voices=1)
    engine = Engine(decoder, cache, features=features, preparer=features,
                    config=EngineConfig(micro_batch_size=4, prep_wait_ms=0))
    tokens = list(range(100, 140))
    installed, evicted, refs = [], [], {}
    with torch.inference_mode():
        for i, v in enumerate([voices[0], voices[0], voices[1], voices[2]]):
            events = run_to_end_after_add(engine, EngineJob(f"j{i}", v.voice_id, tokens, seed=i))
            installed += [e.voice_id for e in events if isinstance(e, VoiceInstalled)]
            evicted += [e.voice_id for e in events if isinstance(e, VoiceEvicted)]
            entry = cache.get(v.voice_id)
            if entry is not None:
                refs[v.voice_id] = weakref.ref(entry.prompt.estimator_att_cache)
    ids = [v.voice_id for v in voices]
    assert installed == ids  # the shared voice was installed once for its two jobs
    assert evicted == ids[:2]
    assert list(cache) == [ids[2]] and cache.nbytes() == cache.get(ids[2]).nbytes
    del entry, events
    gc.collect()
    assert refs[ids[0]]() is None and refs[ids[1]]() is None  # evicted voices' tensors are freed
    assert refs[ids[2]]() is not None


def run_to_end_after_add(engine: Engine, job: EngineJob) -> list:
    engine.add(job)
    return run_to_end(engine, job.job_id)


def test_least_recently_used_unpinned_voices_are_evicted_over_capacity() -> None:
    h = harness("v1", "v2", "v3", max_voices=2)
    for i, voice in enumerate(["v1", "v2"]):
        h.engine.add(job(f"j{i}", voice, tokens=TOKENS[:10]))
    h.run()
    h.engine.add(job("j3", "v1", tokens=TOKENS[:10]))  # v1 becomes the most recently used
    h.run()
    h.engine.add(job("j4", "v3", tokens=TOKENS[:10]))
    h.run()
    assert [e.voice_id for e in h.of(VoiceEvicted)] == ["v2"]
    assert sorted(h.engine.voices) == ["v1", "v3"]


def test_pinned_voices_are_not_evicted() -> None:
    h = harness("v1", "v2", max_voices=1)
    h.engine.add(job("a", "v1"))
    h.engine.add(job("b", "v2"))
    h.step()
    assert sorted(h.engine.voices) == ["v1", "v2"]
    h.run()
    assert len(h.engine.voices) == 1


class FakeCudaStreams:
    """torch.cuda's streams and events as `VoiceCache` uses them, each call recorded with its thread (no GPU
    here): the current stream is per thread, as CUDA's is."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.log: list[tuple[str, str, object]] = []  # (thread, what, stream)
        self.main = self.make("main")

    def make(self, name: str) -> object:
        fake = self

        class Stream:
            def __repr__(self) -> str:
                return name

            def wait_event(self, event) -> None:
                fake.log.append((threading.current_thread().name, f"wait {event.name}", self))

        return Stream()

    def Stream(self, device=None):  # noqa: N802 - torch.cuda's names
        return self.make("side")

    def current_stream(self, device=None):
        return getattr(self.local, "stream", self.main)

    @contextlib.contextmanager
    def stream(self, s):
        previous = self.current_stream()
        self.local.stream = s
        yield
        self.local.stream = previous

    def Event(self):  # noqa: N802
        fake = self

        class Event:
            name = f"event{len(fake.log)}"

            def record(self, stream) -> None:
                fake.log.append((threading.current_thread().name, f"record {self.name}", stream))

        return Event()


class PromptOnCuda:
    """An installed prompt whose tensors record which stream they were `record_stream`-ed on."""

    def __init__(self, voice_id: str, log: list) -> None:
        self.voice_id, self.log = voice_id, log

    def nbytes(self) -> int:
        return 1

    def tensors(self):
        log = self.log

        class Tensor:
            def record_stream(self, stream) -> None:
                log.append((threading.current_thread().name, "record_stream", stream))

        return iter([Tensor(), Tensor()])


def test_on_cuda_an_install_built_on_the_lane_runs_on_the_side_stream_and_the_step_waits_for_it(
        monkeypatch) -> None:
    """Issue 41, finding 6: a CUDA worker builds installs on its install lane (a side thread: CAM++ on the
    CPU must not stall the decode loop); the device work still goes on the side stream, with an event
    the first step's main stream waits on, and the tensors are kept alive for the main stream."""
    fake = FakeCudaStreams()
    for name in ("Stream", "current_stream", "stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))

    def installer(host: PromptHostFeatures) -> PromptOnCuda:
        fake.log.append((threading.current_thread().name, "installer", fake.current_stream()))
        return PromptOnCuda(host.voice_id, fake.log)

    cache = VoiceCache(installer, device="cuda")
    lane = install_lane(torch.device("cuda"), asked=False)
    assert lane is not None and install_lane(torch.device("cpu"), asked=False) is None
    try:
        (built,) = lane.submit(cache.build_many, [features("zoe")]).result()
    finally:
        lane.shutdown()
    entry = cache.adopt(built)
    cache.wait_ready("zoe")
    cache.wait_ready("zoe")  # waited once: the event is dropped
    side = repr(cache._side_stream)
    assert [(thread.startswith("wavefarm-install-lane"), what.split()[0], repr(stream))
            for thread, what, stream in fake.log] == [
        (True, "installer", side), (True, "record", side),  # the work, then its event, on the side stream
        (True, "record_stream", "main"), (True, "record_stream", "main"),
        (False, "wait", "main")]  # the engine thread's main stream waits on that event
    assert fake.log[1][1].split()[1] == fake.log[-1][1].split()[1] and entry.ready_event is None
