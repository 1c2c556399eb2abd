"""Attention in parts: each part's output and log-sum-exp, and their exact merge.

Softmax attention over keys split into parts K = K_1 | K_2 | ... is, per query,
    out = sum_p out_p * exp(lse_p - lse),   lse = logsumexp_p(lse_p),
with out_p, lse_p the attention and the log-sum-exp of the scores over part p alone. The DiT uses it to
read a voice's shared prompt frames where they are (one part per voice, every row of that voice at once)
beside each row's own frames (another part), instead of copying the shared frames next to every row.

    attend(q, k, v, mask) -> (out [.., T, D], lse [.., T] float32)   one part; mask [.., T, K] bool
    merge_pair(a, b)      -> (out, lse)                              two parts combined:
                             out_a + (out_b - out_a) sigmoid(lse_b - lse_a), lse = logaddexp
    merge(parts)          -> out                                     any number of parts, pair by pair
A query with no key in a part (every key masked) gets lse = -inf and out = 0 there, so it adds nothing.

The kernels: on a CPU, the fused flash-attention kernel that `scaled_dot_product_attention` itself runs
there (it returns the log-sum-exp too; the output is the same bits as SDPA's); on CUDA, the
memory-efficient kernel with `compute_log_sumexp` (its log-sum-exp comes padded along the queries to a
multiple of 32 and is cut to them); elsewhere (or for a dtype a kernel refuses) the same
arithmetic written out. `fused_available` tries a kernel once per device and dtype and falls back when it
fails or disagrees. The CUDA branch has not run on a device yet (no GPU was lent when it was written).
Imports: torch and math only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

_FUSED: dict[tuple[str, torch.dtype], bool] = {}


def _bias(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as an additive one (0 / -inf) in `dtype`; an additive mask as it is, in `dtype`."""
    if mask.is_floating_point():
        return mask.to(dtype)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def _written_out(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))
    if mask is not None and mask.is_floating_point():
        scores = scores + mask.float()
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return (weights.to(v.dtype) @ v), lse


def _cpu_kernel(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias)
    return out, lse.float()


# CUDA's memory-efficient attention (the kernel SDPA picks for an arbitrary mask); a name, so the tests can
# hand `_cuda_kernel` a stand-in that behaves as it does
EFFICIENT_ATTENTION = torch.ops.aten._scaled_dot_product_efficient_attention


def _cuda_kernel(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    if bias is not None:  # the kernel reads the bias [B, H, T, K] with rows aligned to 16 elements, as
        keys = bias.size(-1)  # SDPA hands it over: pad the storage, keep the logical width
        bias = F.pad(bias, (0, -keys % 16))[..., :keys].expand(q.size(0), q.size(1), q.size(2), keys)
    out, lse, _, _ = EFFICIENT_ATTENTION(q, k, v, bias, True)
    # its log-sum-exp is [B, H, T rounded up to a multiple of 32] (kAlignLSE: the backward's block), the
    # rows past T unwritten
    return out, lse[..., : q.size(-2)].float()


KERNELS = {"cpu": _cpu_kernel, "cuda": _cuda_kernel}


def _fused(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    bias = None if mask is None else _bias(mask, q.dtype)
    return KERNELS[q.device.type](q, k, v, bias)


def fused_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernel runs for this device and dtype here: tried once (a tiny problem) and
    compared with the written-out arithmetic."""
    key = (device.type, dtype)
    if key not in _FUSED:
        ok = device.type in KERNELS
        if ok:
            try:
                g = torch.Generator(device="cpu").manual_seed(0)
                q, k, v = (torch.randn(1, 2, 3, 8, generator=g).to(device, dtype) for _ in range(3))
                mask = torch.tensor([[True, False, True]] * 3, device=device)[None, None]
                out, lse = _fused(q, k, v, mask)
                ref, ref_lse = _written_out(q, k, v, mask)
                ok = bool(torch.allclose(lse, ref_lse, atol=1e-2) and torch.allclose(out.float(), ref.float(),
                                                                                      atol=1e-2))
            except RuntimeError:
                ok = False
        _FUSED[key] = ok
    return _FUSED[key]


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, *,
           every_query_sees_a_key: bool = False) -> tuple[Tensor, Tensor]:
    """q [.., T, D], k and v [.., K, D], mask [.., T, K] (bool, True: attend; or additive, 0 / -inf;
    broadcast over the leading dims)
    -> out [.., T, D] in q's dtype (zeros where a query has no key) and lse [.., T] in float32 (-inf
    there). 4-D inputs take the fused kernel where it runs. `every_query_sees_a_key`: the caller knows
    the mask leaves each query a key, so nothing needs setting right (saves two passes)."""
    if mask is not None and q.dim() == 4 and fused_available(q.device, q.dtype):
        out, lse = _fused(q, k, v, mask.expand(q.size(0), -1, -1, -1) if mask.size(0) == 1 else mask)
    elif mask is None and q.dim() == 4 and fused_available(q.device, q.dtype):
        out, lse = _fused(q, k, v, None)
    else:
        out, lse = _written_out(q, k, v, mask)
    if mask is None or every_query_sees_a_key:
        return out, lse
    # a query with no key: the fused kernels leave lse 0 there, which would weigh it in a merge
    empty = ~(mask > float("-inf") if mask.is_floating_point() else mask).any(dim=-1)
    return out.masked_fill(empty[..., None], 0.0), lse.masked_fill(empty, float("-inf"))


def merge_pair(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """Two parts over disjoint keys of the same queries -> their union's (out, lse), out in a's dtype.

    exp(lse_b - lse) = sigmoid(lse_b - lse_a): one weight, computed in float32; a part with no key
    (lse -inf) gets weight 0, and the other part's output comes back unchanged."""
    (out_a, lse_a), (out_b, lse_b) = a, b
    weight = torch.sigmoid(lse_b - lse_a.masked_fill(torch.isinf(lse_a) & torch.isinf(lse_b), 0.0))
    out = torch.lerp(out_a.float(), out_b.float(), weight[..., None]).to(out_a.dtype)
    return out, torch.logaddexp(lse_a, lse_b)


def merge(parts: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """[(out_p, lse_p), ...] over disjoint key sets of the same queries -> the attention over all of
    them (in the first output's dtype)."""
    acc = parts[0]
    for part in parts[1:]:
        acc = merge_pair(acc, part)
    return acc[0]
