"""The GPU worker's side of text jobs: guide speech framed for the store, the tokenizer lane (requests from
many threads in shared forwards, each segment's tokens its own, a bad request failing alone) and
`tokenize_text_job` (speech missing, refused, stored once). Real Redis and databases."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save
from sqlalchemy import update

from app.audio import resample
from app.context import Context
from app.db import queries
from app.db.models import Job, JobStatus
from app.s3 import StandInTokenizer
from app.submission.jobs import submit_job
from app.submission.request import JobRequest
from app.text.guide_speech import GuideSpeech, length_at_16k, token_count
from gpu_worker.worker.guide import TokenizeLane, length_groups, tokenize_text_job
from tests.support.audio import wav_bytes


def _speech(*seconds: float, seed: int = 0) -> GuideSpeech:
    rng = np.random.default_rng(seed)
    waves = [(0.2 * np.sin(np.arange(int(s * 16000)) * 0.05 * (i + 1))
              + 0.01 * rng.standard_normal(int(s * 16000))).astype(np.float32) for i, s in enumerate(seconds)]
    return GuideSpeech.from_waves(waves)


class Recording:
    """The stand-in, counting its forwards; the first waits for `release`, so requests pile up."""

    def __init__(self) -> None:
        self.inner, self.sizes = StandInTokenizer(), list[int]()
        self.release, self.entered = threading.Event(), threading.Event()

    def __call__(self, logmel: torch.Tensor) -> torch.Tensor:
        return self.inner(logmel)

    def batch(self, logmels):
        self.entered.set()
        self.release.wait(timeout=30)
        self.sizes.append(len(logmels))
        return self.inner.batch(logmels)


def test_guide_speech_round_trips_through_its_frame_and_knows_its_token_counts():
    speech = _speech(1.0, 0.3, 2.25)
    back = GuideSpeech.decode(speech.encode(), max_tokens=1000)
    assert all(np.array_equal(a, b) for a, b in zip(back.segments, speech.segments, strict=True))
    counts = [t.numel() for t in StandInTokenizer().batch(speech.logmels())]
    assert speech.token_counts() == counts == [25, 8, 57] and token_count(16159) == 25


@pytest.mark.parametrize(("data", "says"), [
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{}", "expected int16"),
    (b"garbage!", "header length"),
])
def test_guide_speech_refuses_what_is_not_guide_speech(data, says):
    with pytest.raises(ValueError, match=says):
        GuideSpeech.decode(data, max_tokens=1000)


def test_guide_speech_refuses_speech_over_the_limit():
    with pytest.raises(ValueError, match="over the limit of 40 tokens"):
        GuideSpeech.decode(_speech(1.0, 1.0).encode(), max_tokens=40)


def test_speech_stored_at_the_guide_voices_rate_is_resampled_to_16k_and_its_token_counts_known_before():
    rng = np.random.default_rng(5)
    pcm = [(3000 * rng.standard_normal(n)).astype(np.int16) for n in (22_050, 7_001, 50_000)]
    speech = GuideSpeech(pcm, 22_050)
    back = GuideSpeech.decode(speech.encode(), max_tokens=1000)
    assert back.rate == 22_050 and all(np.array_equal(a, b) for a, b in zip(back.segments, pcm, strict=True))
    waves = back.waves16k()
    assert all(torch.equal(w, resample(p.astype(np.float32) / 32768.0, 22_050, 16_000))
               for w, p in zip(waves, pcm, strict=True))
    counts = [t.numel() for t in StandInTokenizer().batch(back.logmels())]
    assert back.token_counts() == counts == [token_count(w.numel()) for w in waves] == [25, 8, 57]


@pytest.mark.parametrize("rate", [8_000, 22_050, 24_000, 44_100, 48_000])
def test_the_16k_length_is_the_resamplers_for_every_length(rate):
    rng = np.random.default_rng(rate)
    for n in [1, 2, 3, 440, 441, 442, 22_049, 22_050, 22_051, *rng.integers(1, 200_000, 40).tolist()]:
        assert length_at_16k(n, rate) == resample(np.zeros(n, np.float32), rate, 16_000).numel(), (n, rate)


def test_speech_written_before_its_rate_was_stored_is_16k_and_a_bad_rate_is_refused():
    old = _speech(1.0)
    data = st_save({"pcm": torch.from_numpy(old.segments[0]), "lengths": torch.tensor([16_000])})
    assert GuideSpeech.decode(data, max_tokens=1000).rate == 16_000
    for rate in ([4_000], [96_000], [47_999], [16_000, 16_000]):  # 47,999 Hz: a kernel of gigabytes
        bad = st_save({"pcm": torch.from_numpy(old.segments[0]), "lengths": torch.tensor([16_000]),
                       "rate": torch.tensor(rate)})
        with pytest.raises(ValueError, match="rate"):
            GuideSpeech.decode(bad, max_tokens=1000)
    with pytest.raises(ValueError, match="too short to tokenize"):  # 440 samples at 22.05 kHz: 320 at 16 kHz
        GuideSpeech([np.zeros(440, np.int16)], 22_050)


def test_length_groups_bound_the_padded_size_and_keep_every_segment_once():
    frames = [300, 20, 900, 50, 3000, 40, 310]
    groups = length_groups(frames, max_frames=1000)
    assert sorted(i for g in groups for i in g) == list(range(len(frames)))
    assert all(len(g) * max(frames[i] for i in g) <= 1000 or len(g) == 1 for g in groups)
    assert [4] in groups and len(groups) < len(frames)  # the long one alone; short ones share


def test_requests_waiting_for_a_forward_share_the_next_one_and_get_their_own_tokens():
    tokenizer = Recording()
    lane = TokenizeLane(tokenizer)
    speeches = [_speech(1.0, seed=0), _speech(0.5, 1.5, seed=1), _speech(0.7, seed=2),
                _speech(2.0, 0.2, seed=3)]
    results: dict[int, list[list[int]]] = {}

    def ask(i: int) -> None:
        results[i] = lane.tokenize(speeches[i].logmels())

    try:
        first = threading.Thread(target=ask, args=(0,))
        first.start()
        assert tokenizer.entered.wait(timeout=30)  # the first forward holds; three more requests wait
        others = [threading.Thread(target=ask, args=(i,)) for i in (1, 2, 3)]
        for t in others:
            t.start()
        while lane._queue.qsize() < 3:
            threading.Event().wait(0.01)
        tokenizer.release.set()
        for t in [first, *others]:
            t.join(timeout=30)
    finally:
        lane.close()
    assert tokenizer.sizes == [1, 5]  # five segments of three requests in one forward
    alone = StandInTokenizer()
    for i, speech in enumerate(speeches):
        assert results[i] == [alone(mel)[0].tolist() for mel in speech.logmels()]
    assert lane.stats["segments"] == 6 and lane.stats["requests"] == 4 and lane.busy_s > 0


def test_a_request_the_tokenizer_refuses_fails_alone():
    lane = TokenizeLane(StandInTokenizer())
    try:
        with pytest.raises(ValueError, match="log-mel"):
            lane.tokenize([torch.zeros(80, 10)])
        mels = _speech(0.5).logmels()
        assert lane.tokenize(mels) == [StandInTokenizer()(mels[0])[0].tolist()]
    finally:
        lane.close()


def _text_job(ctx: Context) -> str:
    with ctx.sessions() as session:
        return submit_job(ctx=ctx, session=session,
                          request=JobRequest(reference_bytes=wav_bytes(), text="Hello there."))


def test_tokenize_text_job_without_speech_leaves_the_job_to_job_tokenize(ctx: Context):
    job_id = _text_job(ctx)
    lane = TokenizeLane(StandInTokenizer())
    try:
        assert tokenize_text_job(ctx, lane, job_id) == "missing"
        assert tokenize_text_job(ctx, lane, str(uuid.uuid4())) == "ready"  # no such job: the claim says so
    finally:
        lane.close()
    with ctx.sessions() as session:
        assert queries.require_job(session=session, job_id=job_id).n_tokens == 0


def test_tokenize_text_job_fails_the_job_on_unusable_speech_and_drops_a_cancelled_ones(ctx: Context):
    bad, cancelled = _text_job(ctx), _text_job(ctx)
    ctx.store.put_guide_speech(bad, _speech(4.0).encode())  # over a limit of 50 tokens
    ctx.store.put_guide_speech(cancelled, _speech(1.0).encode())
    ctx.settings = ctx.settings.model_copy(update={"max_tokens": 50})
    with ctx.sessions() as session:
        session.execute(update(Job).where(Job.id == cancelled).values(status=JobStatus.CANCELLED))
        session.commit()
    lane = TokenizeLane(StandInTokenizer())
    try:
        assert tokenize_text_job(ctx, lane, bad) == "failed"
        assert tokenize_text_job(ctx, lane, cancelled) == "stopped"
    finally:
        lane.close()
    with ctx.sessions() as session:
        row = queries.require_job(session=session, job_id=bad)
        assert row.status == JobStatus.FAILED and "over the limit of 50 tokens" in (row.error or "")
    assert not ctx.store.has_guide_speech(bad) and not ctx.store.has_guide_speech(cancelled)
    assert lane.stats["segments"] == 0
