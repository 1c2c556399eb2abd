"""The limit: FLOPs per decoded mel frame, times the machine's measured matmul rate.

    count_flops(setup, streams) -> {flops_per_frame, by_component: {flow_encoder, dit, hift}, ...}
        `torch.utils.flop_counter.FlopCounterMode` over one steady-state decoder step (the flow encoder,
        10 Euler steps x a CFG-doubled DiT, HiFT). It counts matmuls, convolutions and attention
        (2 FLOPs per multiply-add); element-wise work, FFTs and copies are not counted, so the count is
        a lower bound on the work and the ceiling below an upper bound on the speed.
    matmul_rates(device, dtypes, min_s) -> {dtype: {best_gflops, shapes: [...]}}
        the model's matrix products ([rows, 512] x [512, 2048], [rows, 2048] x [2048, 512], ...,
        rows = 2 x batch x 50 frames) by each path the model can take (`torch.mm`, and oneDNN's linear
        on a CPU), best of repeated runs; best_gflops is the fastest path's
    ceiling_fps = best_gflops * 1e9 / flops_per_frame: frames per second no implementation of this
        model can beat on this machine at that dtype (it would have to run every FLOP at the best rate
        the machine reached on a plain matrix multiply).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from bench.engine.decode import steady_rows
from bench.engine.machine import sync
from bench.engine.workload import BenchSetup
from gpu_worker.accel import onednn
from gpu_worker.checkpoint.load import DTYPES
from gpu_worker.model.config import SAMPLES_PER_MEL


def _sdpa_flops(query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, **kwargs: Any) -> int:
    # FlopCounterMode has no formula for the CPU attention kernel; count it as its two batched matmuls.
    return sdpa_flop_count(query_shape, key_shape, value_shape)


SDPA_OPS = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
            torch.ops.aten.scaled_dot_product_attention)


def count_flops(setup: BenchSetup, streams: list[Any]) -> dict[str, Any]:
    """FLOPs of one steady-state step of `streams` (all of them as rows), per decoded mel frame."""
    mapping = dict.fromkeys(SDPA_OPS, _sdpa_flops)
    model = setup.decoder.model
    before = onednn.cpu_linear_of(model)
    onednn.use_cpu_linear(model, "blas")  # FlopCounterMode counts aten's matmuls, not oneDNN's: same maths
    try:
        with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            audios = setup.decoder.step(steady_rows(streams, step=900))
    finally:
        onednn.use_cpu_linear(model, before)
    frames = sum(a.numel() for a in audios) / SAMPLES_PER_MEL
    counts = counter.get_flop_counts()
    total = counter.get_total_flops()
    dit = sum(counts.get("DiT", {}).values())
    hift = sum(counts.get("HiFTGenerator", {}).values())
    by_op: dict[str, int] = {}
    for op, n in counts.get("Global", {}).items():
        by_op[str(op).removeprefix("aten.")] = int(n)
    return {
        "rows": len(streams), "frames": frames, "flops_total": int(total),
        "flops_per_frame": total / frames,
        "by_component_per_frame": {"flow_encoder": (total - dit - hift) / frames, "dit": dit / frames,
                                   "hift": hift / frames},
        "by_op": by_op,
        "counted": "matmul, convolution, attention (FlopCounterMode); not element-wise, FFT or copies",
    }


def _best_s(fn: Any, device: torch.device, min_s: float) -> float:
    fn()  # warm-up
    best = float("inf")
    spent, reps = 0.0, 0
    while reps < 1 or (spent < min_s and reps < 50):  # a slow dtype (bf16 without hardware support) runs once
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        elapsed = time.perf_counter() - start
        best, spent, reps = min(best, elapsed), spent + elapsed, reps + 1
    return best


def _mm_rates(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, min_s: float
              ) -> dict[str, float]:
    """GFLOP/s of an [m, k] x [k, n] product by every path the model can take: `torch.mm` (the BLAS
    on a CPU) and, on a CPU with oneDNN, the oneDNN linear `gpu_worker.accel.onednn` uses. On some CPUs
    (AVX-512 EPYC) oneDNN is twice the BLAS: a limit from torch.mm alone would not be a limit."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    flops = 2 * m * k * n
    out = {"blas": flops / _best_s(lambda: torch.mm(a, b), device, min_s) / 1e9}
    if device.type == "cpu" and onednn.onednn_available():
        w = b.t().contiguous()
        try:
            out["onednn"] = flops / _best_s(lambda: onednn.onednn_linear(a, w, None), device, min_s) / 1e9
        except RuntimeError:  # no oneDNN kernel in this dtype here (bf16 on an AVX2-only CPU): BLAS only
            pass
    return out


def model_shapes(setup: BenchSetup, batches: list[int]) -> list[tuple[int, int, int]]:
    d, e = setup.args.flow.dit, setup.args.flow.encoder
    hidden, mlp = d.hidden_size, int(d.hidden_size * d.mlp_ratio)
    pairs = {(hidden, mlp), (mlp, hidden), (hidden, hidden), (d.in_channels, hidden),
             (e.output_size, e.linear_units), (e.linear_units, e.output_size)}
    rows = sorted({2 * b * 50 for b in batches})
    return [(m, k, n) for m in rows for k, n in sorted(pairs)]


def matmul_rates(setup: BenchSetup, dtypes: list[str], batches: list[int], min_s: float) -> dict[str, Any]:
    shapes = model_shapes(setup, batches)
    out: dict[str, Any] = {}
    for name in dtypes:
        rates: list[dict[str, Any]] = []
        for m, k, n in shapes:
            paths = _mm_rates(m, k, n, DTYPES[name], setup.device, min_s)
            rates.append({"m": m, "k": k, "n": n, "gflops": max(paths.values()), "by_path": paths})
        out[name] = {"best_gflops": max(float(r["gflops"]) for r in rates), "shapes": rates}
    return out


def ceilings(flops: dict[str, Any], rates: dict[str, Any]) -> dict[str, float]:
    return {name: r["best_gflops"] * 1e9 / flops["flops_per_frame"] for name, r in rates.items()}
