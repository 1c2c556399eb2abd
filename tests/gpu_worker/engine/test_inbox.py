"""The engine's input side (`gpu_worker.engine.inbox`, `Engine.fetch_features`): the feature store is read
before a step, never inside it, and its answers reach the step as events; one read per voice that a
queued or waiting job needs, none for a voice installed, being prepared, hinted inline or aborted."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.voices.features import PromptHostFeatures
from gpu_worker.engine.inbox import FeaturesArrived, Inbox, read_features
from gpu_worker.engine.streams import Finished, VoiceReady
from tests.support.fakes import FakeStore, Harness, features, harness, job


class WatchedStore(FakeStore):
    """A store that notes every read, and which of them came while the engine was stepping."""

    def __init__(self, *voice_ids: str) -> None:
        super().__init__(*voice_ids)
        self.stepping = False
        self.reads: list[str] = []
        self.in_step: list[str] = []

    def get(self, voice_id: str) -> PromptHostFeatures | None:
        self.reads.append(voice_id)
        if self.stepping:
            self.in_step.append(voice_id)
        return super().get(voice_id)


def watched(h: Harness, store: WatchedStore) -> Harness:
    """`h` over `store`, its engine's step flagged on the store while it runs."""
    h.engine.features = h.store = store
    step = h.engine.step

    def flagged() -> list:
        store.stepping = True
        try:
            return step()
        finally:
            store.stepping = False

    h.engine.step = flagged  # type: ignore[method-assign]
    return h


def drain(h: Harness) -> None:
    """Step until no job is queued or live and nothing is being prepared (a pool's preparation takes real
    time)."""
    for _ in range(5000):
        if not h.engine.wait_for_work(0):
            return
        h.step()
        time.sleep(0.001)
    raise AssertionError("engine did not drain")


@pytest.mark.parametrize(("install_batch", "pooled"), [(1, False), (2, False), (1, True)])
def test_a_step_reads_no_feature_store_the_input_side_does(install_batch: int, pooled: bool) -> None:
    """Every way a voice becomes ready (ahead, late, inline after the wait, unreadable store) with the
    store read only outside `step()`."""
    with ThreadPoolExecutor(1) as pool:
        engine = harness(prep_wait_ms=200, install_batch=install_batch, prep_pool=pool if pooled else None)
        h = watched(engine, store := WatchedStore("alice"))
        h.engine.add(job("ahead", "alice", seed=1))
        h.engine.add(job("late", "bob", seed=2))
        h.engine.add(job("inline", "carol", seed=3))
        h.step(2)
        store.entries["bob"] = features("bob")
        h.step()
        h.clock.now += 0.25  # carol's wait runs out
        drain(h)
        h.engine.add(job("down", "dave", seed=4))
        store.error = ConnectionError("redis is down")
        drain(h)
    paths = {e.job_id: e.prep_path for e in h.of(Finished)}
    assert paths == {"ahead": "prepared_ahead", "late": "late", "inline": "inline", "down": "unavailable"}
    assert {"alice", "bob", "carol", "dave"} <= set(store.reads) and store.in_step == []


def test_the_stores_answer_arrives_as_an_event_and_a_step_without_one_waits() -> None:
    h = harness("alice", prep_wait_ms=0)
    h.engine.add(job("j", "alice", seed=1))
    h.events += h.engine.step()  # no answer yet: the job waits, past its wait too, for its first one
    h.clock.now += 1.0
    h.events += h.engine.step()
    assert h.store.gets == 0 and h.of(VoiceReady) == [] and h.engine.live_jobs() == ["j"]
    h.run()
    assert h.store.gets == 1 and h.of(Finished, "j")[0].prep_path == "prepared_ahead"


def test_one_read_per_voice_needed_and_none_for_installed_hinted_or_aborted_jobs() -> None:
    h = watched(harness(), store := WatchedStore("alice", "erin"))
    h.engine.add(job("a1", "alice", seed=1))
    h.engine.add(job("a2", "alice", seed=2))
    h.engine.add(job("hinted", "bob", seed=3, prep_hint="queue_full"))
    h.engine.add(job("gone", "carol", seed=4))
    h.engine.abort("gone")
    h.step()
    assert store.reads == ["alice"]
    h.engine.add(job("again", "alice", seed=5))  # installed now: nothing to read
    h.engine.add(job("other", "erin", seed=6))
    h.step()
    assert store.reads == ["alice", "erin"] and store.in_step == []


def test_the_inbox_keeps_the_latest_answer_per_voice_until_drained() -> None:
    inbox = Inbox()
    inbox.arrived(FeaturesArrived("alice", None))
    inbox.arrived(FeaturesArrived("alice", features("alice")))
    inbox.arrived(FeaturesArrived("bob", ConnectionError("down")))
    drained = inbox.drain()
    assert isinstance(drained.features["alice"], PromptHostFeatures)
    assert isinstance(drained.features["bob"], ConnectionError)
    assert inbox.drain().features == {}


def test_a_read_that_fails_or_returns_another_voice_is_an_answer_not_an_error() -> None:
    store = FakeStore("alice")
    assert read_features(store, "alice") == store.entries["alice"] and read_features(store, "bob") is None
    store.entries["bob"] = store.entries["alice"]
    assert isinstance(read_features(store, "bob"), ValueError)
    store.error = ConnectionError("redis is down")
    assert isinstance(read_features(store, "alice"), ConnectionError)

