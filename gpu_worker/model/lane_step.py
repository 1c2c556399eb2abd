"""One solve over fixed lanes (`lanes.Lanes`), as the CFM's `StepKV`: every mask and index of a decode
step's estimator built on the device from the step's plan (`Lanes.plan`), and the lanes' tensors read as
views, so that the solve has static shapes and reads every state tensor at a fixed address.

    LaneStep.of(lanes, plan, W)   the solve over lanes 0..B-1 with a voice window of W frames
    kv(step), keep, voice(step)   the estimator's own and voice keys per Euler step (views)
    conv(), noise()               the lanes' causal-conv caches and noise frames for this solve
Not in here: the lanes' layout and bookkeeping (`lanes.py`), the Euler loop (`cfm.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gpu_worker.model.dit import GatheredVoice
from gpu_worker.model.lanes import Lanes


def _bias(ok: Tensor, dtype: torch.dtype) -> Tensor:
    """bool [..] -> an additive mask: 0 where True, -inf where False."""
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, float("-inf"))


@dataclass(frozen=True)
class LaneStep:
    """One solve over lanes 0..B-1 (the CFM's `StepKV`), every mask and index built on the device."""

    lanes: Lanes
    n_new: Tensor  # [B] int64
    own_bias: Tensor  # [B, CAP] additive key mask over each lane's slots
    write_at: Tensor  # [2B, H, T, D] int64 (expanded): the slot of each row's new frame t
    noise_at: Tensor  # [B, T, 80] int64 (expanded): each row's noise frames in its lane's window
    voice_index: Tensor  # [B] int64 voice slot of each lane
    voice_bias: Tensor | None  # [2B, 1, 1, W] additive mask over the voice window (None: all of it)
    window: int  # W: the last W of the voice's P frames

    @classmethod
    def of(cls, lanes: Lanes, plan: Tensor, window: int) -> LaneStep:
        """plan: `Lanes.plan`'s tensor on the device; window: `LaneShape.window` of the rows' o."""
        s = lanes.shape
        cap, device, dtype = s.capacity, plan.device, lanes.dtype
        frames = plan.size(1) - 3 - cap
        if not 0 < frames <= s.max_new or window not in (s.tail, s.prompt_len):
            raise ValueError(f"no lane solve of {frames} new frames and a voice window of {window}")
        n_new, done, voice = plan[:, 0], plan[:, 1], plan[:, 2]
        b = n_new.size(0)
        write = plan[:, 3 : 3 + frames].repeat_interleave(2, dim=0)  # [2B, T]: cond and uncond rows
        t = torch.arange(frames, device=device)
        noise_at = (torch.clamp(done, max=s.tail)[:, None] + t)[..., None].expand(b, frames, 80)
        voice_bias = None
        if window == s.prompt_len:  # the head of the prompt still counts for some row
            e = torch.arange(window, device=device)
            ok = (e < s.prompt_len - done[:, None]) | (e >= s.prompt_len - s.tail)
            voice_bias = _bias(ok, dtype).repeat_interleave(2, dim=0)[:, None, None, :]
        return cls(lanes, n_new, _bias(plan[:, 3 + frames :] > 0, dtype),
                   write[:, None, :, None].expand(2 * b, s.heads, frames, s.head_dim),
                   noise_at, voice, voice_bias, window)

    @property
    def rows(self) -> int:
        return self.n_new.size(0)

    def kv(self, step: int) -> Tensor:
        own = self.lanes.own[step, :, : self.rows]  # [depth, B, 2, H, CAP, 2 D]
        return own.reshape(own.size(0), 2 * self.rows, *own.shape[3:])  # a view: B and 2 are adjacent

    def keep(self, step: int, kv: Tensor) -> None:
        pass  # the DiT wrote the new frames into their slots itself (`write_at`)

    def voice(self, step: int) -> list[GatheredVoice]:
        lo = self.lanes.shape.prompt_len - self.window
        return [GatheredVoice(self.voice_index, self.lanes.voices[:, step, ..., lo:, :], self.voice_bias)]

    def conv(self) -> list[Tensor]:
        """Per Euler step: lanes 0..B-1's conv caches [depth, 2B, 2C, 2] (views)."""
        conv = self.lanes.conv[:, :, : self.rows]
        return [c.reshape(c.size(0), 2 * self.rows, *c.shape[3:]) for c in conv]

    def noise(self) -> Tensor:
        """[B, T, 80]: each row's noise frames [offset, offset + T) of its buffer."""
        return self.lanes.noise[: self.rows].gather(1, self.noise_at)
