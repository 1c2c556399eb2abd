"""Degrade, never die: where an accelerated path fails on a device, the worker takes the plain one, logs it
once loudly and counts it, and its jobs go on.

    record(kind, part, reason, detail)   one fallback taken: logged at ERROR the first time per (kind,
                                         part, reason), counted every time
    counts(kind) -> {(part, reason): n}  what the metrics serve (`gpu_worker.worker.metrics`):
        wavefarm_graph_fallbacks_total{part,reason}    kind "graph": a CUDA graph bucket that runs eagerly
                                                       (part flow | vocoder; reason capture_error |
                                                       replay_mismatch)
        wavefarm_worker_fallbacks_total{part,reason}   kind "worker": attention (fused kernel refused or
                                                       wrong: the written-out arithmetic), speaker
                                                       (TensorRT -> onnxruntime), dtype (a bf16/fp16
                                                       kernel missing: float32)
    attention_probe(device, dtype)       the fused attention kernel tried once; a refusal is counted
    usable_dtype(device, dtype)          `dtype` if the model's kernel kinds run in it there, else float32

The graph runners (`accel.graphs`, `accel.flow_graphs`) and CAM++ on TensorRT (`accel.tensorrt`) record
their own; the composition root (`runtime.build_model`) runs the probes. The counts are per process
(a worker builds one model); `reset()` is for tests. Imports: torch and the standard library.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KINDS = ("graph", "worker")
_counts: Counter[tuple[str, str, str]] = Counter()
_lock = threading.Lock()


def record(kind: str, part: str, reason: str, detail: str = "") -> None:
    """One fallback taken (module docstring). The first of a kind, part and reason is an ERROR line."""
    assert kind in KINDS, kind
    key = (kind, part, reason)
    with _lock:
        first = _counts[key] == 0
        _counts[key] += 1
    if first:
        log.error("FALLBACK %s/%s: %s%s (the plain path runs instead; counted in "
                  "wavefarm_%s_fallbacks_total)", kind, part, reason, f": {detail}" if detail else "", kind)
    else:
        log.debug("fallback %s/%s: %s %s", kind, part, reason, detail)


def counts(kind: str) -> dict[tuple[str, str], int]:
    with _lock:
        return {(p, r): n for (k, p, r), n in _counts.items() if k == kind}


def total() -> int:
    with _lock:
        return sum(_counts.values())


def reset() -> None:
    with _lock:
        _counts.clear()


def attention_probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the DiT's fused attention kernel runs here (`model.attention.fused_available`, which the
    model consults itself); a device that should have one and refuses it is counted."""
    from gpu_worker.model import attention  # the pure model module: the probe's bookkeeping stays here

    ok = attention.fused_available(device, dtype)
    if not ok and device.type in ("cpu", "cuda"):
        record("worker", "attention", "fused_kernel_refused",
               f"{device.type} {dtype}: the written-out attention runs (slower, same arithmetic)")
    return ok


def _kernel_kinds(device: torch.device, dtype: torch.dtype) -> None:
    """One tiny call of each kind of kernel the model runs (linear, convolutions, normalisation, attention,
    the activations, reflect padding), in `dtype` on `device`: raises where one is missing."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 8, 16, generator=g).to(device, dtype)
    w = torch.randn(16, 16, generator=g).to(device, dtype)
    y = F.gelu(F.linear(x, w), approximate="tanh")
    y = F.layer_norm(F.silu(y), (16,))
    q = y.view(2, 2, 8, 8)
    y = F.scaled_dot_product_attention(q, q, q).reshape(2, 8, 16)
    c = y.transpose(1, 2)  # [B, C, T]
    k = torch.randn(16, 16, 3, generator=g).to(device, dtype)
    c = F.conv_transpose1d(F.conv1d(c, k, padding=1), k, stride=2)
    c = F.leaky_relu(c, 0.1) + torch.sin(c) + F.mish(c)  # Mish: the DiT's causal conv block
    c = F.pad(c, (1, 0), mode="reflect")  # the vocoder's last upsampling
    if not bool(torch.isfinite(c.float()).all()):
        raise RuntimeError(f"non-finite output in {dtype}")


KERNEL_KINDS: Callable[[torch.device, torch.dtype], None] = _kernel_kinds  # tests inject a failure here


def usable_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """`dtype` if every kind of kernel the model needs runs in it on `device`, else float32 (counted)."""
    if dtype == torch.float32:
        return dtype
    try:
        KERNEL_KINDS(device, dtype)
    except (RuntimeError, NotImplementedError) as exc:
        record("worker", "dtype", f"{str(dtype).removeprefix('torch.')}_kernel_missing",
               f"{device.type}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}; float32 runs")
        return torch.float32
    return dtype
