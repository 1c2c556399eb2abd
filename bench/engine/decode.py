"""Model numbers: decoder frames per second by batch size, and the cost of preparing one voice.

    decoder_sweep(setup, batches, timed_steps) -> [{batch, fps, rtf, stream_rtf, step_s, frames, ...}]
        rows are steady-state chunks (25 new + 3 lookahead tokens, 50 mel frames) of different streams
        through `StreamingDecoder.step`; every stream is first run until its caches are at their trimmed
        size (prompt + 100 frames), so each timed step does the same work as any later one
    prep_costs(setup, voices, reps) -> {host_half_ms, device_half_ms: {total, s3_quantize, campplus,
        setup_solve, other}}: the host half (`app.voices.features.host_half`) and the device half
        (`gpu_worker.voices.prompt.install_voice`) of one 6 s voice, timed phase by phase inside the real call

Frames are counted from the audio each row returns (480 samples per mel frame) and checked against what
the chunk plan says they must be.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from app.speech import PROMPT_FRAMES
from app.voices.features import host_half
from bench.engine.machine import Timer, summarize
from bench.engine.workload import BenchSetup, chunk_tokens
from gpu_worker.engine.streams import ChunkRow
from gpu_worker.model.config import (
    CHUNK_TOKENS,
    LOOKAHEAD_TOKENS,
    MEL_PER_TOKEN,
    SAMPLES_PER_MEL,
    TOKEN_RATE,
)
from gpu_worker.model.flow import CHUNK_FRAMES as FLOW_CHUNK_FRAMES
from gpu_worker.voices.prompt import install_voice

MEL_RATE = TOKEN_RATE * MEL_PER_TOKEN  # 50 mel frames per second of audio
CHUNK_FRAMES = CHUNK_TOKENS * MEL_PER_TOKEN  # a steady-state chunk: 50 frames, 1 s
# Chunks until a stream's step costs what every later one does: it has generated a prompt's length of
# frames (300), so it reads its last 300 and the voice's last 100 (`model/lanes.py`). (The reference's
# caches reach their trimmed size, prompt + 100 frames, after 2: `reference.REFERENCE_WARMUP_CHUNKS`.)
WARMUP_CHUNKS = -(-PROMPT_FRAMES // CHUNK_FRAMES)


def row_peak_bytes(setup: BenchSetup, prompt_len: int = PROMPT_FRAMES) -> int:
    """Memory one row of a step holds at its peak: its lane's ring (prompt + 56 frames, every Euler step
    and block) and its voice's frames gathered for one block; a voice slot per voice comes on top (the
    attention caches dominate every other tensor of a row)."""
    d, steps = setup.args.flow.dit, setup.args.flow.n_timesteps
    per_frame = 2 * d.num_heads * 2 * d.head_dim * torch.finfo(setup.dtype).bits // 8  # one block, step
    return per_frame * (steps * d.depth * (prompt_len + FLOW_CHUNK_FRAMES) + prompt_len)


def steady_rows(streams: list[Any], step: int) -> list[ChunkRow]:
    window = CHUNK_TOKENS + LOOKAHEAD_TOKENS
    return [ChunkRow(s, chunk_tokens(window, seed=10_000 * step + i), False) for i, s in enumerate(streams)]


def warm_streams(setup: BenchSetup, n: int, voices: int = 2, start: int = 0,
                 chunks: int = WARMUP_CHUNKS) -> list[Any]:
    """Streams start..start+n-1 over `voices` installed voices, stepped together `chunks` times, by default
    until their caches are trimmed (stream i: voice i mod `voices`, seed i)."""
    streams = [setup.decoder.open_stream(setup.install(i % voices), seed=i) for i in range(start, start + n)]
    if not streams:
        return []
    for step in range(chunks):
        setup.decoder.step(steady_rows(streams, step))
    return streams


def decoder_sweep(setup: BenchSetup, streams: list[Any], batches: list[int], timed_steps: int,
                  log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """`timed_steps` steps of each batch size over the first `batch` of the (warm) `streams`."""
    results = []
    for batch in batches:
        step_s, samples = [], 0
        for k in range(timed_steps):
            rows = steady_rows(streams[:batch], step=100 + k)
            with Timer(setup.device) as timer:
                audios = setup.decoder.step(rows)
            step_s.append(timer.s)
            samples += sum(a.numel() for a in audios)
        frames = samples / SAMPLES_PER_MEL
        expected = batch * timed_steps * CHUNK_FRAMES
        total = sum(step_s)
        results.append({
            "batch": batch, "timed_steps": timed_steps, "frames": frames, "frames_expected": expected,
            "seconds": total, "fps": frames / total, "rtf": total / (frames / MEL_RATE),
            "stream_rtf": summarize(step_s)["p50"] / (CHUNK_FRAMES / MEL_RATE),  # type: ignore[index]
            "step_s": summarize(step_s), "step_s_all": step_s,
        })
        log(f"  decoder batch {batch:2d}: {frames / total:8.1f} frames/s  (step p50 "
            f"{summarize(step_s)['p50']:.3f} s)")  # type: ignore[index]
    return results


@contextlib.contextmanager
def _timed_attr(obj: Any, name: str, into: list[float], device: torch.device) -> Iterator[None]:
    """Times every call of `obj.name` while the block runs (an instance attribute shadows the method)."""
    original = getattr(obj, name)
    own = name in vars(obj)  # an instance attribute (restore it) or a method (remove the shadow)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with Timer(device) as timer:
            out = original(*args, **kwargs)
        into.append(timer.s)
        return out

    setattr(obj, name, timed)
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def _device_half_once(setup: BenchSetup, index: int) -> dict[str, float]:
    host = setup.host(index)
    parts: dict[str, list[float]] = {"s3_quantize": [], "campplus": [], "speaker": [], "setup_solve": []}
    with contextlib.ExitStack() as stack:
        speaker = setup.speaker
        if hasattr(speaker, "tokenizer") and hasattr(speaker, "campplus"):
            stack.enter_context(_timed_attr(speaker, "tokenizer", parts["s3_quantize"], setup.device))
            stack.enter_context(_timed_attr(speaker, "campplus", parts["campplus"], setup.device))
        stack.enter_context(_timed_attr(speaker, "quantize_and_embed", parts["speaker"], setup.device))
        stack.enter_context(_timed_attr(setup.model.flow, "setup_batch", parts["setup_solve"], setup.device))
        with Timer(setup.device) as total:
            prompt = install_voice(host, speaker=speaker, decoder=setup.decoder)
    setup.adopt(index, prompt)
    out = {"total": total.s, **{k: sum(v) for k, v in parts.items() if v}}
    out["other"] = total.s - out["speaker"] - out["setup_solve"]
    out["cache_mib"] = prompt.nbytes() / 2**20
    return out


def prep_costs(setup: BenchSetup, voices: int, reps: int) -> dict[str, Any]:
    """Host half `reps` times (after one untimed call), device half once for each of `voices` voices."""
    voice = setup.voice(0)
    host_half(voice.pcm, voice.voice_id)  # first call builds the mel filters
    host_ms = []
    for _ in range(reps):
        with Timer() as timer:
            host_half(voice.pcm, voice.voice_id)
        host_ms.append(timer.s * 1000)
    device = [_device_half_once(setup, i) for i in range(voices)]
    device_ms = {key: summarize([d[key] * 1000 for d in device]) for key in device[0] if key != "cache_mib"}
    return {"host_half_ms": summarize(host_ms), "device_half_ms": device_ms,
            "voice_cache_mib": device[0]["cache_mib"], "speaker": setup.speaker_kind}
