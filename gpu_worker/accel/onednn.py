"""The DiT's float32 linears on a CPU through oneDNN instead of the BLAS.

PyTorch sends a float32 `F.linear` on a CPU to its BLAS (MKL in the PyPI wheels); bf16 already goes to
oneDNN. On the CPUs measured oneDNN ran the DiT's shapes faster than MKL's sgemm in the same process
(docs/PERFORMANCE.md; `python -m bench.engine.speedups` measures both), and the DiT's linears are most
of a decode step's FLOPs. So `use_cpu_linear(model, "onednn")` re-dispatches them to
`torch.ops.mkldnn._linear_pointwise` (the kernel TorchInductor's CPU backend emits): still IEEE float32
arithmetic, only the summation order differs, as between any two BLAS libraries. The same call fuses each
MLP's fc1 with its tanh-GELU (one oneDNN linear with a GELU post-op, float32 and bf16; the output is
rounded to bf16 once instead of twice), where this CPU's oneDNN can build that kernel
(`fused_gelu_available`: a CPU without bf16 instructions has no bf16 inner product).

The swap changes a module's class only (`OneDnnLinear` is an `nn.Linear`): parameters, names and state
dicts are untouched, and `use_cpu_linear(model, "blas")` swaps back. A swapped linear still takes the
plain path where oneDNN does not apply (not a CPU tensor, another dtype, autograd on).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.model import Code2Wav
from gpu_worker.model.dit import Mlp

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


def _applies(x: Tensor, w: Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    return (x.dtype in dtypes and w.dtype == x.dtype and x.device.type == "cpu"
            and not torch.is_grad_enabled())


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


class OneDnnLinear(nn.Linear):
    """An `nn.Linear` whose float32 CPU inference runs on oneDNN."""

    def forward(self, x: Tensor) -> Tensor:
        if _ONEDNN and _applies(x, self.weight, (torch.float32,)):
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class OneDnnLinearGelu(OneDnnLinear):
    """fc1 of a DiT MLP with the MLP's tanh-GELU fused in (the MLP's own activation becomes Identity)."""

    def forward(self, x: Tensor) -> Tensor:
        if (_ONEDNN and _applies(x, self.weight, (torch.float32, torch.bfloat16))
                and fused_gelu_available(x.dtype)):
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "gelu", [], "tanh")
        return F.gelu(super().forward(x), approximate="tanh")


def use_cpu_linear(model: Code2Wav, kind: str) -> str:
    """Put the DiT's linears on `kind` ("onednn" where available, else "blas"); returns the path in use.
    Only the DiT (the flow's estimator) is switched: the encoder's and vocoder's linears stay as built."""
    if kind not in CPU_LINEAR_CHOICES:
        raise ValueError(f"cpu linear must be one of {CPU_LINEAR_CHOICES}, got {kind!r}")
    onednn = kind == "onednn" and _ONEDNN
    dit = model.flow.decoder.estimator
    for module in dit.modules():
        if isinstance(module, Mlp):
            module.fc1.__class__ = OneDnnLinearGelu if onednn else nn.Linear
            module.act = nn.Identity() if onednn else nn.GELU(approximate="tanh")
    for module in dit.modules():
        if isinstance(module, nn.Linear) and not isinstance(module, OneDnnLinearGelu):
            module.__class__ = OneDnnLinear if onednn else nn.Linear
    return cpu_linear_of(model)


def cpu_linear_of(model: Code2Wav) -> str:
    """The path the model's DiT linears take: "onednn" or "blas"."""
    linears = [m for m in model.flow.decoder.estimator.modules() if isinstance(m, nn.Linear)]
    return "onednn" if linears and all(isinstance(m, OneDnnLinear) for m in linears) else "blas"
