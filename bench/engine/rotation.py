"""The decoder part of `python -m bench.engine.speedups`: every variant in turn on the same machine.

    rotation(preset, rows, rounds, bf16) -> [{name, before, after, speedup, samples}]

A variant is a model dtype, a vocoder dtype and a linear path (`gpu_worker.accel.onednn`: the BLAS with
the GELU apart, or oneDNN with the GELU fused into fc1). Each round runs, for every variant, one voice
install (the whole device
half, stand-in speaker) and one steady-state step of 1 and of `rows` warm streams, then one chunk of the
fp32 reference at batch 1 (stepaudio2, when installed), so every variant and the reference take turns on
the same machine state; results are medians over the rounds.

    fp32 blas             the float32 decoder with the BLAS's linears
    fp32 onednn           + oneDNN linears with the fused GELU: the default
    bf16 blas             (--bf16) the bf16 flow with the BLAS's linears
    bf16 onednn           (--bf16) the bf16 flow now (vocoder float32, as the reference)
    bf16 + bf16 vocoder   (--bf16) the same with WAVEFARM_HIFT_DTYPE=bf16
(Every variant decodes over the decoder's lanes, `model/lanes.py`; the per-stream caches they replaced
are measured against them in `python -m bench.engine.streams`.)

Not in here: the micro-benchmarks (speedups.py), the engine sweep (sweep.py).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, NamedTuple

import torch

from bench.engine import reference
from bench.engine.decode import CHUNK_FRAMES, decoder_sweep, warm_streams
from bench.engine.reference import REFERENCE_WARMUP_CHUNKS
from bench.engine.workload import BenchSetup
from gpu_worker.accel.onednn import use_cpu_linear
from gpu_worker.model.config import SAMPLES_PER_MEL


class Variant(NamedTuple):
    setup: str  # key of the BenchSetup: "<flow dtype>/<vocoder dtype>"
    path: str  # linear path


FP32 = {"fp32 blas": Variant("fp32/fp32", "blas"), "fp32 onednn": Variant("fp32/fp32", "onednn")}
BF16 = {"bf16 blas": Variant("bf16/fp32", "blas"), "bf16 onednn": Variant("bf16/fp32", "onednn"),
        "bf16 + bf16 vocoder": Variant("bf16/bf16", "onednn")}
# (before, after, what changed): the pairs reported
PAIRS = (("fp32 blas", "fp32 onednn", "BLAS -> oneDNN linears, GELU fused"),
         ("bf16 blas", "bf16 onednn", "bf16: BLAS -> oneDNN linears"),
         ("bf16 onednn", "bf16 + bf16 vocoder", "fp32 -> bf16 vocoder"),
         ("fp32 onednn", "bf16 onednn", "fp32 -> bf16 flow"))


def _once(setup: BenchSetup, streams: list[Any], variant: Variant, rows: int,
          into: dict[str, list[float]]) -> None:
    """One install and one step of 1 and of `rows` streams as `variant`."""
    use_cpu_linear(setup.decoder.model, variant.path)
    start = time.perf_counter()
    setup.installer(setup.host(0))
    into.setdefault("install_s", []).append(time.perf_counter() - start)
    for row in decoder_sweep(setup, streams, sorted({1, rows}), 1, log=lambda _: None):
        into.setdefault(f"fps_{row['batch']}_rows", []).append(row["fps"])


def rotation(preset: str, rows: int, rounds: int = 2, bf16: bool = False) -> list[dict[str, Any]]:
    variants = {**FP32, **(BF16 if bf16 else {})}
    setups: dict[str, BenchSetup] = {}
    out: dict[str, dict[str, list[float]]] = {name: {} for name in [*variants, "reference"]}
    try:
        for key in dict.fromkeys(v.setup for v in variants.values()):
            dtype, hift_dtype = key.split("/")
            setups[key] = BenchSetup.build(preset=preset, device="cpu", dtype=dtype, hift_dtype=hift_dtype,
                                           speaker="standin", micro_batch_size=rows)
        with torch.inference_mode():
            streams = {key: warm_streams(setup, rows) for key, setup in setups.items()}
            _rounds(setups, streams, variants, rows, rounds, out)
    finally:
        for setup in setups.values():
            setup.close()
    return _results(preset, out)


def _rounds(setups: dict[str, BenchSetup], streams: dict[str, list[Any]], variants: dict[str, Variant],
            rows: int, rounds: int, out: dict[str, dict[str, list[float]]]) -> None:
    base = setups["fp32/fp32"]
    try:
        ref = reference.build_reference(base)
    except ImportError:
        ref = None  # the reference is a test-only dependency
    with torch.random.fork_rng(devices=[]):
        ref_stream = None
        if ref is not None:
            ref_stream, solve_s = reference.open_reference_stream(base, ref, 0)
            out["reference"]["install_s"] = [solve_s]
            for k in range(REFERENCE_WARMUP_CHUNKS):
                reference.reference_chunk(base, ref_stream, k)
        for r in range(rounds):
            for name, v in variants.items():
                _once(setups[v.setup], streams[v.setup], v, rows, out[name])
            if ref_stream is not None:
                seconds, samples = reference.reference_chunk(base, ref_stream, REFERENCE_WARMUP_CHUNKS + r)
                assert samples == CHUNK_FRAMES * SAMPLES_PER_MEL
                out["reference"].setdefault("fps_1_rows", []).append(CHUNK_FRAMES / seconds)


def _results(preset: str, out: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    med = {name: {key: statistics.median(v) for key, v in parts.items()} for name, parts in out.items()}

    def entry(name: str, before: float, after: float, higher_is_better: bool) -> dict[str, Any]:
        return {"name": f"decoder {preset}: {name}", "before": before, "after": after,
                "speedup": after / before if higher_is_better else before / after, "samples": out}

    results = []
    for a, b, what in PAIRS:
        if a in med and b in med:
            results += [entry(f"{key} ({what})", med[a][key], med[b][key], key.startswith("fps"))
                        for key in med[a]]
    if out["reference"]:
        ref_fps = med["reference"]["fps_1_rows"]
        for name in (n for n in out if n != "reference"):
            results += [entry(f"{key} {name} vs reference 1 row fp32", ref_fps, med[name][key], True)
                        for key in med[name] if key.startswith("fps")]
        results.append(entry("setup solve, reference fp32 -> our install (fp32 now)",
                             med["reference"]["install_s"], med["fp32 onednn"]["install_s"], False))
    return results
