"""The encoder's caches of every open stream in fixed tensors, so that a decode step's encoder pass has
static shapes, as the estimator's have over `lanes.Lanes` (which owns one of these, lane for lane).

What the reference keeps of a stream's conformer caches after each chunk (`flow.trim_cache`: the first P
and the last `tail` entries of their time axis, P the prompt's mel frames), in frames:
    first stage (the `num_blocks` layers, token rate): the first K1 = (P + tail) / 2. That axis holds
        them tiled twice ([c | c], `encoder.py`), so the trim keeps a head of c: the prompt's frames and
        the first ones generated; from then on every chunk attends to that fixed set and its own frames
    second stage (the `num_up_blocks` layers, mel rate): the first P and the last `tail`, K2 = P + tail
        in all: the prompt and a window that slides with every chunk
    conv: the pre-lookahead conv's last 2 input frames and the upsample conv's last 4, [C, 6]
Here each is right-aligned in a buffer of fixed width (frames [K - held, K)), so a step's keys are
[buffer | new frames] with the padding on the left (every relative distance kept) and a key mask:
    first  [n1, L, H, K1, 2 d_k]     second [n2, L, H, K2, 2 d_k]     cnn [L, C, 6]
How many frames a lane holds (`Lane.encoded`) follows the reference's rule by arithmetic on the host
(`EncoderLanes.held_after`). A step's plan carries it with the chunk's tokens, one int row per lane:
    [n_in, last, held first, held second, tokens (T_in, zeros past n_in)]
`EncoderStep.of(plan)` builds every mask and index from it on the device; the new buffers are cut from
[buffer | new frames] by one gather per stage and go into the lanes only once the whole step succeeded
(`EncoderLanes.commit`). Not in here: the layers themselves (`encoder.py`), the estimator's caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpu_worker.model.config import EncoderArgs
from gpu_worker.model.encoder import PRE_CONV2_CACHE, ConformerEncoder

PLAN_HEAD = 4  # n_in, last, held first, held second; the tokens follow


@dataclass(frozen=True)
class EncoderShape:
    first_layers: int  # n1
    second_layers: int  # n2
    heads: int  # H
    key_dim: int  # d_k
    channels: int  # C
    conv: int  # 6: the conv caches' frames
    prompt_len: int  # P, mel frames
    tail: int
    up: int
    look: int

    @classmethod
    def of(cls, args: EncoderArgs, prompt_len: int, tail: int) -> EncoderShape:
        if args.up_stride != 2 or (prompt_len + tail) % 2:
            raise ValueError("the reference's cache layout tiles the first stage twice: it needs an "
                             f"upsampling of 2 and an even prompt + tail, not {args.up_stride}, "
                             f"{prompt_len} + {tail}")
        return cls(args.num_blocks, args.num_up_blocks, args.attention_heads,
                   args.output_size // args.attention_heads, args.output_size,
                   PRE_CONV2_CACHE + 2 * args.up_stride, prompt_len, tail, args.up_stride,
                   args.pre_lookahead_len)

    @property
    def first_width(self) -> int:
        return (self.prompt_len + self.tail) // 2  # K1

    @property
    def second_width(self) -> int:
        return self.prompt_len + self.tail  # K2

    def tokens_width(self, frames: int) -> int:
        """T_in: the token columns of a step of `frames` new mel frames (its lookahead included)."""
        return frames // self.up + self.look


class EncoderLanes:
    """The fixed tensors; `Lanes` keeps them in step with its own (grows, moves, starts lanes)."""

    def __init__(self, shape: EncoderShape, *, device: torch.device, dtype: torch.dtype) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        s = shape
        self.first = self._zeros(s.first_layers, 0, s.heads, s.first_width, 2 * s.key_dim)
        self.second = self._zeros(s.second_layers, 0, s.heads, s.second_width, 2 * s.key_dim)
        self.cnn = self._zeros(0, s.channels, s.conv)

    def lane_nbytes(self) -> int:
        s = self.shape
        frames = (s.first_layers * s.first_width + s.second_layers * s.second_width) * s.heads * 2 * s.key_dim
        return (frames + s.channels * s.conv) * self.cnn.element_size()

    def grow(self, size: int) -> None:
        self.first, self.second = (self._grown(t, 1, size) for t in (self.first, self.second))
        self.cnn = self._grown(self.cnn, 0, size)

    def move(self, dst: int, src: int) -> None:
        self.first[:, dst], self.second[:, dst], self.cnn[dst] = (self.first[:, src], self.second[:, src],
                                                                  self.cnn[src])

    def start(self, index: int, cnn: Tensor, att: Tensor) -> tuple[int, int]:
        """A stream's first state from its voice's conformer caches (reference layout: cnn [1, C, 6], att
        [n1 + n2, 1, H, 2 L1, 2 d_k]); returns the frames it holds (first stage, second stage)."""
        s, n1 = self.shape, self.shape.first_layers
        held1, held2 = att.size(3) // 2, att.size(3)
        if held1 > s.first_width or held2 > s.second_width:
            raise ValueError(f"a voice's encoder cache of {held2} frames does not fit lanes built for "
                             f"prompts of {s.prompt_len}")
        self.first[:, index].zero_()
        self.second[:, index].zero_()
        self.first[:, index, :, s.first_width - held1:] = att[:n1, 0, :, :held1]
        self.second[:, index, :, s.second_width - held2:] = att[n1:, 0]
        self.cnn[index] = cnn[0]
        return held1, held2

    def held_after(self, held: tuple[int, int], tokens: int) -> tuple[int, int]:
        """What a lane holds after a chunk of `tokens` new token frames (the reference's trim)."""
        s = self.shape
        return min(held[0] + tokens, s.first_width), min(held[1] + s.up * tokens, s.second_width)

    def plan(self, rows: list[tuple[tuple[int, int], Tensor | None, bool]], frames: int) -> Tensor:
        """One row per lane 0..B-1: (frames held, the chunk's tokens [T] or None, last chunk); a lane
        without a chunk (None) rides along: no new frames, its buffers cut back to themselves."""
        s = self.shape
        plan = torch.zeros(len(rows), PLAN_HEAD + s.tokens_width(frames), dtype=torch.int64)
        for row, (held, tokens, last) in zip(plan, rows, strict=True):
            n_in = 0 if tokens is None else tokens.numel()
            row[0], row[1] = n_in, int(last or tokens is None)
            row[2], row[3] = held
            if tokens is not None:
                row[PLAN_HEAD : PLAN_HEAD + n_in] = tokens
        return plan

    def commit(self, first: Tensor, second: Tensor, cnn: Tensor) -> None:
        """A step's new buffers (`forward_lanes`) into lanes 0..B-1, once every row succeeded."""
        b = cnn.size(0)
        self.first[:, :b].copy_(first)
        self.second[:, :b].copy_(second)
        self.cnn[:b].copy_(cnn)

    def _grown(self, t: Tensor, dim: int, size: int) -> Tensor:
        shape = list(t.shape)
        shape[dim] = max(size, t.size(dim))
        out = self._zeros(*shape)
        out.narrow(dim, 0, t.size(dim)).copy_(t)
        return out

    def _zeros(self, *shape: int) -> Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)


@dataclass(frozen=True)
class EncoderStep:
    """One encoder pass over lanes 0..B-1, every mask and index built on the device from the plan."""

    tokens: Tensor  # [B, T_in] int64
    past_input: Tensor  # [B, T_in] bool: past each row's tokens (a last chunk's lookahead, padding)
    n: Tensor  # [B] int64 valid new token frames (n_in - look, or n_in for a last chunk)
    first_mask: Tensor  # [B, 1, 1, K1 + T] bool
    second_mask: Tensor  # [B, 1, 1, K2 + up T] bool
    first_at: Tensor  # [B, K1] int64: the new first-stage buffer's frames in [buffer | new]
    second_at: Tensor  # [B, K2] int64

    @classmethod
    def of(cls, shape: EncoderShape, plan: Tensor) -> EncoderStep:
        s, device = shape, plan.device
        n_in, last, held1, held2 = plan[:, 0], plan[:, 1], plan[:, 2], plan[:, 3]
        tokens = plan[:, PLAN_HEAD:]
        t_in = tokens.size(1)
        n = n_in - s.look * (1 - last)
        k1, k2, m = s.first_width, s.second_width, s.up * n
        first_keys = torch.arange(k1 + t_in - s.look, device=device)
        second_keys = torch.arange(k2 + s.up * (t_in - s.look), device=device)
        j1, j2 = torch.arange(k1, device=device), torch.arange(k2, device=device)
        # the first stage appends until it holds K1 frames; the second keeps [:P] and the last `tail`
        first_at = torch.minimum(n, k1 - held1)[:, None] + j1
        trimmed = torch.where(j2 < s.prompt_len, (k2 - held2)[:, None] + j2,
                              (k2 + m - s.tail - s.prompt_len)[:, None] + j2)
        second_at = torch.where((held2 + m > k2)[:, None], trimmed, m[:, None] + j2)
        return cls(tokens, torch.arange(t_in, device=device) >= n_in[:, None], n,
                   _span(first_keys, k1 - held1, k1 + n), _span(second_keys, k2 - held2, k2 + m),
                   first_at, second_at)

    def cut(self, new: Tensor, at: Tensor) -> Tensor:
        """[layers, B, H, K + T, 2 d_k] -> the frames `at` [B, K] of each row: [layers, B, H, K, 2 d_k]."""
        index = at[None, :, None, :, None].expand(new.size(0), -1, new.size(2), -1, new.size(4))
        return new.gather(3, index)


def _span(keys: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Keys [lo_i, hi_i) of each row: [B, 1, 1, K]."""
    return ((keys >= lo[:, None]) & (keys < hi[:, None]))[:, None, None, :]


def forward_lanes(enc: ConformerEncoder, x: Tensor, step: EncoderStep, lanes: EncoderLanes
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The encoder over lanes 0..B-1: x [B, T_in, C_in] (embedded tokens) -> h [B, up T, C] (row i valid
    up to up n_i) and the rows' new buffers: first [n1, B, H, K1, 2 d_k], second, cnn [B, C, 6]. The same
    layers as `ConformerEncoder.forward_chunks`, every shape fixed by (B, T_in) and the lanes' widths."""
    b, s = x.size(0), lanes.shape
    x = enc.embed(x).masked_fill(step.past_input[..., None], 0.0)
    cnn = lanes.cnn[:b]
    x, pre_cache = enc.pre_lookahead_layer(x, cnn[..., :PRE_CONV2_CACHE], step.n)
    x, first = enc._layers(enc.encoders, x, lanes.first[:, :b], s.first_width, step.first_mask)
    h, up_cache = enc.up_layer(x.transpose(1, 2), cnn[..., PRE_CONV2_CACHE:], step.n * s.up)
    x, second = enc._layers(enc.up_encoders, enc.up_embed(h.transpose(1, 2)), lanes.second[:, :b],
                            s.second_width, step.second_mask)
    return (enc.after_norm(x), step.cut(first, step.first_at), step.cut(second, step.second_at),
            torch.cat([pre_cache, up_cache], dim=2))
