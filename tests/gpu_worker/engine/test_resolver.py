"""How a waiting job's voice becomes ready (`gpu_worker.engine.resolver`), through the engine with fakes at
its
boundary: every prep path and its counter, the CPU install lane, inline preparation in a pool, batched
installs (the real batched device half is tested in `test_prompt.py`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from app.voices.features import PromptHostFeatures
from gpu_worker.engine.core import PREP_PATHS
from gpu_worker.engine.streams import (
    Aborted,
    Audio,
    EngineJob,
    Failed,
    Finished,
    VoiceInstalled,
    VoiceReady,
)
from tests.support.fakes import (
    TOKENS,
    FakePreparer,
    FakePrompt,
    Harness,
    expected_audio,
    features,
    harness,
    install,
    job,
)


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


# -- batched installs: the stored voices one pump finds share a setup solve (install_batch > 1) --------

class CountingInstaller:
    """The installer and the batch installer of a VoiceCache, recording which voices each call got."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def one(self, host):
        self.calls.append([host.voice_id])
        return install(host)

    def many(self, hosts):
        self.calls.append([h.voice_id for h in hosts])
        if any(h.voice_id.startswith("broken") for h in hosts):
            raise RuntimeError("corrupt features in the batch")
        return [install(h) for h in hosts]


def batched_harness(*stored: str, install_batch: int = 2, lane: ThreadPoolExecutor | None = None):
    counting = CountingInstaller()
    h = harness(*stored, installer=counting.one, batch_installer=counting.many, install_batch=install_batch,
                install_lane=lane)
    return h, counting


def test_voices_found_in_one_pump_share_setup_solves_up_to_the_batch_size() -> None:
    h, counting = batched_harness("alice", "bob", "carol", install_batch=2)
    for i, voice in enumerate(("alice", "bob", "carol", "alice")):
        h.engine.add(job(f"j{i}", voice, seed=i))
    h.step()
    assert counting.calls == [["alice", "bob"], ["carol"]]
    paths = {e.job_id: e.prep_path for e in h.of(VoiceReady)}
    assert paths == {"j0": "prepared_ahead", "j1": "prepared_ahead", "j2": "prepared_ahead",
                     "j3": "already_installed"}  # every job started in the pump that found its voice
    assert len(h.decoder.batches[0]) == 4
    h.run()
    for i, voice in enumerate(("alice", "bob", "carol", "alice")):
        assert torch.equal(h.audio(f"j{i}"), expected_audio(voice, i, TOKENS))
    assert sorted(e.voice_id for e in h.of(VoiceInstalled)) == ["alice", "bob", "carol"]
    timings = {e.job_id: e.timings for e in h.of(Finished)}
    assert "install_s" in timings["j0"] and "install_s" in timings["j1"] and "install_s" not in timings["j3"]


def test_without_batching_each_voice_has_its_own_install() -> None:
    h, counting = batched_harness("alice", "bob", install_batch=1)
    h.engine.add(job("a", "alice"))
    h.engine.add(job("b", "bob", seed=2))
    h.step()
    assert counting.calls == [["alice"], ["bob"]]
    assert {e.job_id for e in h.of(VoiceReady)} == {"a", "b"}


def test_a_batch_with_bad_features_installs_the_good_voice_and_prepares_the_bad_one_inline() -> None:
    h, counting = batched_harness("alice", "broken-v", install_batch=4)
    h.engine.add(job("good", "alice", seed=1))
    h.engine.add(job("bad", "broken-v", seed=2))
    h.engine.add(job("good2", "alice", seed=3))
    h.run()
    assert counting.calls[0] == ["alice", "broken-v"]  # the batch failed: then one by one
    assert ["alice"] in counting.calls[1:] and ["broken-v"] in counting.calls[1:]
    assert h.preparer.calls == ["bad"]
    assert h.of(Failed, "bad") and h.of(Failed, "bad")[0].prep_path == "failed"  # inline: broken too
    assert torch.equal(h.audio("good"), expected_audio("alice", 1, TOKENS))
    assert torch.equal(h.audio("good2"), expected_audio("alice", 3, TOKENS))
    assert {e.job_id: e.prep_path for e in h.of(VoiceReady)} == {"good": "prepared_ahead",
                                                                  "good2": "already_installed"}


def test_a_job_aborted_in_the_pump_that_found_its_voice_leaves_the_others_of_the_batch_running() -> None:
    h, counting = batched_harness("alice", "bob")
    h.engine.add(job("a", "alice"))
    h.engine.add(job("b", "bob", seed=2))
    h.engine.abort("a")  # applied before the voices are resolved: alice is never fetched
    h.run()
    assert counting.calls == [["bob"]]
    assert torch.equal(h.audio("b"), expected_audio("bob", 2, TOKENS))


@pytest.mark.parametrize("bad", [False, True])
def test_a_worker_with_an_install_lane_batches_its_installs_there(bad: bool) -> None:
    """A CUDA worker always has the lane (`voices.install_lane`): its batched installs are built there as
    one batched setup solve per group, a bad voice of a group falling back alone, as in the engine thread."""
    second = "broken-v" if bad else "bob"
    with ThreadPoolExecutor(1, thread_name_prefix="lane") as lane:
        h, counting = batched_harness("alice", second, "carol", install_batch=2, lane=lane)
        for i, voice in enumerate(("alice", second, "carol")):
            h.engine.add(job(f"j{i}", voice, seed=i))
        _steps_until(h, lambda: len(h.of(Finished)) + len(h.of(Failed)) == 3)
    if bad:  # the group failed: then each voice alone; broken-v prepared inline (broken too), in the lane
        assert counting.calls == [["alice", "broken-v"], ["alice"], ["broken-v"], ["carol"], ["broken-v"]]
        assert h.preparer.calls == ["j1"] and h.of(Failed, "j1")[0].prep_path == "failed"
    else:
        assert counting.calls == [["alice", "bob"], ["carol"]]
    assert {e.job_id: e.prep_path for e in h.of(VoiceReady)} == {
        f"j{i}": "prepared_ahead" for i in range(3) if not (bad and i == 1)}
    for i, voice in enumerate(("alice", second, "carol")):
        if not (bad and i == 1):
            assert torch.equal(h.audio(f"j{i}"), expected_audio(voice, i, TOKENS))
