"""`Linear`: nn.Linear whose float32 inference on a CPU runs on oneDNN instead of the BLAS.

PyTorch sends a float32 `F.linear` on a CPU to its BLAS (MKL in the PyPI wheels); bf16 already goes to
oneDNN. On the AVX-512 EPYC this project is benchmarked on, MKL's sgemm reached about 115 GFLOP/s at
the DiT's shapes where oneDNN reached about 250 in the same process (docs/PERFORMANCE.md, run 2;
`python -m gpu_worker.bench.speedups` measures both), so the DiT's linears, most of a decode step's
FLOPs, take the oneDNN path through `torch.ops.mkldnn._linear_pointwise` (the kernel TorchInductor's CPU
backend emits). It is still IEEE float32 arithmetic; only the summation order differs, as between any
two BLAS libraries.

Used only where it applies (CPU, float32 input and weight, autograd off, oneDNN built in); everything
else is plain `F.linear`. `set_cpu_linear("blas")` switches the whole process back (the worker's
`WAVEFARM_CPU_LINEAR` setting; the benchmark's before/after). Parameter names are nn.Linear's, so
checkpoints load unchanged.

`linear_gelu_tanh(layer, x)` is `gelu(layer(x), approximate="tanh")` (the DiT MLP's first half) as one
oneDNN linear with a GELU post-op, in float32 and in bf16, on the same conditions and switch. On the
AMX Xeon of run 3 a separate bf16 GELU over [16, 50, 2048] took longer than the bf16 product before it
(2.8 against 2.4 ms per call in an 8-row step's profile); fused, the pair took 2.3 ms instead of 4.8
(float32: 9.8 instead of 10.8; `python -m gpu_worker.bench.speedups`, docs/PERFORMANCE.md run 3). The
output is rounded to bf16 once instead of twice. Where oneDNN cannot build the fused kernel in a dtype
(bf16 on a CPU without bf16 instructions), that dtype is unfused (`fused_gelu_available`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

CPU_LINEAR_CHOICES = ("onednn", "blas")


def _probe() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


_ONEDNN = _probe()


def onednn_available() -> bool:
    return _ONEDNN


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ weight.T + bias on oneDNN (CPU tensors)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_use_onednn = _ONEDNN


def set_cpu_linear(kind: str) -> str:
    """'onednn' (the default where available) or 'blas'; returns the path now in use."""
    global _use_onednn
    if kind not in CPU_LINEAR_CHOICES:
        raise ValueError(f"cpu linear must be one of {CPU_LINEAR_CHOICES}, got {kind!r}")
    _use_onednn = kind == "onednn" and _ONEDNN
    return cpu_linear()


def cpu_linear() -> str:
    return "onednn" if _use_onednn else "blas"


def _on_onednn(x: Tensor, w: Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (_use_onednn and x.dtype in dtypes and w.dtype == x.dtype and x.device.type == "cpu"
            and not torch.is_grad_enabled())


_FUSED_DTYPES = (torch.float32, torch.bfloat16)
_fused_works: dict[torch.dtype, bool] = {}


def fused_gelu_available(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN builds the fused linear+GELU kernel in `dtype`, tried once on a tiny
    product. A CPU without bf16 instructions (AVX2 only, e.g. a Zen 3 EPYC) has no bf16 inner product:
    oneDNN refuses to create it, and bf16 then takes the unfused path."""
    if dtype not in _fused_works:
        try:
            w = torch.ones(16, 16, dtype=dtype)
            with torch.no_grad():
                torch.ops.mkldnn._linear_pointwise(w[:2], w, w[0], "gelu", [], "tanh")
            _fused_works[dtype] = True
        except RuntimeError:
            _fused_works[dtype] = False
    return _fused_works[dtype]


def linear_gelu_tanh(layer: nn.Linear, x: Tensor) -> Tensor:
    """F.gelu(layer(x), approximate="tanh"), fused on oneDNN where it applies (module docstring)."""
    if _on_onednn(x, layer.weight, _FUSED_DTYPES) and fused_gelu_available(x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "gelu", [], "tanh")
    return F.gelu(layer(x), approximate="tanh")


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        if _on_onednn(x, w, (torch.float32,)):
            return onednn_linear(x, w, self.bias)
        return F.linear(x, w, self.bias)
