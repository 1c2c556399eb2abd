"""Token encoder of the flow model: the released UpsampleConformerEncoderV2, batch-first.

    embeddings [B, T, C] -> linear embed -> pre-lookahead convs (3 tokens ahead) -> `num_blocks`
    conformer layers -> nearest x2 upsample + causal conv -> linear embed -> `num_up_blocks` conformer
    layers -> LayerNorm -> [B, 2 (T - 3), C]

Conformer layers are pre-norm self-attention with relative positions (ESPnet style, learnt biases u/v)
followed by a swish feed-forward; there is no convolution module.

Streaming (`forward_chunk`) keeps two caches per stream, laid out exactly as the reference so that its
trimming rule (keep the first `prompt_len` and the last 100 frames along time) applies unchanged:
    cnn_cache: [B, C, 6]  = [pre-lookahead conv2 input (2 frames) | upsample conv input (4 frames)]
    att_cache: [num_blocks + num_up_blocks, B, H, 2 L, 2 d_k]  (keys | values on the last dim, oldest
               frame first). A first-stage layer has L cached frames; it stores them tiled twice along
               time ([c | c]) and reads back the first half, so every layer's cache has 2 L frames.
Relative positions count keys as contiguous: a cached frame at index j sits at position j.

Not in here: token embedding and the projection to mel (`flow.py`), padding masks (all rows of one call
have the same length; the flow runs the encoder one stream at a time).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.model.config import EncoderArgs

EMBED_NORM_EPS = 1e-5  # embed / up_embed / after_norm LayerNorms (the layers' own norms use args eps)
PRE_CONV2_CACHE = 2  # frames of pre-lookahead conv2 context (kernel 3)


def rel_pos_table(n_keys: int, n_queries: int, dim: int, device: torch.device) -> Tensor:
    """Sinusoids for relative positions n_keys - 1 down to -(n_queries - 1): [n_keys + n_queries - 1, dim].

    Row c holds position r = n_keys - 1 - c as (sin(r w_0), cos(r w_0), sin(r w_1), ...), the ESPnet
    table; with queries being the last `n_queries` of `n_keys` positions, every needed r is present.
    """
    pos = torch.arange(n_keys - 1, -n_queries, -1, dtype=torch.float32, device=device)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / dim))
    angle = pos * freq  # [P, dim / 2]
    return torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)


def rel_shift(scores: Tensor, n_keys: int) -> Tensor:
    """Picks, for query i and key j, the column of relative position (n_keys - T + i) - j.

    scores: [B, H, T, n_keys + T - 1] against `rel_pos_table` rows -> [B, H, T, n_keys].
    """
    b, h, t, _ = scores.shape
    q_idx = torch.arange(t, device=scores.device)[:, None]
    k_idx = torch.arange(n_keys, device=scores.device)[None, :]
    column = k_idx + (t - 1) - q_idx  # [T, n_keys]
    return scores.gather(-1, column.expand(b, h, t, n_keys))


class RelPositionAttention(nn.Module):
    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head, self.d_k = n_head, dim // n_head
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))

    def forward(self, x: Tensor, pos: Tensor, cache: Tensor | None) -> tuple[Tensor, Tensor]:
        # x: [B, T, C]; pos: [L + T - 1, C] (rel_pos_table); cache: [B, H, Lc, 2 d_k]; L = Lc + T
        b, t, c = x.shape
        q = self.linear_q(x).view(b, t, self.n_head, self.d_k)
        k = self.linear_k(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        if cache is not None:
            k = torch.cat([cache[..., : self.d_k], k], dim=2)
            v = torch.cat([cache[..., self.d_k :], v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)  # [B, H, L, 2 d_k]
        p = self.linear_pos(pos).view(-1, self.n_head, self.d_k).transpose(0, 1)  # [H, L + T - 1, d_k]
        content = (q + self.pos_bias_u).transpose(1, 2) @ k.transpose(-2, -1)  # [B, H, T, L]
        position = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)  # [B, H, T, L + T - 1]
        scores = (content + rel_shift(position, k.size(2))) / math.sqrt(self.d_k)
        out = torch.softmax(scores, dim=-1) @ v  # [B, H, T, d_k]
        return self.linear_out(out.transpose(1, 2).reshape(b, t, c)), new_cache


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        dim = args.output_size
        self.self_attn = RelPositionAttention(dim, args.attention_heads)
        self.feed_forward = FeedForward(dim, args.linear_units)
        self.norm_ff = nn.LayerNorm(dim, eps=args.layer_norm_eps)
        self.norm_mha = nn.LayerNorm(dim, eps=args.layer_norm_eps)

    def forward(self, x: Tensor, pos: Tensor, cache: Tensor | None) -> tuple[Tensor, Tensor]:
        # x: [B, T, C] -> [B, T, C], new cache [B, H, Lc + T, 2 d_k]
        h, new_cache = self.self_attn(self.norm_mha(x), pos, cache)
        x = x + h
        return x + self.feed_forward(self.norm_ff(x)), new_cache


class LinearEmbed(nn.Module):
    """Linear + LayerNorm, scaled by sqrt(C) as the ESPnet relative positional encoding does."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(dim_in, dim), nn.LayerNorm(dim, eps=EMBED_NORM_EPS))
        self.scale = math.sqrt(dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.scale


class PreLookahead(nn.Module):
    """conv1 sees `look` frames ahead, conv2 (k=3) is causal; residual around both."""

    def __init__(self, dim: int, look: int):
        super().__init__()
        self.look = look
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=look + 1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=PRE_CONV2_CACHE + 1)

    def forward(self, x: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, T, C] incl. `look` lookahead frames; cache: [B, C, 2] -> [B, T - look, C], [B, C, 2]
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)))  # [B, C, T - look]
        h = torch.cat([cache, h], dim=2)
        new_cache = h[..., -PRE_CONV2_CACHE:]
        return self.conv2(h).transpose(1, 2) + x[:, : -self.look], new_cache


class Upsample(nn.Module):
    """Nearest-neighbour upsampling followed by a causal conv of kernel 2 * stride + 1."""

    def __init__(self, dim: int, stride: int, scale_factor: float):
        super().__init__()
        self.stride, self.scale_factor = stride, scale_factor
        self.conv = nn.Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, C, T]; cache: [B, C, 2 stride] -> [B, C, stride T], new cache
        h = F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")
        h = torch.cat([cache, h], dim=2)
        return self.conv(h), h[..., -2 * self.stride :]


class ConformerEncoder(nn.Module):
    def __init__(self, args: EncoderArgs):
        super().__init__()
        self.args = args
        dim = args.output_size
        self.embed = LinearEmbed(args.input_size, dim)
        self.pre_lookahead_layer = PreLookahead(dim, args.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerLayer(args) for _ in range(args.num_blocks))
        self.up_layer = Upsample(dim, args.up_stride, args.up_scale_factor)
        self.up_embed = LinearEmbed(args.input_size, dim)
        self.up_encoders = nn.ModuleList(ConformerLayer(args) for _ in range(args.num_up_blocks))
        self.after_norm = nn.LayerNorm(dim, eps=EMBED_NORM_EPS)

    @property
    def cnn_cache_len(self) -> int:
        return PRE_CONV2_CACHE + 2 * self.args.up_stride

    def forward(self, x: Tensor) -> Tensor:
        """Whole utterance, full attention, zeros as the last frames' lookahead: [B, T, C] -> [B, 2T, C]."""
        return self.forward_chunk(x, None, None, last_chunk=True)[0]

    def forward_chunk(
        self, x: Tensor, cnn_cache: Tensor | None, att_cache: Tensor | None, last_chunk: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One chunk of a stream (caches None for its first chunk).

        x: [B, T, C_in] embeddings whose last `pre_lookahead_len` frames are lookahead, unless
        `last_chunk` (then zeros are appended as lookahead). Returns h [B, stride T', C] with
        T' = T - lookahead (T if last), and the new caches (layouts in the module docstring).
        """
        b, dim = x.size(0), self.args.output_size
        if cnn_cache is None:
            cnn_cache = x.new_zeros(b, dim, self.cnn_cache_len)
        n_first = len(self.encoders)
        cached = 0 if att_cache is None else att_cache.size(3) // 2  # first-stage frames L
        x = self.embed(x)
        if last_chunk:
            x = F.pad(x, (0, 0, 0, self.args.pre_lookahead_len))
        x, pre_cache = self.pre_lookahead_layer(x, cnn_cache[..., :PRE_CONV2_CACHE])
        first = None if att_cache is None else att_cache[:n_first, ..., :cached, :]
        x, first_caches = self._layers(self.encoders, x, first, cached)
        h, up_cache = self.up_layer(x.transpose(1, 2), cnn_cache[..., PRE_CONV2_CACHE:])
        second = None if att_cache is None else att_cache[n_first:]
        x, second_caches = self._layers(self.up_encoders, self.up_embed(h.transpose(1, 2)), second,
                                        cached * self.args.up_stride)
        new_att = torch.cat([torch.cat([first_caches, first_caches], dim=3), second_caches], dim=0)
        return self.after_norm(x), torch.cat([pre_cache, up_cache], dim=2), new_att

    @staticmethod
    def _layers(layers: nn.ModuleList, x: Tensor, caches: Tensor | None, cached: int
                ) -> tuple[Tensor, Tensor]:
        # x: [B, T, C]; caches: [n_layers, B, H, cached, 2 d_k] -> x, [n_layers, B, H, cached + T, 2 d_k]
        pos = rel_pos_table(cached + x.size(1), x.size(1), x.size(2), x.device).to(x.dtype)
        new_caches = []
        for i, layer in enumerate(layers):
            x, new_cache = layer(x, pos, None if caches is None else caches[i])
            new_caches.append(new_cache)
        return x, torch.stack(new_caches)
