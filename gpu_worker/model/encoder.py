"""Token encoder of the flow model: the released UpsampleConformerEncoderV2, batch-first.

    embeddings [B, T, C] -> linear embed -> pre-lookahead convs (3 tokens ahead) -> `num_blocks`
    conformer layers -> nearest x2 upsample + causal conv -> linear embed -> `num_up_blocks` conformer
    layers -> LayerNorm -> [B, 2 (T - 3), C]

Conformer layers are pre-norm self-attention with relative positions (ESPnet style, learnt biases u/v)
followed by a swish feed-forward; there is no convolution module.

Streaming (`forward_chunk`, one stream) keeps two caches per stream, laid out exactly as the reference so
that its trimming rule (keep the first `prompt_len` and the last 100 frames along time) applies unchanged:
    cnn_cache: [B, C, 6]  = [pre-lookahead conv2 input (2 frames) | upsample conv input (4 frames)]
    att_cache: [num_blocks + num_up_blocks, B, H, 2 L, 2 d_k]  (keys | values on the last dim, oldest
               frame first). A first-stage layer has L cached frames; it stores them tiled twice along
               time ([c | c]) and reads back the first half, so every layer's cache has 2 L frames.
Relative positions count keys as contiguous: a cached frame at index j sits at position j.

`forward_chunks` runs chunks of B streams at once (the flow encodes a decode step's rows in one pass):
caches are left-padded to the longest, so every key keeps its distance to every query, and new frames
right-padded; attention masks the padding keys, the convs are causal past each row's valid frames and
each row's conv caches are gathered at its own last valid frames. A row's result equals its lone
encoding up to float rounding (shapes change GEMM blocking); one row alone takes no mask.

Not in here: token embedding and the projection to mel (`flow.py`).
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


def _last_frames(h: Tensor, n: Tensor, k: int) -> Tensor:
    """h: [B, C, k + T] = [cache | frames], row i's frames valid up to n[i] -> its last k: [B, C, k]."""
    index = n[:, None] + torch.arange(k, device=h.device)
    return h.gather(2, index[:, None, :].expand(-1, h.size(1), -1))


def _row_caches(first: Tensor, second: Tensor, cached: list[int], n: list[int], up: int) -> list[Tensor]:
    """Each row's new attention cache, cut from the layers' left-padded ones: its cached frames and its
    n_i valid new frames; the first stage tiled twice along time (module docstring)."""
    width, out = max(cached), []
    for i in range(len(cached)):
        f = first[:, i : i + 1, :, width - cached[i] : width + n[i]]
        s = second[:, i : i + 1, :, up * (width - cached[i]) : up * (width + n[i])]
        out.append(torch.cat([torch.cat([f, f], dim=3), s], dim=0))
    return out


def _key_mask(cached: list[int], n: list[int], sizes: Tensor, width: int) -> Tensor | None:
    """Keys [left-padded caches (width) | new frames (right-padded)]: row i attends to its own cached
    frames [width - cached_i, width) and its valid new frames [width, width + n_i). None if all are."""
    if min(cached) == width and min(n) == max(n):
        return None
    key = torch.arange(width + max(n), device=sizes.device)
    cached_t, n_t = sizes
    mask = (key >= width - cached_t[:, None]) & (key < width + n_t[:, None])
    return mask[:, None, None, :]


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

    def forward(self, x: Tensor, pos: Tensor, cache: Tensor | None, key_mask: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        # x: [B, T, C]; pos: [L + T - 1, C] (rel_pos_table); cache: [B, H, Lc, 2 d_k]; L = Lc + T;
        # key_mask: [B, 1, 1, L] True for the keys a row attends to (None: all)
        b, t, c = x.shape
        q = self.linear_q(x).view(b, t, self.n_head, self.d_k)
        k = self.linear_k(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.n_head, self.d_k).transpose(1, 2)
        if cache is not None:
            k = torch.cat([cache[..., : self.d_k], k], dim=2)
            v = torch.cat([cache[..., self.d_k :], v], dim=2)
        new_cache = torch.cat([k, v], dim=-1)  # [B, H, L, 2 d_k]
        p = self.linear_pos(pos).view(-1, self.n_head, self.d_k).transpose(0, 1)  # [H, L + T - 1, d_k]
        # scores = ((q + u) k^T + rel_shift((q + v_bias) p^T)) / sqrt(d_k): the position term is an additive
        # mask of SDPA, which then computes the content term, the softmax and the values in one kernel
        position = (q + self.pos_bias_v).transpose(1, 2) @ p.transpose(-2, -1)  # [B, H, T, L + T - 1]
        bias = rel_shift(position, k.size(2)) / math.sqrt(self.d_k)  # [B, H, T, L]
        if key_mask is not None:
            bias = bias.masked_fill(~key_mask, float("-inf"))
        out = F.scaled_dot_product_attention((q + self.pos_bias_u).transpose(1, 2), k, v, attn_mask=bias)
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

    def forward(self, x: Tensor, pos: Tensor, cache: Tensor | None, key_mask: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        # x: [B, T, C] -> [B, T, C], new cache [B, H, Lc + T, 2 d_k]
        h, new_cache = self.self_attn(self.norm_mha(x), pos, cache, key_mask)
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

    def forward(self, x: Tensor, cache: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, T, C] incl. `look` lookahead frames; cache: [B, C, 2]; n: [B] valid output frames
        # -> [B, T - look, C], new cache [B, C, 2] (each row's last 2 valid frames)
        h = F.leaky_relu(self.conv1(x.transpose(1, 2)))  # [B, C, T - look]
        h = torch.cat([cache, h], dim=2)
        new_cache = _last_frames(h, n, PRE_CONV2_CACHE)
        return self.conv2(h).transpose(1, 2) + x[:, : -self.look], new_cache


class Upsample(nn.Module):
    """Nearest-neighbour upsampling followed by a causal conv of kernel 2 * stride + 1."""

    def __init__(self, dim: int, stride: int, scale_factor: float):
        super().__init__()
        self.stride, self.scale_factor = stride, scale_factor
        self.conv = nn.Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def forward(self, x: Tensor, cache: Tensor, n: Tensor) -> tuple[Tensor, Tensor]:
        # x: [B, C, T]; cache: [B, C, 2 stride]; n: [B] valid output frames (stride x valid input frames)
        # -> [B, C, stride T], new cache (each row's last 2 stride valid frames)
        h = F.interpolate(x, scale_factor=self.scale_factor, mode="nearest")
        h = torch.cat([cache, h], dim=2)
        return self.conv(h), _last_frames(h, n, 2 * self.stride)


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
        h, _, _ = self.forward_chunks(x, [x.size(1)] * x.size(0), [True] * x.size(0), [None] * x.size(0),
                                      [None] * x.size(0))
        return h

    def forward_chunk(
        self, x: Tensor, cnn_cache: Tensor | None, att_cache: Tensor | None, last_chunk: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One chunk of one stream (caches None for its first chunk).

        x: [1, T, C_in] embeddings whose last `pre_lookahead_len` frames are lookahead, unless
        `last_chunk` (then zeros are appended as lookahead). Returns h [1, stride T', C] with
        T' = T - lookahead (T if last), and the new caches (layouts in the module docstring).
        """
        h, (cnn,), (att,) = self.forward_chunks(x, [x.size(1)], [last_chunk], [cnn_cache], [att_cache])
        return h, cnn, att

    def forward_chunks(
        self, x: Tensor, n_in: list[int], last: list[bool], cnn_caches: list[Tensor | None],
        att_caches: list[Tensor | None],
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Chunks of B streams at once; row i's result does not depend on the other rows.

        x: [B, X, C_in], row i's n_in[i] valid frames first (its lookahead included, unless last[i]);
        caches per row as in `forward_chunk` ([1, ...] or None). Returns h [B, stride N, C] with row i
        valid in [:stride n_i] (n_i = n_in[i] - lookahead, or n_in[i] if last), and each row's new caches.
        Caches are left-padded to the longest (rows keep their relative positions), new frames
        right-padded; attention masks the padding, the convs are causal past each row's valid frames.
        """
        look, up, dim = self.args.pre_lookahead_len, self.args.up_stride, self.args.output_size
        n = [t if is_last else t - look for t, is_last in zip(n_in, last, strict=True)]
        cached = [0 if c is None else c.size(3) // 2 for c in att_caches]  # first-stage frames L_i
        sizes = torch.tensor([n_in, cached, n]).to(x.device, non_blocking=True)  # one host -> device copy
        width = max(n) + look
        x = self.embed(F.pad(x, (0, 0, 0, max(0, width - x.size(1))))[:, :width])
        if min(n_in) < width:  # zeros past each row's frames: a last chunk's lookahead, and padding
            x = x.masked_fill((torch.arange(width, device=x.device) >= sizes[0][:, None])[..., None], 0.0)
        cnn = torch.cat([x.new_zeros(1, dim, self.cnn_cache_len) if c is None else c for c in cnn_caches])
        x, pre_cache = self.pre_lookahead_layer(x, cnn[..., :PRE_CONV2_CACHE], sizes[2])
        first = _left_padded([None if c is None else c[: len(self.encoders), ..., : c.size(3) // 2, :]
                              for c in att_caches], max(cached))
        mask = _key_mask(cached, n, sizes[1:], max(cached))
        x, first_new = self._layers(self.encoders, x, first, max(cached), mask)
        h, up_cache = self.up_layer(x.transpose(1, 2), cnn[..., PRE_CONV2_CACHE:], sizes[2] * up)
        second = _left_padded([None if c is None else c[len(self.encoders) :] for c in att_caches],
                              max(cached) * up)
        mask = _key_mask([c * up for c in cached], [k * up for k in n], sizes[1:] * up,
                         max(cached) * up)
        x, second_new = self._layers(self.up_encoders, self.up_embed(h.transpose(1, 2)), second,
                                     max(cached) * up, mask)
        new_cnn = torch.cat([pre_cache, up_cache], dim=2)
        return self.after_norm(x), list(new_cnn.split(1)), _row_caches(first_new, second_new, cached, n, up)

    @staticmethod
    def _layers(layers: nn.ModuleList, x: Tensor, caches: Tensor | None, cached: int, mask: Tensor | None
                ) -> tuple[Tensor, Tensor]:
        # x: [B, T, C]; caches: [n_layers, B, H, cached, 2 d_k] -> x, [n_layers, B, H, cached + T, 2 d_k]
        pos = rel_pos_table(cached + x.size(1), x.size(1), x.size(2), x.device).to(x.dtype)
        new_caches = []
        for i, layer in enumerate(layers):
            x, new_cache = layer(x, pos, None if caches is None else caches[i], mask)
            new_caches.append(new_cache)
        return x, torch.stack(new_caches)


def _left_padded(caches: list[Tensor | None], width: int) -> Tensor | None:
    """Per-row caches [n_layers, 1, H, L_i, 2 d_k] (or None: L_i = 0) -> [n_layers, B, H, width, 2 d_k]
    with row i's frames at [width - L_i, width) (so relative positions hold), zeros before them."""
    if width == 0:
        return None
    if all(c is not None and c.size(3) == width for c in caches):
        return torch.cat(caches, dim=1)  # type: ignore[arg-type]
    like = next(c for c in caches if c is not None)
    out = like.new_zeros(like.size(0), len(caches), like.size(2), width, like.size(4))
    for i, c in enumerate(caches):
        if c is not None:
            out[:, i : i + 1, :, width - c.size(3) :] = c
    return out
