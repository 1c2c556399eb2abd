"""Capacity 1, three voices in turn, through the real engine and tiny model: the least recently used
unpinned voice is evicted and its tensors are freed; two jobs of one voice install it once."""

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
