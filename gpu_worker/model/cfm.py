"""Conditional flow matching decoder: a fixed-step Euler solve of the DiT velocity with CFG.

    x_0 = noise; for each of N steps on t = 1 - cos(linspace(0, 1, N + 1) pi / 2):
        v = (1 + r) v(x, mu, spk, cond) - r v(x, 0, 0, 0),  x += dt v      (r = inference_cfg_rate)

The conditional and unconditional halves run as one doubled batch: rows [0, B) conditional, [B, 2B)
unconditional, the reference's order, so a row's caches hold [cond, uncond] on their batch dimension;
or, with `pairs=True`, row i's two as rows 2i and 2i + 1 (the lanes' layout, `lanes.py`).

Time and the Euler state x stay in float32 whatever the model's dtype (a bf16 time grid would move
the steps); the estimator sees x in the model's dtype.

Caches are given per Euler step (see `dit.py` for the layouts):
    conv_caches[s]: [depth, 2B, 2 hidden, 2]          -> returned as new_conv [N, depth, 2B, 2 hidden, 2]
    kvs:            a sequence of N tensors [depth, 2B, H, T + Lc, 2 head_dim] (new frames written in
                    place at [:T]; the same buffer may be given for every step when its contents are not
                    needed afterwards), or a `StepKV` that fills one buffer per step and keeps the new
                    frames after it (`kvcache.BatchKV`: the streaming caches without copies), and may
                    hand each voice's shared frames of the step (`voice(step)`), attended to in place;
                    a `StepKV` with a `write_at` index has the DiT write the new frames there instead
                    of at [:T] (`lane_step.LaneStep`: the slots of fixed lanes).

Not in here: the noise buffer (the caller slices it), padding and unpadding of rows, cache trimming.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch import Tensor

from gpu_worker.model.config import FlowArgs
from gpu_worker.model.dit import DiT, VoicePart


def time_span(n_steps: int, device: torch.device) -> Tensor:
    t = torch.linspace(0, 1, n_steps + 1, device=device, dtype=torch.float32)
    return 1 - torch.cos(t * 0.5 * math.pi)


@runtime_checkable
class StepKV(Protocol):
    def kv(self, step: int) -> Tensor:
        """The attention kv the DiT attends over at Euler step `step`: [depth, 2B, H, T + Lc, 2 D]."""
        ...

    def keep(self, step: int, kv: Tensor) -> None:
        """Called after step `step` with the same kv, its new frames written at [..., :T, :]."""
        ...

    def voice(self, step: int) -> Sequence[VoicePart]:
        """Voice frames attended to at step `step` (`dit.DiT.forward`'s `voice`)."""
        ...


def _doubled(a: Tensor, b: Tensor, pairs: bool) -> Tensor:
    """The two halves of the doubled batch: [a | b] along rows, or interleaved (a_0, b_0, a_1, ...)."""
    return torch.stack([a, b], dim=1).flatten(0, 1) if pairs else torch.cat([a, b])


class _PerStep:
    def __init__(self, kvs: Sequence[Tensor]) -> None:
        self.kvs = kvs

    def kv(self, step: int) -> Tensor:
        return self.kvs[step]

    def keep(self, step: int, kv: Tensor) -> None:
        pass

    def voice(self, step: int) -> Sequence[VoicePart]:
        return ()


class CFM(nn.Module):
    def __init__(self, args: FlowArgs):
        super().__init__()
        self.n_steps = args.n_timesteps
        self.cfg_rate = args.inference_cfg_rate
        self.estimator = DiT(args.dit)

    def solve(
        self, noise: Tensor, mu: Tensor, spk: Tensor, cond: Tensor,
        conv_caches: Sequence[Tensor], kvs: Sequence[Tensor] | StepKV,
        key_mask: Tensor | None = None, lengths: Tensor | None = None, *, pairs: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """noise, mu, cond: [B, T, 80]; spk: [B, 80] -> mel [B, T, 80], new conv caches [N, depth, 2B, 2C, 2].

        key_mask [B, T + Lc] (bool or additive) and lengths [B] describe each row (see `dit.py`); they are
        shared by the conditional and unconditional halves. `pairs`: the doubled batch interleaved.
        """
        b, dtype = noise.size(0), mu.dtype
        steps = kvs if isinstance(kvs, StepKV) else _PerStep(kvs)
        write_at = getattr(steps, "write_at", None)
        t_span = time_span(self.n_steps, noise.device)
        spk = spk[:, None, :].expand(-1, mu.size(1), -1)
        fixed = [_doubled(c, torch.zeros_like(c), pairs) for c in (mu, spk, cond)]  # unconditional: zeros
        key_mask = None if key_mask is None else _doubled(key_mask, key_mask, pairs)
        lengths = None if lengths is None else _doubled(lengths, lengths, pairs)
        x, t, dt = noise.float(), t_span[:1], t_span[1] - t_span[0]
        new_conv = []
        for step in range(self.n_steps):
            packed = torch.cat([_doubled(x, x, pairs).to(dtype), *fixed], dim=-1)  # [2B, T, 320]
            kv = steps.kv(step)
            v, conv = self.estimator(packed, t, conv_caches[step], kv, key_mask, lengths, steps.voice(step),
                                     write_at)
            steps.keep(step, kv)
            new_conv.append(conv)
            v_cond, v_uncond = v.float().view(b, 2, *v.shape[1:]).unbind(1) if pairs else v.float().split(b)
            x = x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)
            t = t + dt
            if step < self.n_steps - 1:
                dt = t_span[step + 2] - t
        return x.to(dtype), torch.stack(new_conv)
