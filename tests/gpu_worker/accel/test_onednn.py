"""`gpu_worker.accel.onednn`: the DiT's linears on oneDNN for float32 CPU inference, nn.Linear's
arithmetic elsewhere, switched on a built model and back."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpu_worker.accel import onednn
from gpu_worker.checkpoint.load import random_code2wav
from gpu_worker.model.config import ModelArgs


def _weights(layer: nn.Linear) -> nn.Linear:
    torch.manual_seed(0)
    nn.init.normal_(layer.weight, std=0.05)
    nn.init.normal_(layer.bias, std=0.05)
    return layer.requires_grad_(False)


def test_onednn_path_is_float32_accurate_and_blas_path_is_nn_linear() -> None:
    fast_layer = _weights(onednn.OneDnnLinear(512, 2048))
    plain = _weights(nn.Linear(512, 2048))
    x = torch.randn(3, 50, 512, generator=torch.Generator().manual_seed(1)).transpose(0, 1)  # non-contiguous
    exact = F.linear(x.double(), plain.weight.double(), plain.bias.double())
    with torch.inference_mode():
        blas, fast = plain(x), fast_layer(x)
    assert torch.equal(blas, F.linear(x, plain.weight, plain.bias))
    assert onednn.onednn_available(), "the PyPI torch wheels ship oneDNN"
    assert fast.shape == blas.shape == (50, 3, 2048) and fast.dtype == torch.float32
    # the same float32 product summed in another order: within a few float32 roundings of the exact one
    assert (fast.double() - exact).abs().max().item() < 1e-4
    assert (blas.double() - exact).abs().max().item() < 1e-4


def test_autograd_and_other_dtypes_take_f_linear() -> None:
    layer = onednn.OneDnnLinear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    layer(x).sum().backward()  # differentiable: oneDNN's op is only used with autograd off
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        half = layer.to(torch.bfloat16)(x.detach().bfloat16())
        assert torch.equal(half, F.linear(x.detach().bfloat16(), layer.weight, layer.bias))


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.07)])
def test_fused_gelu_is_the_unfused_formula_within_rounding_and_blas_is_exactly_unfused(dtype,
                                                                                     tolerance) -> None:
    layer = _weights(onednn.OneDnnLinearGelu(512, 2048)).to(dtype)
    x = torch.randn(2, 50, 512, generator=torch.Generator().manual_seed(2)).to(dtype)
    exact = F.gelu(F.linear(x.double(), layer.weight.double(), layer.bias.double()), approximate="tanh")
    with torch.inference_mode():
        unfused = nn.GELU(approximate="tanh")(F.linear(x, layer.weight, layer.bias))  # the blas model's
        fused = layer(x)
    assert fused.dtype == dtype and fused.shape == (2, 50, 2048)
    assert (fused.double() - exact).abs().max().item() < tolerance  # bf16: a few ulps at |y| ~ 8
    if onednn.fused_gelu_available(dtype):  # bf16 really took the fused kernel (rounded once, not twice)
        assert not torch.equal(fused, unfused) or dtype == torch.float32
    else:  # no bf16 kernel in this CPU's oneDNN: the unfused formula
        assert torch.equal(fused, unfused)
    x.requires_grad_(True)
    assert layer.float().requires_grad_(True)(x.float()).requires_grad


def test_the_fused_kernel_probe_tells_the_truth_and_an_unbuildable_dtype_falls_back(monkeypatch) -> None:
    layer = _weights(onednn.OneDnnLinearGelu(512, 2048)).to(torch.bfloat16)
    x = torch.randn(2, 50, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    try:  # what this CPU's oneDNN really does with a bf16 linear+GELU
        with torch.inference_mode():
            torch.ops.mkldnn._linear_pointwise(x, layer.weight, layer.bias, "gelu", [], "tanh")
        buildable = True
    except RuntimeError:
        buildable = False
    assert onednn.fused_gelu_available(torch.bfloat16) == buildable
    assert onednn.fused_gelu_available(torch.float32)
    monkeypatch.setitem(onednn._fused_works, torch.bfloat16, False)  # as on a CPU without bf16 instructions
    with torch.inference_mode():
        got = layer(x)
    assert torch.equal(got, F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh"))


def test_unknown_path_is_refused() -> None:
    with pytest.raises(ValueError, match="onednn"):
        onednn.use_cpu_linear(random_code2wav(ModelArgs.tiny(), 0), "cublas")


def test_a_model_switches_its_dit_linears_and_back_keeping_its_checkpoint_and_its_outputs() -> None:
    model = random_code2wav(ModelArgs.tiny(), 0).eval()
    dit = model.flow.decoder.estimator
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert onednn.cpu_linear_of(model) == "blas"  # as built: plain modules
    x = torch.randn(2, 5, dit.args.in_channels, generator=torch.Generator().manual_seed(4))
    conv = torch.zeros(dit.args.depth, 2, 2 * dit.args.hidden_size, 2)

    def run():
        kv = torch.zeros(dit.args.depth, 2, dit.args.num_heads, 5, 2 * dit.args.head_dim)
        with torch.inference_mode():
            return dit(x, torch.tensor([0.3]), conv, kv)[0]

    plain = run()
    assert onednn.use_cpu_linear(model, "onednn") == "onednn"
    block = dit.blocks[0]
    assert isinstance(block.attn.to_q, onednn.OneDnnLinear)
    assert isinstance(block.mlp.fc1, onednn.OneDnnLinearGelu)
    assert isinstance(block.mlp.act, nn.Identity)  # the GELU is fc1's post-op now
    assert not isinstance(model.flow.encoder_proj, onednn.OneDnnLinear)  # only the DiT is switched
    fast = run()
    assert (fast - plain).abs().max().item() < 1e-4 and not fast.isnan().any()
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in state)
    assert onednn.use_cpu_linear(model, "blas") == "blas"
    assert type(block.attn.to_q) is nn.Linear and type(block.mlp.fc1) is nn.Linear
    assert torch.equal(run(), plain)  # back to the BLAS: the same bits as before the switch
