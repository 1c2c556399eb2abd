"""The engine with the fakes at its boundary (`tests.support.fakes`: decoder, feature source, clock): no
model, Celery, Redis or database. Streaming and batching, the admission window, failures and aborts, the
job boundary, and random workloads; one check against the real tiny decoder."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from app.errors import BadTokens
from gpu_worker.engine.core import Engine, EngineConfig
from gpu_worker.engine.streams import (
    Aborted,
    Audio,
    EngineJob,
    Failed,
    Finished,
    VoiceEvicted,
    VoiceInstalled,
    VoiceReady,
    plan_chunks,
)
from gpu_worker.voices.cache import VoiceCache
from tests.support.fakes import (
    TOKENS,
    FakePreparer,
    FakeStore,
    Harness,
    expected_audio,
    features,
    harness,
    job,
)


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
    assert sorted(h.decoder.closed) == [1, 2, 13]  # every stream's lane back, the failed one's too


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
    assert h.decoder.closed == [1]  # the aborted stream gave its lane back at once
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


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
])
def test_engine_output_equals_the_decoder_alone_with_installs_beside_the_decode(device: str,
                                                                                monkeypatch) -> None:
    """On CUDA the installs run on a side stream that the first step of each job waits on; the audio
    must equal each job decoded alone with a plainly installed voice."""
    from gpu_worker.engine.decoder import StreamingDecoder
    from gpu_worker.voices.prompt import install_voice
    from tests.support.fakes import FakeSpeaker, host_features, tiny_model

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
        engine.fetch_features()
        for event in engine.step():
            if isinstance(event, Audio):
                audio[event.job_id].append(event.samples)
        if not engine.live_jobs():
            break
    for j in jobs:
        plain = install_voice(hosts[j.voice_id], speaker=speaker, decoder=decoder)
        alone = decoder.decode_offline(plain, torch.tensor(j.tokens), j.seed).cpu()
        assert torch.allclose(torch.cat(audio[j.job_id]), alone, atol=1e-4, rtol=0)


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
