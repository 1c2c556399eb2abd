"""`gpu_worker.model.linear.Linear`: oneDNN for float32 CPU inference, nn.Linear's arithmetic elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.model import linear
from gpu_worker.model.config import ModelArgs
from gpu_worker.model.dit import DiT


@pytest.fixture
def restore_path():
    before = linear.cpu_linear()
    yield
    linear.set_cpu_linear(before)


def _layer() -> linear.Linear:
    torch.manual_seed(0)
    return linear.Linear(512, 2048).requires_grad_(False)


def test_onednn_path_is_float32_accurate_and_blas_path_is_nn_linear(restore_path) -> None:
    layer = _layer()
    x = torch.randn(3, 50, 512, generator=torch.Generator().manual_seed(1)).transpose(0, 1)  # non-contiguous
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert linear.set_cpu_linear("blas") == "blas"
    with torch.inference_mode():
        blas = layer(x)
    assert torch.equal(blas, F.linear(x, layer.weight, layer.bias))
    assert linear.onednn_available(), "the PyPI torch wheels ship oneDNN"
    assert linear.set_cpu_linear("onednn") == "onednn"
    with torch.inference_mode():
        fast = layer(x)
    assert fast.shape == blas.shape == (50, 3, 2048) and fast.dtype == torch.float32
    # the same float32 product summed in another order: within a few float32 roundings of the exact one
    assert (fast.double() - exact).abs().max().item() < 1e-4
    assert (blas.double() - exact).abs().max().item() < 1e-4


def test_autograd_and_other_dtypes_take_f_linear(restore_path) -> None:
    layer = linear.Linear(16, 8)
    linear.set_cpu_linear("onednn")
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()  # differentiable: oneDNN's op is only used with autograd off
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        half = layer.to(torch.bfloat16)(x.detach().bfloat16())
        assert torch.equal(half, F.linear(x.detach().bfloat16(), layer.weight, layer.bias))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.07)])
def test_fused_gelu_is_the_unfused_formula_within_rounding_and_blas_is_exactly_unfused(
        restore_path, dtype, tolerance) -> None:
    layer = _layer().to(dtype)
    x = torch.randn(2, 50, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    exact = F.gelu(F.linear(x.double(), layer.weight.double(), layer.bias.double()), approximate="tanh")
    with torch.inference_mode():
        linear.set_cpu_linear("blas")
        unfused = linear.linear_gelu_tanh(layer, x)
        linear.set_cpu_linear("onednn")
        fused = linear.linear_gelu_tanh(layer, x)
    assert torch.equal(unfused, F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh"))
    assert fused.dtype == dtype and fused.shape == (2, 50, 2048)
    assert (fused.double() - exact).abs().max().item() < tolerance  # bf16: a few ulps at |y| ~ 8
    if linear.fused_gelu_available(dtype):  # bf16 really took the fused kernel (rounded once, not twice)
        assert not torch.equal(fused, unfused) or dtype == torch.float32
    else:  # no bf16 kernel in this CPU's oneDNN: the unfused formula
        assert torch.equal(fused, unfused)
    x.requires_grad_(True)
    assert linear.linear_gelu_tanh(layer.float().requires_grad_(True), x.float()).requires_grad


def test_the_fused_kernel_probe_tells_the_truth_and_an_unbuildable_dtype_falls_back(restore_path,
                                                                                  monkeypatch) -> None:
    layer = _layer().to(torch.bfloat16)
    x = torch.randn(2, 50, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    try:  # what this CPU's oneDNN really does with a bf16 linear+GELU
        with torch.inference_mode():
            torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "gelu", [], "tanh")
        buildable = True
    except RuntimeError:
        buildable = False
    assert linear.fused_gelu_available(torch.bfloat16) == buildable
    assert linear.fused_gelu_available(torch.float32)
    monkeypatch.setitem(linear._fused_works, torch.bfloat16, False)  # as on a CPU without bf16 instructions
    linear.set_cpu_linear("onednn")
    with torch.inference_mode():
        got = linear.linear_gelu_tanh(layer, x)
    assert torch.equal(got, F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh"))


def test_unknown_path_is_refused() -> None:
    with pytest.raises(ValueError, match="onednn"):
        linear.set_cpu_linear("cublas")


def test_dit_uses_it_and_keeps_checkpoint_names() -> None:
    dit = DiT(ModelArgs.tiny().flow.dit)
    block = dit.blocks[0]
    assert isinstance(block.attn.to_q, linear.Linear) and isinstance(block.mlp.fc1, linear.Linear)
    names = set(dit.state_dict())
    assert {"blocks.0.attn.to_q.weight", "blocks.0.mlp.fc1.bias", "in_proj.weight"} <= names
