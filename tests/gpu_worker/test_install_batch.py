"""Batched installs (`install_batch` > 1): the voices whose stored features one engine pump finds share
a setup solve. The engine with fakes at its boundary (`test_engine`'s harness); the real batched device
half is tested in `test_prompt.py`."""

from __future__ import annotations

import torch

from gpu_worker.streams import Failed, Finished, VoiceInstalled, VoiceReady
from tests.gpu_worker.test_engine import TOKENS, expected_audio, harness, install, job


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


def batched_harness(*stored: str, install_batch: int = 2):
    counting = CountingInstaller()
    h = harness(*stored, installer=counting.one, batch_installer=counting.many, install_batch=install_batch)
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
