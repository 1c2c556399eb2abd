"""Attention in parts (`gpu_worker.model.attention`): the parts merged by their log-sum-exp are the
attention over all the keys, whichever kernel computed them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.model import attention
from gpu_worker.model.attention import attend, fused_available, merge


def _qkv(keys: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 2, 7, 16, generator=g).to(dtype)
    k = torch.randn(3, 2, keys, 16, generator=g).to(dtype)
    v = torch.randn(3, 2, keys, 16, generator=g).to(dtype)
    mask = torch.rand(3, 1, 7, keys, generator=g) > 0.4
    mask[..., 0] = True  # every query sees at least one key overall
    return q, k, v, mask


@pytest.mark.parametrize("split", [1, 9, 20])
def test_two_parts_merged_equal_one_attention_over_all_keys(split: int) -> None:
    q, k, v, mask = _qkv(24)
    whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    parts = [attend(q, k[..., :split, :], v[..., :split, :], mask[..., :split]),
             attend(q, k[..., split:, :], v[..., split:, :], mask[..., split:])]
    assert (merge(parts) - whole).abs().max() < 1e-6


def test_a_part_a_query_cannot_see_adds_nothing_and_a_lone_part_is_returned_as_it_is() -> None:
    q, k, v, mask = _qkv(12)
    blind = torch.zeros_like(mask)
    out, lse = attend(q, k, v, blind)
    assert torch.isinf(lse).all() and not out.any()  # no NaN from an all-masked row
    alone = attend(q, k, v, mask)
    assert torch.equal(merge([alone, (out, lse)]), alone[0])  # exactly, not just closely
    assert torch.equal(merge([alone]), alone[0])


def test_the_fused_kernel_and_the_written_out_arithmetic_agree(monkeypatch) -> None:
    q, k, v, mask = _qkv(30, seed=3)
    assert fused_available(q.device, q.dtype)  # a CPU's fused kernel: what SDPA itself runs there
    fused = attend(q, k, v, mask)
    monkeypatch.setitem(attention._FUSED, ("cpu", torch.float32), False)
    written = attend(q, k, v, mask)
    assert (fused[0] - written[0]).abs().max() < 1e-5 and (fused[1] - written[1]).abs().max() < 1e-5
    assert torch.equal(fused[0], F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_bf16_parts_merge_close_to_float32() -> None:
    q, k, v, mask = _qkv(24, seed=5)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    out = merge([attend(qb, kb[..., :10, :], vb[..., :10, :], mask[..., :10]),
                 attend(qb, kb[..., 10:, :], vb[..., 10:, :], mask[..., 10:])])
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 5e-2


CALLS: list[tuple[int, ...]] = []


def efficient_attention_stand_in(q, k, v, bias, compute_log_sumexp):
    """CUDA's `_scaled_dot_product_efficient_attention` as it behaves (attention.cu): the bias read with
    rows aligned to 16 elements, and the log-sum-exp [B, H, T rounded up to 32] with the rows past T
    unwritten (here: NaN, so reading them shows)."""
    assert compute_log_sumexp and q.dim() == 4
    CALLS.append(tuple(q.shape))
    assert bias is None or (bias.stride(-2) % 16 == 0 and bias.dtype == q.dtype), "misaligned bias"
    scores = (q @ k.transpose(-2, -1)).float() / q.size(-1) ** 0.5 + (0 if bias is None else bias.float())
    lse = torch.logsumexp(scores, dim=-1)
    padded = torch.full((*lse.shape[:-1], -(-lse.size(-1) // 32) * 32), float("nan"))
    padded[..., : lse.size(-1)] = lse
    out = (torch.softmax(scores, dim=-1).to(v.dtype) @ v).to(q.dtype)
    return out, padded, torch.empty(()), torch.empty(())


@pytest.fixture
def cuda_kernel_on_the_cpu(monkeypatch):
    """The CUDA branch of the fused attention (`_cuda_kernel`) driven on CPU tensors with the stand-in."""
    monkeypatch.setattr(attention, "EFFICIENT_ATTENTION", efficient_attention_stand_in)
    monkeypatch.setitem(attention.KERNELS, "cpu", attention._cuda_kernel)
    monkeypatch.setattr(attention, "_FUSED", {})


def test_the_start_up_probe_accepts_cudas_fused_kernel_whose_lse_is_padded(cuda_kernel_on_the_cpu) -> None:
    """Issue 41, finding 1: the probe compared a [1, 2, 32] log-sum-exp with [1, 2, 3], raised, and every
    DiT attention ran the written-out float32 arithmetic for the life of the worker."""
    assert fused_available(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("queries", [7, 40])  # within the first block of 32, and past it
def test_cudas_fused_kernel_gives_the_written_out_attention_and_its_lse(cuda_kernel_on_the_cpu,
                                                                        queries: int) -> None:
    g = torch.Generator().manual_seed(queries)
    q = torch.randn(2, 2, queries, 16, generator=g)
    k, v = torch.randn(2, 2, 21, 16, generator=g), torch.randn(2, 2, 21, 16, generator=g)
    mask = torch.rand(1, 1, queries, 21, generator=g) > 0.5
    mask[..., 0, :] = False  # a query with no key: out 0, lse -inf
    CALLS.clear()
    fused = attend(q, k, v, mask)
    assert CALLS[-1] == tuple(q.shape)  # the fused kernel ran (not the written-out fallback)
    assert fused[1].shape == (2, 2, queries) and not fused[1].isnan().any()
    written = attention._written_out(q, k, v, mask)
    seen = mask.any(-1).expand(2, 2, queries)
    assert torch.isinf(fused[1][~seen]).all() and not fused[0][~seen].any()
    assert (fused[0][seen] - written[0][seen]).abs().max() < 1e-5
    assert (fused[1][seen] - written[1][seen]).abs().max() < 1e-5
