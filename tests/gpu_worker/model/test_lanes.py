"""The lanes (`gpu_worker.model.lanes`): the reference's trimming as bookkeeping, the static-shape
solve against the per-stream one, padding that never changes a real row, retries, moves and reuse.

The solve over lanes and `Flow.stream_chunks` run the same arithmetic on differently laid out keys (slots
per lane, voices gathered per row, against packed slots and voices folded per voice), so they agree
to float rounding, not bit for bit: TOL = 1e-5 as the flow's other batch tests (measured about 2e-6).
"""

from __future__ import annotations

import pytest
import torch

from bench.engine.flows import LaneFlow
from gpu_worker.model.flow import trim_cache
from gpu_worker.model.lane_step import LaneStep
from gpu_worker.model.lanes import Lanes, LaneShape
from tests.gpu_worker.model.ref_oracle import make_prompt, random_tokens, seeded_noise, split_chunks

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TOL = 1e-5
PROMPT_TOKENS, TAIL, NEW = 15, 10, 5  # prompt 30 frames >= tail, as 300 >= 100 in production
MAX_NEW = 2 * (NEW + 3)


def _shape(prompt_len: int = 2 * PROMPT_TOKENS, tail: int = TAIL, max_new: int = MAX_NEW) -> LaneShape:
    return LaneShape(steps=2, depth=1, heads=1, head_dim=1, hidden=1, prompt_len=prompt_len, tail=tail,
                     max_new=max_new)


# -- the trimming rule as arithmetic ------------------------------------------------------------------
@pytest.mark.parametrize(("prompt_len", "tail", "max_new"), [(30, 10, 16), (300, 100, 56), (12, 12, 7),
                                                          (16, 10, 16)])
def test_the_plan_counts_exactly_the_frames_the_reference_keeps(prompt_len, tail, max_new):
    """The reference keeps logical frames [:P] + [-tail:] of (newest chunk first, a chunk's frames in
    their order | ... | the prompt) after every chunk. For every chunk of a stream of random chunk sizes,
    the slots a row reads hold exactly the generated frames that list keeps and the chunk's new
    ones, the voice mask counts exactly its prompt frames, and the noise offset is the list's length."""
    shape = _shape(prompt_len, tail, max_new)
    lanes = Lanes(shape, device=torch.device("cpu"), dtype=torch.float32)
    lane = lanes.acquire(voice=0)
    gen = torch.Generator().manual_seed(prompt_len)
    order = [("p", e) for e in range(prompt_len)]  # the reference's logical order
    held: dict[int, int] = {}  # slot -> the generated frame written there
    for _ in range(40):
        n = int(torch.randint(1, max_new + 1, (1,), generator=gen))
        plan = lanes.plan({lane.index: n}, n, 1)
        step = LaneStep.of(lanes, plan, shape.window([lane.frames]))
        for j, slot in enumerate(plan[0, 3 : 3 + n].tolist()):  # the chunk's frames, written first
            held[slot] = lane.frames + j
        read = {held[slot] for slot in torch.nonzero(step.own_bias[0] == 0).flatten().tolist()}
        assert read == {g for kind, g in order if kind == "g"} | set(range(lane.frames, lane.frames + n))
        lo = prompt_len - step.window
        bias = step.voice_bias
        seen = torch.ones(step.window, dtype=torch.bool) if bias is None else bias[0, 0, 0] == 0
        assert {lo + int(e) for e in torch.nonzero(seen).flatten()} == {e for kind, e in order if kind == "p"}
        assert int(step.noise_at[0, 0, 0]) + prompt_len == len(order)
        order = [("g", g) for g in range(lane.frames, lane.frames + n)] + order
        if len(order) > prompt_len + tail:
            order = order[:prompt_len] + order[-tail:]
        lanes.advance(lane, n)


# -- the solve ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def voices(tiny_flow):
    noise = seeded_noise(tiny_flow.args, seed=1)
    out = []
    with torch.inference_mode():
        for seed in (3, 4):
            prompt = make_prompt(PROMPT_TOKENS, seed=seed)
            out.append(tiny_flow.setup(prompt.setup_tokens, prompt.mel, prompt.spk, noise))
    return out


def _noise(tiny_flow, seed: int) -> torch.Tensor:
    return seeded_noise(tiny_flow.args, seed=seed)


@torch.inference_mode()
def test_lane_solves_equal_the_per_stream_solve_over_many_trimmed_chunks(tiny_flow, voices):
    """Four streams of two voices, one joining a step late (its lane rides along with no frames first),
    one finishing early (its lane given back, the highest moved into it), twelve chunks each: every
    chunk's mel equals the per-stream path's (`Flow.stream_chunks`, each stream alone)."""
    driver = LaneFlow(tiny_flow, voices, tail=TAIL, max_new=MAX_NEW)
    jobs = [(0, 150, 0), (1, 110, 0), (0, 48, 0), (1, 130, 1)]  # voice, tokens, first step
    chunks = [split_chunks(random_tokens(n, seed=30 + i), new=NEW) for i, (_, n, _) in enumerate(jobs)]
    noises = [_noise(tiny_flow, 40 + i) for i in range(len(jobs))]
    streams = [driver.open(v, noises[i]) for i, (v, _, _) in enumerate(jobs)]
    step, moved = 0, False
    while any(len(s.mels) < len(c) for s, c in zip(streams, chunks, strict=True)):
        live = [i for i, (_, _, start) in enumerate(jobs)
                if start <= step and len(streams[i].mels) < len(chunks[i])]
        driver.solve([(streams[i], *chunks[i][len(streams[i].mels)]) for i in live])
        for i in live:
            if len(streams[i].mels) == len(chunks[i]) and streams[i] in driver.streams:
                moved |= streams[i].lane.index < driver.lanes.n_open - 1
                driver.close(streams[i])
        step += 1
    assert moved and step >= 12
    worst = 0.0
    for (v, _, _), stream, stream_chunks, noise in zip(jobs, streams, chunks, noises, strict=True):
        spk, cache = voices[v]
        for (tokens, last), got in zip(stream_chunks, stream.mels, strict=True):
            want, n, (cache,) = tiny_flow.stream_chunks([tokens], spk, [cache], [last], [noise])
            cache = trim_cache(cache, 2 * PROMPT_TOKENS, TAIL)
            worst = max(worst, (got - want[:, :, : n[0]]).abs().max().item())
    print(f"lanes vs per-stream solve: max |diff| = {worst:.3g}")
    assert worst < TOL


@torch.inference_mode()
def test_padding_rows_and_frames_never_change_a_real_row(tiny_flow, voices):
    """A graph bucket pads a solve with free lanes and a chunk with frames past the longest row. A real
    row comes out the same up to the BLAS's rounding by shape, not bit for bit: MKL rounds the DiT's
    in_proj (a Linear 320 -> 64 here) differently for 60 and 80 rows, 1.2e-7 at the second Euler step,
    about 1.4e-6 on the mel after eight chunks (padding rows or frames alike); a mask or padding bug
    would show as 1e-2 and more. Padded to its own shape the solve is the same bits."""
    def run(rows_to: int, frames_to: int) -> list[list[torch.Tensor]]:
        driver = LaneFlow(tiny_flow, voices, tail=TAIL, max_new=MAX_NEW)
        streams = [driver.open(i % 2, _noise(tiny_flow, 50 + i)) for i in range(3)]
        chunks = [split_chunks(random_tokens(60 + 7 * i, seed=60 + i), new=NEW) for i in range(3)]
        out = []
        for k in range(8):
            rows = [(s, *c[k]) for s, c in zip(streams, chunks, strict=True) if k < len(c)]
            out.append(driver.solve(rows, rows_to=rows_to, frames_to=frames_to))
        return out

    def worst(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
        return max((x - y).abs().max().item() for xs, ys in zip(a, b, strict=True)
                   for x, y in zip(xs, ys, strict=True))

    exact = run(0, 0)
    padded = worst(exact, run(8, MAX_NEW))
    print(f"padding rows (3 -> 8) and frames (-> {MAX_NEW}): max |diff| = {padded:.3g} "
          f"(mel up to {max(m.abs().max().item() for ms in exact for m in ms):.3g})")
    assert padded < TOL
    assert worst(exact, run(3, 0)) == 0.0


@torch.inference_mode()
def test_a_solve_run_again_before_its_commit_gives_the_same_bits(tiny_flow, voices):
    """A failed step is retried: the solve wrote its new frames only to slots no row counts yet."""
    driver = LaneFlow(tiny_flow, voices, tail=TAIL, max_new=MAX_NEW)
    streams = [driver.open(i % 2, _noise(tiny_flow, 70 + i)) for i in range(2)]
    chunks = [split_chunks(random_tokens(90, seed=80 + i), new=NEW) for i in range(2)]
    for k in range(6):
        driver.solve([(s, *c[k]) for s, c in zip(streams, chunks, strict=True)])
    rows = [(s, *c[6]) for s, c in zip(streams, chunks, strict=True)]
    first = driver.solve(rows, commit=False)
    again = driver.solve(rows)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


# -- lanes as places ---------------------------------------------------------------------------------
def test_a_released_lane_takes_the_highest_one_and_its_stream_keeps_its_state():
    lanes = Lanes(_shape(), device=torch.device("cpu"), dtype=torch.float32)
    held = [lanes.acquire(voice=0) for _ in range(3)]
    for i, lane in enumerate(held):
        lanes.own[:, :, lane.index] = i + 1.0
        lanes.start(lane, conv=torch.full(lanes.conv.shape[:2] + lanes.conv.shape[3:], 10.0 + i),
                    noise=torch.full(lanes.noise.shape[1:], 20.0 + i), spk=torch.full((80,), 30.0 + i))
    lanes.release(held[0])
    assert lanes.n_open == 2 and not held[0].open and held[2].index == 0 and held[1].index == 1
    assert lanes.own[:, :, 0].eq(3.0).all() and lanes.conv[:, :, 0].eq(12.0).all()
    assert lanes.noise[0].eq(22.0).all() and lanes.spk[0].eq(32.0).all()
    lanes.release(held[0])  # again: nothing
    assert lanes.n_open == 2


def test_growing_keeps_what_the_lanes_hold_and_counts_a_new_version():
    lanes = Lanes(_shape(), device=torch.device("cpu"), dtype=torch.float32, lanes=1)
    lane = lanes.acquire(voice=0)
    lanes.own[:, :, lane.index] = 5.0
    version = lanes.version
    second = lanes.acquire(voice=0)  # past the capacity: the tensors grow
    assert lanes.capacity >= 2 and lanes.version == version + 1 and second.index == 1
    assert lanes.own[:, :, 0].eq(5.0).all() and lanes.own[:, :, 1].eq(0.0).all()


@torch.inference_mode()
def test_a_lane_reused_after_a_stream_that_left_nan_decodes_finite_audio(tiny_flow, voices):
    driver = LaneFlow(tiny_flow, voices, tail=TAIL, max_new=MAX_NEW)
    broken = driver.open(0, _noise(tiny_flow, 90))
    driver.lanes.own[:, :, broken.lane.index] = float("nan")
    driver.close(broken)
    stream = driver.open(1, _noise(tiny_flow, 91))
    chunks = split_chunks(random_tokens(40, seed=92), new=NEW)
    mels = [driver.solve([(stream, *c)])[0] for c in chunks]
    assert all(torch.isfinite(m).all() for m in mels)


def test_a_prompt_shorter_than_the_kept_tail_is_refused():
    with pytest.raises(ValueError, match="at least 10 frames"):
        Lanes(_shape(prompt_len=8), device=torch.device("cpu"), dtype=torch.float32)
