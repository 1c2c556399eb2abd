"""The engine with a fake decoder, a fake feature source and a fake clock: no model, Celery, Redis or DB."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.errors import BadTokens
from app.features import PromptHostFeatures
from gpu_worker.engine import PREP_PATHS, Engine, EngineConfig
from gpu_worker.streams import (
    Aborted,
    Audio,
    ChunkRow,
    EngineJob,
    Failed,
    Finished,
    VoiceEvicted,
    VoiceInstalled,
    VoiceReady,
    plan_chunks,
)
from gpu_worker.voices import VoiceCache

# -- fakes at the engine boundary ------------------------------------------------------------------


def features(voice_id: str) -> PromptHostFeatures:
    seed = sum(voice_id.encode())
    return PromptHostFeatures(voice_id=voice_id, logmel128=torch.full((128, 4), float(seed)),
                              fbank80=torch.zeros(4, 80), mel80=torch.zeros(2, 80))


@dataclass
class FakePrompt:
    voice_id: str
    level: float
    size: int = 1000

    def nbytes(self) -> int:
        return self.size

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(())


def install(host: PromptHostFeatures) -> FakePrompt:
    if host.voice_id.startswith("broken"):
        raise RuntimeError("corrupt features")
    return FakePrompt(host.voice_id, float(host.logmel128[0, 0]))


@dataclass
class FakeStream:
    voice: FakePrompt
    seed: int
    chunk: int = 0


class FakeDecoder:
    """Deterministic fake audio: each token becomes 10 samples of voice level + seed + token."""

    def __init__(self, poisoned_seeds: frozenset[int] = frozenset()) -> None:
        self.batches: list[list[tuple[int, int]]] = []  # (seed, chunk) per row
        self.poisoned = poisoned_seeds

    def open_stream(self, voice: FakePrompt, seed: int) -> FakeStream:
        return FakeStream(voice, seed)

    def step(self, rows: list[ChunkRow]) -> list[torch.Tensor]:
        if any(row.stream.seed in self.poisoned for row in rows):
            raise RuntimeError("NaN in the solve")
        self.batches.append([(row.stream.seed, row.stream.chunk) for row in rows])
        out = []
        for row in rows:
            out.append(expected_chunk(row.stream.voice.level, row.stream.seed, row.tokens))
            row.stream.chunk += 1
        return out


def expected_chunk(level: float, seed: int, tokens: torch.Tensor) -> torch.Tensor:
    return (level + seed + tokens.to(torch.float32)).repeat_interleave(10)


def expected_audio(voice_id: str, seed: int, tokens: list[int]) -> torch.Tensor:
    level = float(sum(voice_id.encode()))
    all_tokens = torch.tensor(tokens)
    parts = [expected_chunk(level, seed, all_tokens[c.start:c.stop]) for c in plan_chunks(len(tokens))]
    return torch.cat(parts)


class FakeStore:
    def __init__(self, *voice_ids: str) -> None:
        self.entries = {v: features(v) for v in voice_ids}
        self.error: Exception | None = None
        self.gets = 0

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        self.gets += 1
        if self.error is not None:
            raise self.error
        return self.entries.get(voice_id)


@dataclass
class FakePreparer:
    calls: list[str] = field(default_factory=list)
    fail: bool = False

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        self.calls.append(job.job_id)
        if self.fail:
            raise OSError("reference audio is gone")
        return features(job.voice_id)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    engine: Engine
    decoder: FakeDecoder
    store: FakeStore
    preparer: Any  # FakePreparer, or the test's own
    clock: FakeClock
    events: list = field(default_factory=list)

    def step(self, n: int = 1) -> list:
        new = []
        for _ in range(n):
            new += self.engine.step()
        self.events += new
        return new

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.engine.live_jobs() and not self.engine.wait_for_work(0):
                return
            self.step()
        raise AssertionError("engine did not drain")

    def audio(self, job_id: str) -> torch.Tensor:
        chunks = [e for e in self.events if isinstance(e, Audio) and e.job_id == job_id]
        assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
        return torch.cat([c.samples for c in chunks])

    def of(self, kind: type, job_id: str | None = None) -> list:
        return [e for e in self.events if isinstance(e, kind) and (job_id is None or e.job_id == job_id)]


def harness(*stored: str, micro_batch_size: int = 4, prep_wait_ms: float = 500, max_voices: int = 8,
            poisoned: frozenset[int] = frozenset(), installer=install, preparer: Any = None,
            prep_pool: Executor | None = None, install_lane: Executor | None = None,
            admission_window_ms: float = 0, install_batch: int = 1, batch_installer=None) -> Harness:
    clock = FakeClock()
    decoder = FakeDecoder(poisoned)
    store = FakeStore(*stored)
    preparer = preparer or FakePreparer()
    voices = VoiceCache(installer, device="cpu", max_voices=max_voices, batch_installer=batch_installer)
    config = EngineConfig(micro_batch_size=micro_batch_size, prep_wait_ms=prep_wait_ms,
                          admission_window_ms=admission_window_ms, install_batch=install_batch)
    engine = Engine(decoder, voices, features=store, preparer=preparer, config=config, clock=clock,
                    prep_pool=prep_pool, install_lane=install_lane)
    return Harness(engine, decoder, store, preparer, clock)


TOKENS = list(range(100, 180))  # 80 tokens: chunks of 28, 28, 30 (last)


def job(job_id: str, voice: str = "alice", seed: int = 1, tokens: list[int] | None = None, **kw) -> EngineJob:
    return EngineJob(job_id=job_id, voice_id=voice, tokens=tokens or TOKENS, seed=seed, **kw)


# -- streaming and batching ------------------------------------------------------------------------


def test_jobs_stream_every_chunk_in_order_and_finish() -> None:
    h = harness("alice", "bob")
    h.engine.add(job("j1", "alice", seed=1))
    h.engine.add(job("j2", "bob", seed=2, tokens=TOKENS[:20]))
    h.run()
    assert torch.equal(h.audio("j1"), expected_audio("alice", 1, TOKENS))
    assert torch.equal(h.audio("j2"), expected_audio("bob", 2, TOKENS[:20]))
    done = {e.job_id: e for e in h.of(Finished)}
    assert done.keys() == {"j1", "j2"}
    assert done["j1"].n_samples == h.audio("j1").numel()
    assert set(done["j1"].timings) >= {"prep_wait_s", "first_audio_s", "total_s"}
    assert h.engine.live_jobs() == []


def test_rows_of_different_jobs_share_a_step_up_to_micro_batch_size() -> None:
    h = harness("alice", micro_batch_size=2)
    for i in range(3):
        h.engine.add(job(f"j{i}", seed=i))
    h.run()
    assert max(len(b) for b in h.decoder.batches) == 2
    assert sum(len(b) for b in h.decoder.batches) == 3 * len(plan_chunks(len(TOKENS)))
    snap = h.engine.snapshot()
    assert snap["mel_frames"] == 3 * 2 * len(TOKENS) and snap["finished"] == 3 and snap["live_jobs"] == 0
    assert snap["prep_paths"]["prepared_ahead"] == 1 and snap["voices"] == 1


def test_first_chunk_joins_a_step_beside_continuing_rows() -> None:
    h = harness("alice", "bob")
    h.engine.add(job("old", "alice", seed=1))
    h.step()
    h.engine.add(job("new", "bob", seed=2))
    h.step()
    assert h.decoder.batches[1] == [(1, 1), (2, 0)]


def test_same_voice_is_installed_once_and_reused() -> None:
    h = harness("alice")
    h.engine.add(job("j1", seed=1))
    h.engine.add(job("j2", seed=2))
    h.run()
    assert len(h.of(VoiceInstalled)) == 1
    paths = {e.job_id: e.prep_path for e in h.of(VoiceReady)}
    assert paths == {"j1": "prepared_ahead", "j2": "already_installed"}
    h.engine.add(job("j3", seed=3))
    h.run()
    assert h.of(VoiceReady, "j3")[0].prep_path == "already_installed"
    assert h.store.gets == 1


def test_the_job_its_voice_was_installed_for_records_the_install_time() -> None:
    h = harness("alice", prep_wait_ms=0)
    h.engine.add(job("ahead", "alice", seed=1))
    h.engine.add(job("shared", "alice", seed=2))
    h.engine.add(job("inline", "carol", seed=3))
    h.run()
    done = {e.job_id: e.timings for e in h.of(Finished)}
    installs = {e.voice_id: e.install_s for e in h.of(VoiceInstalled)}
    assert done["ahead"]["install_s"] == installs["alice"] >= 0
    assert done["inline"]["install_s"] == installs["carol"]
    assert "install_s" not in done["shared"]  # found the voice installed


# -- admission window: a burst that arrives one by one starts in one step ----------------------------


def test_an_idle_engine_gathers_a_burst_into_one_first_step() -> None:
    h = harness("alice", "bob", admission_window_ms=300)
    h.engine.add(job("j1", "alice", seed=1))
    assert h.of(Audio) == [] and h.step() and h.of(Audio) == []  # ready, but waiting for company
    for n, voice in ((2, "bob"), (3, "alice")):
        h.clock.now += 0.05
        h.engine.add(job(f"j{n}", voice, seed=n))
        h.step()
        assert h.decoder.batches == []
    h.clock.now += 0.149  # 149 ms since the latest arrival: still inside half the window
    h.step()
    assert h.decoder.batches == []
    h.clock.now += 0.002
    h.step()
    assert h.decoder.batches == [[(1, 0), (2, 0), (3, 0)]]
    h.run()
    for n, voice in ((1, "alice"), (2, "bob"), (3, "alice")):
        assert torch.equal(h.audio(f"j{n}"), expected_audio(voice, n, TOKENS))
    assert all(len(b) == 3 for b in h.decoder.batches)  # the burst stays in step to the end


def test_the_gather_ends_at_the_window_however_often_jobs_keep_arriving() -> None:
    h = harness("alice", micro_batch_size=16, admission_window_ms=300)
    for n in range(1, 10):  # one every 62.5 ms: the quiet half window (150 ms) never comes
        h.engine.add(job(f"j{n}", seed=n))
        h.step()
        if h.decoder.batches:
            break
        h.clock.now += 0.0625
    assert [len(b) for b in h.decoder.batches] == [6]  # the 6th, at 312.5 ms, is past the window: all start
    assert h.clock.now == 100.3125


def test_a_full_batch_and_a_busy_engine_do_not_wait() -> None:
    h = harness("alice", micro_batch_size=2, admission_window_ms=300)
    h.engine.add(job("j1", seed=1))
    h.engine.add(job("j2", seed=2))
    h.step()
    assert h.decoder.batches == [[(1, 0), (2, 0)]]  # the batch is full: no reason to wait
    h2 = harness("alice", micro_batch_size=4, admission_window_ms=300)
    h2.engine.add(job("old", seed=1))
    h2.step()  # admitted now, alone: gathering
    h2.clock.now += 1.0
    h2.step()
    h2.engine.add(job("new", seed=2))
    h2.step()  # a stream is past its first chunk: the newcomer joins the next step as always
    assert h2.decoder.batches == [[(1, 0)], [(1, 1), (2, 0)]]


def test_the_idle_hint_sleeps_no_longer_than_the_gather_has_left() -> None:
    h = harness("alice", admission_window_ms=300)
    h.engine.add(job("j1", seed=1))
    h.step()
    assert h.engine.idle_hint_s() == pytest.approx(0.01)
    h.clock.now += 0.147
    assert h.engine.idle_hint_s() == pytest.approx(0.003)


# -- preparation paths ------------------------------------------------------------------------------


def test_missing_voice_waits_while_others_decode_then_installs_late() -> None:
    h = harness("alice")
    h.engine.add(job("running", "alice", seed=1))
    h.engine.add(job("waiting", "bob", seed=2))
    h.step(2)
    assert all(seed == 1 for batch in h.decoder.batches for seed, _ in batch)
    h.store.entries["bob"] = features("bob")
    h.clock.now += 0.1
    h.run()
    assert h.of(VoiceReady, "waiting")[0].prep_path == "late"
    assert h.engine.counters["late"] == 1
    assert h.preparer.calls == []
    assert torch.equal(h.audio("waiting"), expected_audio("bob", 2, TOKENS))


def test_wait_runs_out_then_prepares_inline() -> None:
    h = harness(prep_wait_ms=200)
    h.engine.add(job("j", "carol", seed=5))
    h.step()
    assert h.of(Audio) == [] and h.preparer.calls == []
    h.clock.now += 0.25
    h.run()
    assert h.preparer.calls == ["j"]
    assert h.of(Finished, "j")[0].prep_path == "inline"
    assert h.engine.counters["inline"] == 1
    # inline output equals what prepared-ahead features give, bit for bit
    assert torch.equal(h.audio("j"), expected_audio("carol", 5, TOKENS))


def test_queue_full_hint_prepares_inline_without_waiting() -> None:
    h = harness()
    h.engine.add(job("j", "dave", prep_hint="queue_full"))
    h.step()
    assert h.preparer.calls == ["j"]
    assert h.engine.counters["queue_full"] == 1
    assert len(h.of(Audio, "j")) == 1


def test_unreadable_store_counts_unavailable_and_prepares_inline() -> None:
    h = harness("alice")
    h.store.error = ConnectionError("redis is down")
    h.engine.add(job("j"))
    h.run()
    assert h.engine.counters["unavailable"] == 1
    assert h.of(Finished, "j")[0].prep_path == "unavailable"


def test_unusable_stored_features_count_failed_and_fall_back_inline() -> None:
    h = harness()
    h.store.entries["erin"] = features("broken")  # the store answers with another voice's features
    h.engine.add(job("j", "erin"))
    h.run()
    assert h.engine.counters["failed"] == 1
    assert h.preparer.calls == ["j"]
    assert h.of(Finished, "j")[0].prep_path == "failed"


def test_install_error_on_stored_features_falls_back_inline_then_fails_only_that_job() -> None:
    h = harness("broken-v", "alice")
    h.engine.add(job("bad", "broken-v", seed=1))
    h.engine.add(job("good", "alice", seed=2))
    h.run()
    failed = h.of(Failed, "bad")
    assert len(failed) == 1 and "bad" in failed[0].error and failed[0].prep_path == "failed"
    assert h.preparer.calls == ["bad"]
    assert torch.equal(h.audio("good"), expected_audio("alice", 2, TOKENS))


def test_inline_preparation_failure_fails_the_job_not_the_engine() -> None:
    h = harness("alice", prep_wait_ms=0)
    h.preparer.fail = True
    h.engine.add(job("doomed", "nobody", seed=1))
    h.engine.add(job("fine", "alice", seed=2))
    h.run()
    assert "reference audio is gone" in h.of(Failed, "doomed")[0].error
    assert h.of(Finished, "fine")
    assert h.engine.stats["failed"] == 1


def test_every_prep_path_has_a_counter() -> None:
    h = harness()
    assert set(h.engine.counters) == set(PREP_PATHS)


# -- the install lane: installs on a side thread (CPU) -----------------------------------------------


class GatedInstaller:
    """The fake installer behind a gate the test opens; NaN features fail as corrupt ones do."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.calls: list[str] = []
        self.threads: set[str] = set()

    def __call__(self, host: PromptHostFeatures) -> FakePrompt:
        self.calls.append(host.voice_id)
        self.threads.add(threading.current_thread().name)
        self.go.wait(10)
        if torch.isnan(host.logmel128).any():
            raise RuntimeError("corrupt features")
        return install(host)


def _until_called(gate: GatedInstaller, n: int) -> None:
    """Waits for the lane thread to reach the installer: a submitted install may not have begun yet."""
    deadline = time.monotonic() + 10
    while len(gate.calls) < n and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.fixture
def laned() -> Iterator[tuple[Harness, GatedInstaller]]:
    gate = GatedInstaller()
    lane = ThreadPoolExecutor(1, thread_name_prefix="lane")
    h = harness("alice", "zoe", installer=gate, install_lane=lane)
    yield h, gate
    gate.go.set()
    lane.shutdown(wait=True)


def test_rows_keep_decoding_while_a_stored_voice_installs_in_the_lane(laned) -> None:
    h, gate = laned
    gate.go.set()
    h.engine.add(job("running", "alice", seed=1))
    _steps_until(h, lambda: bool(h.of(VoiceReady, "running")))
    gate.go.clear()
    h.engine.add(job("new", "zoe", seed=2))
    h.engine.add(job("same-voice", "zoe", seed=3))
    h.step(3)
    assert h.of(Audio, "running") and not h.of(Audio, "new")  # decoding went on during the install
    _until_called(gate, 2)
    assert gate.calls == ["alice", "zoe"] and gate.threads == {"lane_0"}  # never the engine thread
    gate.go.set()
    _steps_until(h, lambda: len(h.of(Finished)) == 3)
    paths = {e.job_id: e.prep_path for e in h.of(VoiceReady)}
    assert paths == {"running": "prepared_ahead", "new": "prepared_ahead", "same-voice": "already_installed"}
    timings = {e.job_id: e.timings for e in h.of(Finished)}
    assert "install_s" in timings["new"] and "install_s" not in timings["same-voice"]
    assert [e.voice_id for e in h.of(VoiceInstalled)] == ["alice", "zoe"] and gate.calls == ["alice", "zoe"]
    for job_id, voice, seed in (("running", "alice", 1), ("new", "zoe", 2), ("same-voice", "zoe", 3)):
        assert torch.equal(h.audio(job_id), expected_audio(voice, seed, TOKENS))


def test_a_lane_install_whose_job_went_away_is_dropped_once_it_settles(laned) -> None:
    h, gate = laned
    h.engine.add(job("j", "zoe"))
    h.step()
    _until_called(gate, 1)
    assert h.engine.resolver.preparing and gate.calls == ["zoe"]
    h.engine.abort("j")
    h.step()
    assert h.engine.wait_for_work(0)  # the unsettled install keeps the loop polling
    gate.go.set()
    _steps_until(h, lambda: not h.engine.resolver.preparing)
    h.step()
    assert h.of(VoiceInstalled) == [] and "zoe" not in h.engine.voices
    assert h.engine.counters["abandoned"] == 1 and [e.job_id for e in h.of(Aborted)] == ["j"]


def test_corrupt_stored_features_in_the_lane_fall_back_to_inline_preparation(laned) -> None:
    h, gate = laned
    bad = features("zoe")
    bad.logmel128.fill_(float("nan"))
    h.store.entries["zoe"] = bad
    gate.go.set()
    h.engine.add(job("j", "zoe", seed=4))
    _steps_until(h, lambda: bool(h.of(Finished, "j")))
    assert h.of(VoiceReady, "j")[0].prep_path == "failed" and h.preparer.calls == ["j"]
    assert gate.calls == ["zoe", "zoe"]  # the stored features, then the inline ones, both in the lane
    assert torch.equal(h.audio("j"), expected_audio("zoe", 4, TOKENS))


def test_a_failed_inline_preparation_in_the_lane_fails_its_jobs_only(laned) -> None:
    h, gate = laned
    gate.go.set()
    h.preparer.fail = True
    h.engine.add(job("ok", "alice", seed=1))
    h.engine.add(job("lost", "nobody", seed=2))
    h.engine.add(job("lost-too", "nobody", seed=3))
    for _ in range(200):
        h.clock.now += 0.1  # past the prep wait: "nobody" is prepared inline, in the lane
        h.step()
        if len(h.of(Finished) + h.of(Failed)) == 3:
            break
        time.sleep(0.002)
    assert [e.job_id for e in h.of(Finished)] == ["ok"]
    assert sorted(e.job_id for e in h.of(Failed)) == ["lost", "lost-too"]
    assert "reference audio is gone" in h.of(Failed, "lost")[0].error and "nobody" not in h.engine.voices


# -- inline preparation in a pool ----------------------------------------------------------------------


class BlockingPreparer(FakePreparer):
    """Inline preparation that takes as long as the test says (released by `go`)."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        self.calls.append(job.job_id)
        self.go.wait(10)
        if self.fail:
            raise OSError("reference audio is gone")
        return features(job.voice_id)


@pytest.fixture
def pooled() -> Iterator[Harness]:
    pool = ThreadPoolExecutor(1)
    h = harness("alice", prep_wait_ms=0, preparer=BlockingPreparer(), prep_pool=pool)
    yield h
    h.preparer.go.set()
    pool.shutdown(wait=True)


def _steps_until(h: Harness, done, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not done() and time.monotonic() < deadline:
        h.step()
        time.sleep(0.005)
    assert done()


def test_rows_keep_decoding_while_a_voice_is_prepared_inline_in_the_pool(pooled: Harness) -> None:
    h = pooled
    h.engine.add(job("running", "alice", seed=1))
    h.engine.add(job("inline", "zoe", seed=2))
    h.engine.add(job("same-voice", "zoe", seed=3))
    h.step(2)
    assert h.of(Audio, "running") and not h.of(Audio, "inline")
    assert h.preparer.calls == ["inline"] and h.engine.idle_hint_s() > 0
    h.preparer.go.set()
    _steps_until(h, lambda: len(h.of(Finished)) == 3)
    paths = {e.job_id: e.prep_path for e in h.of(VoiceReady)}
    assert paths == {"running": "prepared_ahead", "inline": "inline", "same-voice": "already_installed"}
    assert h.preparer.calls == ["inline"]
    timings = {e.job_id: e.timings for e in h.of(Finished)}
    assert "install_s" in timings["inline"] and "install_s" not in timings["same-voice"]
    assert torch.equal(h.audio("inline"), expected_audio("zoe", 2, TOKENS))


def test_a_pool_preparation_whose_jobs_went_away_installs_nothing(pooled: Harness) -> None:
    h = pooled
    h.engine.add(job("j", "zoe"))
    h.step()
    h.engine.abort("j")
    h.step()
    h.preparer.go.set()
    _steps_until(h, lambda: not h.engine.resolver.preparing)
    h.step()
    assert h.of(VoiceInstalled) == [] and h.engine.counters["abandoned"] == 1


def test_a_failed_pool_preparation_fails_the_jobs_waiting_on_it(pooled: Harness) -> None:
    h = pooled
    h.preparer.fail = True
    h.engine.add(job("a", "zoe", seed=1))
    h.engine.add(job("b", "zoe", seed=2))
    h.preparer.go.set()
    _steps_until(h, lambda: len(h.of(Failed)) == 2)
    assert all("reference audio is gone" in e.error for e in h.of(Failed))


# -- failures, aborts, eviction ---------------------------------------------------------------------


def test_decode_error_in_one_row_fails_only_that_job() -> None:
    h = harness("alice", poisoned=frozenset({13}))
    h.engine.add(job("ok1", seed=1))
    h.engine.add(job("bad", seed=13))
    h.engine.add(job("ok2", seed=2))
    h.run()
    assert [e.job_id for e in h.of(Failed)] == ["bad"]
    assert torch.equal(h.audio("ok1"), expected_audio("alice", 1, TOKENS))
    assert torch.equal(h.audio("ok2"), expected_audio("alice", 2, TOKENS))
    assert h.engine.voices.get("alice").pins == 0


def test_abort_while_waiting_counts_abandoned_and_decodes_nothing() -> None:
    h = harness()
    h.engine.add(job("j", "frank"))
    h.step()
    h.engine.abort("j")
    h.step()
    assert h.of(Aborted, "j")[0].prep_path == "abandoned"
    assert h.engine.counters["abandoned"] == 1
    h.clock.now += 10
    h.step(3)
    assert h.of(Audio) == [] and h.preparer.calls == []
    assert h.engine.live_jobs() == []


def test_abort_while_running_frees_the_slot_and_the_pin() -> None:
    h = harness("alice", micro_batch_size=1)
    h.engine.add(job("a", seed=1))
    h.engine.add(job("b", seed=2))
    h.step()
    h.engine.abort("a")
    h.step(1)
    assert h.decoder.batches[-1] == [(2, 0)]
    assert h.engine.voices.get("alice").pins == 1
    h.run()
    assert "a" not in {e.job_id for e in h.of(Finished)}
    assert h.engine.voices.get("alice").pins == 0


def test_abort_before_first_chunk_reclaims_the_unused_install() -> None:
    h = harness("alice", "bob", micro_batch_size=1)
    h.engine.add(job("other", "bob", seed=1))
    h.step()
    h.engine.add(job("j", "alice", seed=2))
    h.step()  # alice is installed, but the only row went to "other"
    assert "alice" in h.engine.voices and h.decoder.batches == [[(1, 0)], [(1, 1)]]
    h.engine.abort("j")
    h.step()
    assert [e.voice_id for e in h.of(VoiceEvicted)] == ["alice"]
    assert "alice" not in h.engine.voices and "bob" in h.engine.voices


def test_abort_midway_reclaims_an_install_no_job_finished_with() -> None:
    h = harness("alice", "bob")
    h.engine.add(job("keep", "bob", seed=1, tokens=TOKENS[:10]))
    h.engine.add(job("cancelled", "alice", seed=2))
    h.step(2)
    assert h.of(Audio, "cancelled") and h.of(Finished, "keep")
    h.engine.abort("cancelled")
    h.step()
    assert [e.voice_id for e in h.of(VoiceEvicted)] == ["alice"]
    assert list(h.engine.voices) == ["bob"]


def test_abort_in_the_same_step_as_add_never_installs() -> None:
    h = harness("alice")
    h.engine.add(job("j"))
    h.engine.abort("j")
    h.step()
    assert h.of(VoiceInstalled) == [] and h.engine.counters["abandoned"] == 1


def test_abort_keeps_an_install_another_live_job_shares() -> None:
    h = harness("alice")
    h.engine.add(job("a", seed=1))
    h.engine.add(job("b", seed=2))
    h.engine.abort("a")
    h.run()
    assert h.of(VoiceEvicted) == []
    assert h.of(Finished, "b")


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


# -- the job boundary -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[], [1, 6561], [-1], [0.5, 2.0]])
def test_bad_tokens_are_refused_at_add(tokens: list) -> None:
    h = harness()
    with pytest.raises(BadTokens):
        h.engine.add(EngineJob(job_id="j", voice_id="v", tokens=tokens, seed=0))
    assert not h.engine.wait_for_work(0)


def test_a_job_id_cannot_be_added_twice_while_live() -> None:
    h = harness("alice")
    h.engine.add(job("j"))
    with pytest.raises(ValueError):
        h.engine.add(job("j"))
    h.run()
    h.engine.add(job("j"))  # fine again once released


def test_add_from_another_thread_wakes_the_engine() -> None:
    h = harness("alice")
    threading.Timer(0.05, lambda: h.engine.add(job("j"))).start()
    assert h.engine.wait_for_work(timeout=5)
    h.run()
    assert h.of(Finished, "j")


# -- the real decoder (tiny preset); the side-stream install path needs CUDA -------------------------


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
])
def test_engine_output_equals_the_decoder_alone_with_installs_beside_the_decode(device: str,
                                                                                monkeypatch) -> None:
    """On CUDA the installs run on a side stream that the first step of each job waits on; the audio
    must equal each job decoded alone with a plainly installed voice."""
    from gpu_worker.decoder import StreamingDecoder
    from gpu_worker.prompt import install_voice
    from tests.gpu_worker.test_decoder import FakeSpeaker, host_features, tiny_model

    torch.set_num_threads(1)
    if device == "cuda":  # TF32 convolutions would round batched and single rows differently
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = tiny_model()
    model.flow.to(device)
    model.hift.to(device)
    decoder = StreamingDecoder(model, device=device, dtype=torch.float32, micro_batch_size=4)
    speaker = FakeSpeaker()
    hosts = {f"{i:064x}": host_features(f"{i:064x}", seed=i) for i in range(2)}
    store = FakeStore()
    store.entries = dict(hosts)
    voices = VoiceCache(lambda host: install_voice(host, speaker=speaker, decoder=decoder), device=device)
    engine = Engine(decoder, voices, features=store, preparer=FakePreparer(),
                    config=EngineConfig(micro_batch_size=4, prep_wait_ms=0))
    jobs = [EngineJob(job_id=f"j{i}", voice_id=list(hosts)[i % 2], tokens=TOKENS[: 30 + 10 * i], seed=i)
            for i in range(3)]
    for j in jobs:
        engine.add(j)
    audio: dict[str, list[torch.Tensor]] = {j.job_id: [] for j in jobs}
    for _ in range(50):
        for event in engine.step():
            if isinstance(event, Audio):
                audio[event.job_id].append(event.samples)
        if not engine.live_jobs():
            break
    for j in jobs:
        plain = install_voice(hosts[j.voice_id], speaker=speaker, decoder=decoder)
        alone = decoder.decode_offline(plain, torch.tensor(j.tokens), j.seed).cpu()
        assert torch.allclose(torch.cat(audio[j.job_id]), alone, atol=1e-4, rtol=0)



# -- random workloads -------------------------------------------------------------------------------
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 80), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 15)),
    st.tuples(st.just("step")),
    st.tuples(st.just("tick"), st.integers(0, 300)),
), max_size=40)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, batch=st.integers(1, 4), max_voices=st.integers(1, 3),
       threads=st.sampled_from(["none", "prep pool", "install lane"]))
def test_every_job_ends_once_with_its_own_audio_and_nothing_stays_pinned(ops, batch, max_voices,
                                                                        threads) -> None:
    with ThreadPoolExecutor(1) as pool:
        h = harness(micro_batch_size=batch, prep_wait_ms=200, max_voices=max_voices,
                    prep_pool=pool if threads == "prep pool" else None,
                    install_lane=pool if threads == "install lane" else None)
        added = _run_ops(h, ops)
        _drain(h)
    _check_ends(h, added, max_voices)


def _drain(h: Harness) -> None:
    for _ in range(2000):
        if not h.engine.live_jobs() and not h.engine.wait_for_work(0):
            return
        h.clock.now += 0.05
        h.step()
        if h.engine.resolver.preparing:
            time.sleep(0.001)
    raise AssertionError("engine did not drain")


def _run_ops(h: Harness, ops) -> dict[str, tuple[str, int, list[int]]]:
    """Apply the ops; returns each added job's (voice, seed, tokens)."""
    added: dict[str, tuple[str, int, list[int]]] = {}
    for op in ops:
        if op[0] == "add":
            _, v, n, stored = op
            voice = f"voice{v}"
            if stored:
                h.store.entries[voice] = features(voice)
            job_id = f"j{len(added)}"
            added[job_id] = (voice, len(added), TOKENS[:n])
            h.engine.add(job(job_id, voice, seed=len(added) - 1, tokens=TOKENS[:n]))
        elif op[0] == "abort":
            h.engine.abort(f"j{op[1]}")
        elif op[0] == "step":
            h.step()
        else:
            h.clock.now += op[1] / 1000
    return added


def _check_ends(h: Harness, added: dict[str, tuple[str, int, list[int]]], max_voices: int) -> None:
    ends = [e for e in h.events if isinstance(e, Finished | Failed | Aborted)]
    assert sorted(e.job_id for e in ends) == sorted(added)
    for e in ends:
        if isinstance(e, Finished):
            voice, seed, tokens = added[e.job_id]
            assert torch.equal(h.audio(e.job_id), expected_audio(voice, seed, tokens))
    assert all(h.engine.voices.get(v).pins == 0 for v in h.engine.voices)
    assert len(h.engine.voices) <= max_voices
    ready = sum(1 for e in h.events if isinstance(e, VoiceReady))
    assert sum(h.engine.counters.values()) == ready + h.engine.counters["abandoned"]
