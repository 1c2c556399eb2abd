"""The installed-voice cache (`gpu_worker.voices`): least recently used unpinned voices are evicted over
capacity, pinned ones never; through the engine with fakes, and with capacity 1, three voices in turn,
through the real engine and tiny model (the evicted voice's tensors are freed; two jobs of one voice
install it once)."""

from __future__ import annotations

import gc
import weakref
from functools import partial

import numpy as np
import torch

from app.audio import normalise_reference
from app.features import PromptHostFeatures, host_half
from gpu_worker.decoder import StreamingDecoder
from gpu_worker.engine import Engine, EngineConfig
from gpu_worker.loading import load_dummy
from gpu_worker.model.config import ModelArgs
from gpu_worker.prompt import StandInSpeaker, install_voice
from gpu_worker.streams import EngineJob, Finished, VoiceEvicted, VoiceInstalled
from gpu_worker.voices import VoiceCache
from tests.support.fakes import (
    TOKENS,
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
