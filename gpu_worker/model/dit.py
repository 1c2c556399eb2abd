"""DiT velocity estimator of the flow's CFM, batch-first, with per-row masks for mixed batches.

    [x | mu | spk | cond] [B, T, 4 * 80] -> in_proj -> `depth` adaLN-Zero blocks -> final layer -> [B, T, 80]

A block is attention (q/k LayerNorm, no positions), then a causal conv block (conv k3, LayerNorm, Mish,
conv k3), then a tanh-GELU MLP, each modulated by the timestep embedding (the only conditioning in c).

Caches, one set per Euler step (the CFM owns the step dimension):
    conv_cache: [depth, B, 2 hidden, 2]  = [conv1 input (hidden) | conv2 input (hidden)], last 2 frames
    kv:         [depth, B, H, T + Lc, 2 head_dim], keys | values on the last dim. The forward writes the
                new frames' keys/values into [:, :, :, :T] in place and attends over all T + Lc slots;
                the caller puts the cached frames at [T:]. New frames first is the reference's order.
    key_mask:   [B, T + Lc] bool, True for slots a row may attend to (its valid new frames and its own
                cached frames); None means every slot.
    voice:      frames attended to beside kv, in parts merged by their log-sum-exp (`attention.py`):
                `FoldedVoice`, one voice's frames [depth, 2 (cond | uncond), H, S, 2 head_dim] read where
                they are, its rows (or None: every row) folded into the query axis so one call serves
                them; or `GatheredVoice`, a pool of voices' frames [V, depth, 2, H, S, 2 head_dim] and each
                row pair's slot in it, gathered block by block (static shapes: `lanes.py`).
    write_at:   [B, H, T, head_dim] int64: the kv slot of each new frame (None: slots [:T], the new frames
                first); a lane takes a row's new frames in slots past the ones it still reads.
    lengths:    [B] valid new frames per row (queries past it are padding); None means all T.
Padding frames sit after a row's valid frames, so the causal convs and the key mask keep every valid
frame independent of the padding and of the other rows.

Not in here: the Euler loop, CFG doubling, noise, cache trimming.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.model.attention import attend, merge_pair
from gpu_worker.model.config import DiTArgs


class FoldedVoice(NamedTuple):
    """One voice's frames read in place by its rows (`kvcache.BatchKV`)."""

    rows: Tensor | None  # [2 n]: the voice's cond rows, then their uncond twins; None: every row in order
    frames: Tensor  # [depth, 2, H, S, 2 D] (at a block: [2, H, S, 2 D])
    mask: Tensor  # [1, 1, n T, S] bool: row j's query t (at j T + t) may see frame s

    def at(self, block: int) -> FoldedVoice:
        return FoldedVoice(self.rows, self.frames[block], self.mask)


class GatheredVoice(NamedTuple):
    """Each (cond, uncond) row pair's voice frames, gathered from a pool of voices (`lane_step.LaneStep`)."""

    slots: Tensor  # [B / 2] int64: the slot of row pair i (rows 2i, 2i + 1)
    frames: Tensor  # [V, depth, 2, H, S, 2 D] (at a block: [V, 2, H, S, 2 D])
    mask: Tensor | None  # [B, 1, 1, S] additive or bool; None: every frame

    def at(self, block: int) -> GatheredVoice:
        return GatheredVoice(self.slots, self.frames[:, block], self.mask)


VoicePart = FoldedVoice | GatheredVoice

BLOCK_NORM_EPS = 1e-6  # affine-free LayerNorms before each modulated branch
CONV_CACHE = 2  # causal conv kernel 3 -> 2 frames of context
TIME_SCALE = 1000.0


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale) + shift


def block_norm(x: Tensor) -> Tensor:
    return F.layer_norm(x, (x.size(-1),), eps=BLOCK_NORM_EPS)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: Tensor) -> Tensor:
        # t: [N] float32 in [0, 1] -> [N, hidden]; sinusoid of t * 1000 (cos half first) in float32
        half = self.freq_dim // 2
        freq = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        angle = (t.float() * TIME_SCALE)[:, None] * freq[None]
        emb = torch.cat([angle.cos(), angle.sin()], dim=-1)
        return self.mlp(emb.to(next(self.mlp.parameters()).dtype))


class Attention(nn.Module):
    def __init__(self, dim: int, n_head: int, head_dim: int):
        super().__init__()
        self.n_head, self.head_dim = n_head, head_dim
        inner = n_head * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.q_norm = nn.LayerNorm(head_dim)
        self.k_norm = nn.LayerNorm(head_dim)
        self.proj = nn.Linear(inner, dim)

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.size(0), x.size(1), self.n_head, self.head_dim)  # [B, T, H, D]

    def forward(self, x: Tensor, kv: Tensor, key_mask: Tensor | None, voice: Sequence[VoicePart] = (),
                write_at: Tensor | None = None) -> Tensor:
        # x: [B, T, C]; kv: [B, H, T + Lc, 2 D] (written at [:, :, :T], or at write_at [B, H, T, D]);
        # key_mask: [B, 1, 1, T + Lc] bool or additive
        b, t, _ = x.shape
        d = self.head_dim
        q = self.q_norm(self._heads(self.to_q(x)))  # [B, T, H, D]: the voice part folds rows as a view
        k_new = self.k_norm(self._heads(self.to_k(x))).transpose(1, 2)
        v_new = self._heads(self.to_v(x)).transpose(1, 2)
        if write_at is None:
            kv[:, :, :t, :d], kv[:, :, :t, d:] = k_new, v_new
        else:
            kv[..., :d].scatter_(2, write_at, k_new)
            kv[..., d:].scatter_(2, write_at, v_new)
        k, v = kv[..., :d], kv[..., d:]
        if not voice:  # out: [B, H, T, D]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=key_mask)
            return self.proj(out.transpose(1, 2).reshape(b, t, -1))
        # each row sees its new frames, and each voice's rows at least one of its frames (BatchKV)
        own, lse = attend(q.transpose(1, 2), k, v, key_mask, every_query_sees_a_key=True)
        out = self._with_voice(q, (own.transpose(1, 2), lse.transpose(1, 2)), voice)  # [B, T, H, D]
        return self.proj(out.reshape(b, t, -1))

    @staticmethod
    def _with_voice(q: Tensor, own: tuple[Tensor, Tensor], voice: Sequence[VoicePart]) -> Tensor:
        """q [B, T, H, D]; own: the rows' own part, out [B, T, H, D] and lse [B, T, H]. Each voice part
        against its rows' queries, merged in. A folded voice's rows fold into one query axis (a view of q
        when the voice has every row), so one attention call serves them; a gathered part gives every
        row pair its own voice's frames. -> out [B, T, H, D]."""
        b, t, h, d = q.shape
        out, lse = own
        if any(isinstance(p, FoldedVoice) and p.rows is not None for p in voice):  # written in place
            out, lse = out.clone(), lse.clone()  # below; own may be views of the kernel's outputs
        for part in voice:
            if isinstance(part, GatheredVoice):
                frames = part.frames.index_select(0, part.slots).flatten(0, 1)  # [B, H, S, 2 D]
                o, s = attend(q.transpose(1, 2), frames[..., :d], frames[..., d:], part.mask,
                              every_query_sees_a_key=True)
                out, lse = merge_pair((out, lse), (o.transpose(1, 2), s.transpose(1, 2)))
                continue
            rows, frames, mask = part
            n = b // 2 if rows is None else rows.numel() // 2
            qv = (q if rows is None else q[rows]).reshape(2, n * t, h, d).transpose(1, 2)  # [2, H, n T, D]
            o, s = attend(qv, frames[..., :d], frames[..., d:], mask, every_query_sees_a_key=True)
            folded = (o.transpose(1, 2).reshape(2 * n, t, h, d), s.transpose(1, 2).reshape(2 * n, t, h))
            if rows is None:  # every row of the batch, in order
                out, lse = merge_pair((out, lse), folded)
            else:
                out[rows], lse[rows] = merge_pair((out[rows], lse[rows]), folded)
        return out


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act: nn.Module = nn.GELU(approximate="tanh")  # fused into fc1 on a CPU (accel.onednn)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def causal_conv(conv: nn.Module, x: Tensor, cache: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
    """x: [B, C, T]; cache: [B, C, 2]; last: [B, 2] each row's last 2 valid frames, indexed in [cache | x]."""
    h = torch.cat([cache, x], dim=2)
    new_cache = h.gather(2, last[:, None, :].expand(-1, h.size(1), -1))
    return conv(h), new_cache


class CausalConvBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        # ModuleDict keys are the positions in the released checkpoint's Sequential (transposes between)
        conv1, conv2 = nn.Conv1d(dim, dim, CONV_CACHE + 1), nn.Conv1d(dim, dim, CONV_CACHE + 1)
        self.block = nn.ModuleDict({"1": conv1, "3": nn.LayerNorm(dim), "6": conv2})

    def forward(self, x: Tensor, cache: Tensor, last: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, T, C]; cache: [B, 2 C, 2] -> [B, T, C], new cache [B, 2 C, 2]
        h, cache1 = causal_conv(self.block["1"], x.transpose(1, 2), cache[:, : self.dim], last)
        h = F.mish(self.block["3"](h.transpose(1, 2)))
        h, cache2 = causal_conv(self.block["6"], h.transpose(1, 2), cache[:, self.dim :], last)
        return h.transpose(1, 2), torch.cat([cache1, cache2], dim=1)


class DiTBlock(nn.Module):
    def __init__(self, args: DiTArgs):
        super().__init__()
        dim = args.hidden_size
        self.attn = Attention(dim, args.num_heads, args.head_dim)
        self.mlp = Mlp(dim, int(dim * args.mlp_ratio))
        self.conv = CausalConvBlock(dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 9 * dim))

    def forward(
        self, x: Tensor, c: Tensor, conv_cache: Tensor, kv: Tensor, key_mask: Tensor | None, last: Tensor,
        voice: Sequence[VoicePart] = (), write_at: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        # x: [B, T, C]; c: [B or 1, 1, C] -> [B, T, C], new conv cache [B, 2 C, 2]
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
         shift_conv, scale_conv, gate_conv) = self.adaLN_modulation(c).chunk(9, dim=-1)
        x = x + gate_msa * self.attn(modulate(block_norm(x), shift_msa, scale_msa), kv, key_mask, voice,
                                     write_at)
        h, new_conv_cache = self.conv(modulate(block_norm(x), shift_conv, scale_conv), conv_cache, last)
        x = x + gate_conv * h
        x = x + gate_mlp * self.mlp(modulate(block_norm(x), shift_mlp, scale_mlp))
        return x, new_conv_cache


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, out_channels)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(block_norm(x), shift, scale))


class DiT(nn.Module):
    def __init__(self, args: DiTArgs):
        super().__init__()
        self.args = args
        self.t_embedder = TimestepEmbedder(args.hidden_size, args.freq_embed_size)
        self.in_proj = nn.Linear(args.in_channels, args.hidden_size)
        self.blocks = nn.ModuleList(DiTBlock(args) for _ in range(args.depth))
        self.final_layer = FinalLayer(args.hidden_size, args.out_channels)

    def forward(
        self, x: Tensor, t: Tensor, conv_cache: Tensor, kv: Tensor,
        key_mask: Tensor | None = None, lengths: Tensor | None = None, voice: Sequence[VoicePart] = (),
        write_at: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """x: [B, T, in_channels] packed inputs; t: [1] or [B] -> velocity [B, T, out_channels] and the
        new conv cache [depth, B, 2 C, 2]. Caches and masks: module docstring; kv is updated in place.

        With t of shape [1] (what the CFM passes) the time embedding and every adaLN modulation are
        computed once and broadcast, so they are the same bits for a row whatever the batch size.
        """
        b, t_len, _ = x.shape
        if lengths is None:
            lengths = torch.full((b,), t_len, dtype=torch.long, device=x.device)
        last = lengths[:, None] + torch.arange(CONV_CACHE, device=x.device)  # in [cache | x] coordinates
        mask = None if key_mask is None else key_mask[:, None, None, :]
        if mask is not None and mask.dtype == torch.bool and voice:  # attend() would convert it per block
            mask = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        c = self.t_embedder(t)[:, None, :]  # [1 or B, 1, C]
        h = self.in_proj(x)
        new_conv = []
        for i, block in enumerate(self.blocks):
            h, cache = block(h, c, conv_cache[i], kv[i], mask, last, [part.at(i) for part in voice], write_at)
            new_conv.append(cache)
        return self.final_layer(h, c), torch.stack(new_conv)
