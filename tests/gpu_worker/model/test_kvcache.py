"""The lean estimator cache (`gpu_worker.model.kvcache`): the reference's frames, no copies, no writes.

Bookkeeping tests run `BatchKV` with a stand-in DiT that writes a unique id into every new frame, and
follow the reference's tensors (cat new frames in front, trim to [:prompt_len] + [-tail:]) beside it, so
"same frames" is checked bit for bit. Flow tests run the tiny flow for 20 chunks per stream.
"""

from __future__ import annotations

import pytest
import torch

from gpu_worker.model.config import ATT_CACHE_TAIL
from gpu_worker.model.flow import CHUNK_FRAMES, FlowCache, trim_cache
from gpu_worker.model.kvcache import BatchKV, EstimatorKV, Workspace
from tests.gpu_worker.model.ref_oracle import make_prompt, random_tokens, seeded_noise, split_chunks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

STEPS, DEPTH, HEADS, HEAD_DIM = 2, 1, 1, 1


def _frames(ids: list[int]) -> torch.Tensor:
    """Reference-layout frames whose every value encodes (frame id, step): [STEPS, DEPTH, 2, H, L, 2 D]."""
    x = torch.tensor(ids, dtype=torch.float64)[None, None, None, None, :, None]
    step = torch.arange(STEPS, dtype=torch.float64)[:, None, None, None, None, None]
    return (x + 0.5 * step).expand(STEPS, DEPTH, 2, HEADS, len(ids), 2 * HEAD_DIM).clone()


def _trim(ref: torch.Tensor, head: int, tail: int) -> torch.Tensor:
    if ref.size(4) <= head + tail:
        return ref
    return torch.cat([ref[..., :head, :], ref[..., -tail:, :]], dim=4)


class FakeStream:
    """One stream kept both ways: the lean cache and the reference's tensor."""

    def __init__(self, prompt_len: int, chunk_sizes: list[int], first_id: int) -> None:
        self.prompt_len, self.chunk_sizes, self.next_id = prompt_len, chunk_sizes, first_id
        shared = _frames(list(range(first_id, first_id + prompt_len)))
        self.next_id += prompt_len
        self.kv, self.ref, self.shared = EstimatorKV.of(shared), shared, shared

    def new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids


def _poison(workspace: Workspace, like: torch.Tensor) -> None:
    """What earlier solves leave in a workspace, at its worst: every value NaN."""
    workspace.take((workspace.nbytes // like.element_size(),), like).fill_(float("nan"))


def _shared_seen(batch: BatchKV, step: int, t: int, b: int) -> dict[int, torch.Tensor]:
    """Row -> the voice frames it attends to in place at `step` ([depth, 2, H, live, 2 D]): its voice's
    frames, picked by its mask (the same for each of its T queries)."""
    seen = {}
    for rows, frames, mask in batch.voice(step):
        if rows is None:  # every row, in order
            rows = torch.cat([torch.arange(b), torch.arange(b) + b])
        n = rows.numel() // 2
        assert torch.equal(rows[n:], rows[:n] + b)  # the unconditional twins follow
        per_row = mask.view(n, t, -1)
        assert torch.equal(per_row, per_row[:, :1].expand_as(per_row))
        for j, i in enumerate(rows[:n].tolist()):
            seen[i] = frames[..., per_row[j, 0], :]
    return seen


def _solve(streams: list[FakeStream], sizes: list[int], tail: int, chunk_frames: int,
           workspace: Workspace | None = None, copy_shared: bool = False) -> None:
    """One stand-in solve over `streams`: checks the frames each row attends to, then trims."""
    rows = [s.kv for s in streams]
    like = torch.zeros(1, dtype=torch.float64)
    if workspace is not None and workspace.nbytes:
        _poison(workspace, like)
    batch = BatchKV(rows, sizes, like, steps=STEPS, depth=DEPTH, heads=HEADS,
                    head_dim=HEAD_DIM, tail=tail, chunk_frames=chunk_frames, workspace=workspace,
                    copy_shared=copy_shared)
    new = [_frames(s.new_ids(n)) for s, n in zip(streams, sizes, strict=True)]
    t, b = max(sizes), len(streams)
    for step in range(STEPS):
        kv = batch.kv(step)
        shared = _shared_seen(batch, step, t, b)
        for i, (s, alive) in enumerate(zip(streams, batch.n_alive, strict=True)):
            own = kv[:, i :: b, :, t : t + alive]
            attended = torch.cat([own, shared.get(i, own[..., :0, :])], dim=3)
            assert sorted(attended.flatten().tolist()) == sorted(s.ref[step].flatten().tolist())
            assert not kv[:, i :: b, :, t + alive :].any()  # padding keys are finite (zeros)
            kv[:, i :: b, :, :t] = 0.0  # the DiT writes every new-frame slot, padding rows' too
            kv[:, i :: b, :, : sizes[i]] = new[i][step]
        batch.keep(step, kv)
    for s, result, frames in zip(streams, batch.results(), new, strict=True):
        s.kv = result.trimmed(s.prompt_len, tail)
        s.ref = _trim(torch.cat([frames, s.ref], dim=4), s.prompt_len, tail)


@pytest.mark.parametrize("copy_shared", [False, True], ids=["voice frames in place", "voice frames copied"])
@pytest.mark.parametrize("reused", [False, True], ids=["fresh buffer", "poisoned workspace"])
@pytest.mark.parametrize(("prompt_lens", "tail", "chunk_frames"), [
    ((30, 24, 40), 10, 6),  # prompt >= tail (the production regime: 300 and 100)
    ((4, 9, 12), 10, 6),  # prompt < tail: generated frames in the tail too, buffers grow
])
def test_trimming_keeps_exactly_the_reference_frames_over_many_chunks(prompt_lens, tail, chunk_frames,
                                                                      reused, copy_shared):
    gen = torch.Generator().manual_seed(0)
    sizes = [torch.randint(1, chunk_frames + 3, (14,), generator=gen).tolist() for _ in prompt_lens]
    streams = [FakeStream(p, sizes[i], 1000 * (i + 1)) for i, p in enumerate(prompt_lens)]
    workspace = Workspace() if reused else None
    for chunk in range(14):
        live = [s for i, s in enumerate(streams) if chunk >= i]  # staggered starts: mixed cache lengths
        _solve(live, [s.chunk_sizes[chunk] for s in live], tail, chunk_frames, workspace, copy_shared)
        for s in live:
            assert torch.equal(s.kv.reference_layout(), s.ref)
            assert len(s.kv) == s.ref.size(4)
    for s in streams:
        assert torch.equal(s.shared, _frames(list(range(s.shared[0, 0, 0, 0, 0, 0].long().item(),
                                                        s.shared[0, 0, 0, 0, -1, 0].long().item() + 1))))


def test_steady_state_trims_without_new_buffers_and_keeps_the_prompt_shared():
    stream = FakeStream(30, [6] * 20, 1000)
    for _ in range(20):
        _solve([stream], [6], tail=10, chunk_frames=6)
        assert stream.kv.shared is stream.shared
    buffer = stream.kv.own
    for _ in range(5):
        _solve([stream], [6], tail=10, chunk_frames=6)
        assert stream.kv.own is buffer and buffer.capacity == 30 + 6  # max(prompt, tail) + chunk frames
    assert torch.equal(stream.kv.reference_layout(), stream.ref)


# -- the flow: tiny model, many chunks -------------------------------------------------------------


def _voice(flow, n_tokens: int, seed: int):
    prompt = make_prompt(n_tokens, seed=seed)
    with torch.inference_mode():
        spk, cache = flow.setup(prompt.setup_tokens, prompt.mel, prompt.spk, seeded_noise(flow.args, seed))
    return prompt.n_frames, spk, cache


@torch.inference_mode()
def _chunk(flow, spk, caches, chunks, noise):
    return flow.stream_chunks([c for c, _ in chunks], spk, caches, [last for _, last in chunks], noise)


def test_twenty_chunks_of_many_streams_never_write_the_voice_cache_and_stay_bounded(tiny_flow):
    voices = [_voice(tiny_flow, 60, seed=70), _voice(tiny_flow, 12, seed=71)]  # 120 >= tail, 24 < tail
    checksums = [[t.double().sum().item() for t in (c.estimator_att, c.conformer_att, c.estimator_cnn)]
                 for _, _, c in voices]
    saved = [c.estimator_att.clone() for _, _, c in voices]
    which = [0, 0, 1, 1]
    caches = [voices[v][2] for v in which]
    noise = [seeded_noise(tiny_flow.args, seed=80 + i) for i in range(len(which))]
    spk = torch.cat([voices[v][1] for v in which])
    sizes = []
    for step in range(20):
        chunks = [(random_tokens(28, seed=100 * step + i), False) for i in range(len(which))]  # 50 frames
        _, _, caches = _chunk(tiny_flow, spk, caches, chunks, noise)
        caches = [trim_cache(c, voices[v][0]) for c, v in zip(caches, which, strict=True)]
        sizes.append([c.stream_nbytes() for c in caches])
        for c, v in zip(caches, which, strict=True):
            assert c.estimator_kv.shared is voices[v][2].estimator_att  # referenced, never copied
            assert c.offset == min(voices[v][0] + 50 * (step + 1), voices[v][0] + ATT_CACHE_TAIL)
    for (_, _, cache), sums, before in zip(voices, checksums, saved, strict=True):
        assert torch.equal(cache.estimator_att, before)
        assert [t.double().sum().item() for t in (cache.estimator_att, cache.conformer_att,
                                                  cache.estimator_cnn)] == sums
    assert sizes[-1] == sizes[5]  # steady state: the same bytes from chunk to chunk
    a = tiny_flow.args.dit
    per_frame = tiny_flow.args.n_timesteps * a.depth * 2 * a.num_heads * 2 * a.head_dim * 4
    for c, v in zip(caches, which, strict=True):
        assert c.estimator_kv.own.capacity <= max(voices[v][0], ATT_CACHE_TAIL) + CHUNK_FRAMES
        assert c.estimator_kv.own_nbytes() == c.estimator_kv.own.capacity * per_frame


def test_a_reused_workspace_gives_the_same_bits_as_a_fresh_buffer_and_grows_only(tiny_flow):
    """Mixed batches (different voices, cache lengths, a last chunk) through one workspace, NaN-poisoned
    before every solve, decode exactly what fresh zeroed buffers decode."""
    voices = [_voice(tiny_flow, 60, seed=74), _voice(tiny_flow, 12, seed=75)]
    which = [0, 1, 0]
    noise = [seeded_noise(tiny_flow.args, seed=95 + i) for i in range(len(which))]
    spk = torch.cat([voices[v][1] for v in which])
    runs = {}
    for reused in (False, True):
        workspace = Workspace() if reused else None
        caches, mels, peak = [voices[v][2] for v in which], [], 0
        for step in range(6):
            n = len(which) if step >= 2 else 1 + step  # streams join: rows of different cache lengths
            chunks = [(random_tokens(28 - 5 * i, seed=300 + 10 * step + i), step == 5) for i in range(n)]
            with torch.inference_mode():
                if workspace is not None and workspace.nbytes:
                    _poison(workspace, voices[0][1])
                mel, _, new = tiny_flow.stream_chunks([c for c, _ in chunks], spk[:n], caches[:n],
                                                      [last for _, last in chunks], noise[:n],
                                                      workspace=workspace)
            caches[:n] = [trim_cache(c, voices[v][0]) for c, v in zip(new, which[:n], strict=True)]
            mels.append(mel)
            if workspace is not None:
                assert workspace.nbytes >= peak  # never shrinks
                peak = workspace.nbytes
        runs[reused] = mels
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))
    assert all(torch.isfinite(m).all() for m in runs[True])


def test_a_retried_step_gives_the_same_result_and_a_stale_cache_is_refused(tiny_flow):
    prompt_len, spk, voice = _voice(tiny_flow, 12, seed=72)
    noise = [seeded_noise(tiny_flow.args, seed=90)]
    chunks = split_chunks(random_tokens(80, seed=91))
    mel, _, (first,) = _chunk(tiny_flow, spk, [voice], chunks[:1], noise)
    first = trim_cache(first, prompt_len)
    mel_a, _, (second,) = _chunk(tiny_flow, spk, [first], chunks[1:2], noise)
    mel_b, _, (again,) = _chunk(tiny_flow, spk, [first], chunks[1:2], noise)  # a retry of that step
    assert torch.equal(mel_a, mel_b)
    assert torch.equal(second.reference_estimator_att(), again.reference_estimator_att())
    with pytest.raises(RuntimeError, match="stale"):
        _chunk(tiny_flow, spk, [second], chunks[2:3], noise)  # superseded by the retry
    _chunk(tiny_flow, spk, [trim_cache(again, prompt_len)], chunks[2:3], noise)
    with pytest.raises(RuntimeError, match="stale"):
        _chunk(tiny_flow, spk, [first], chunks[1:2], noise)  # the stream has moved on twice


def test_one_stream_twice_in_one_solve_is_refused(tiny_flow):
    prompt_len, spk, voice = _voice(tiny_flow, 12, seed=73)
    noise = [seeded_noise(tiny_flow.args, seed=92)] * 2
    chunks = split_chunks(random_tokens(80, seed=93))
    _, _, (cache,) = _chunk(tiny_flow, spk, [voice], chunks[:1], noise[:1])
    with pytest.raises(ValueError, match="same stream"):
        _chunk(tiny_flow, spk.expand(2, -1), [cache, cache], chunks[1:3], noise)


def test_a_reference_layout_cache_round_trips():
    shared = _frames(list(range(7)))
    cache = FlowCache(estimator_att=shared)
    assert cache.offset == 7 and cache.reference_estimator_att() is shared
    assert trim_cache(cache, 3, 2).estimator_att.size(4) == 5
    assert FlowCache().offset == 0 and FlowCache().reference_estimator_att() is None
