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
