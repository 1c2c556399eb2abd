"""Flow: speech tokens -> 80-bin mel (Step-Audio 2 token2wav flow), parameter names == released flow.pt.

    inference(tokens [1, T], prompt_tokens [1, Tp], prompt_mel [1, 2 Tp, 80], spk_raw [1, 192], noise)
        -> mel [1, 80, 2 T]: one utterance after its prompt, full attention, no caches
    setup(prompt_tokens [1, Tp + 3], prompt_mel, spk_raw, noise) -> spk [1, 80], FlowCache (reference
        layout: the voice's read-only caches); setup_batch: B voices in one solve
    encode_chunks(tokens: [1, T_i] per row, caches, last_chunks) -> mu [1, T'_i, 80] per row, caches
        (T' = 2 (T - 3), or 2 T for a last chunk): every row in one masked, padded encoder pass
    solve_chunk_batch(mu, spk [B, 80], noise, caches, cond=None) -> mel [B, 80, max T'], new caches
    stream_chunks(...) = encode_chunks, then one solve_chunk_batch; trim_cache(cache, prompt_len) after it
    solve_lanes(mu [B, T, 80], plan [B, 3 + T + CAP], lanes, window) -> mel [B, 80, T], new conv caches:
        the same solve over the fixed tensors of `lanes.Lanes`, every shape static
    step_lanes(tokens_plan [B, 4 + T_in], plan, lanes, window) -> mel, new conv caches, new encoder
        buffers: a decode step's encoder pass over the lanes' encoder caches (`encode_lanes`) and its
        solve, every shape static (the decoder's; a CUDA graph in `accel.flow_graphs`)
Rows of one solve may come from different streams, voices, cache lengths and chunk kinds (first,
continuing, last, even setup rows with a cond): per-row key masks and causal-conv caches keep a row's mel
independent of the other rows (up to float rounding, about 1e-6). A row's noise is its own buffer sliced
at [offset, offset + T'), offset = its estimator cache length before the chunk. The estimator cache is
never copied whole (`kvcache.py`); `FlowCache.reference_estimator_att()` gives the reference's tensor.

FlowCache layouts (H heads, N steps, L cached frames; dim 2 of the estimator's is [cond, uncond]):
    conformer_cnn [1, C_enc, 6], conformer_att [blocks + up_blocks, 1, H, 2 L1, 2 d_k]   (encoder.py)
    estimator_cnn [N, depth, 2, 2 hidden, 2]; estimator_att [N, depth, 2, H, L, 2 head_dim] (reference
    layout, newest chunk first) or estimator_kv (`kvcache.EstimatorKV`)
Call everything under `torch.inference_mode()`. Not in here: drawing the noise, devices, dtypes,
chunking token streams, HiFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.model.cfm import CFM
from gpu_worker.model.config import ATT_CACHE_TAIL, CHUNK_TOKENS, LOOKAHEAD_TOKENS, MEL_PER_TOKEN, FlowArgs
from gpu_worker.model.encoder import ConformerEncoder
from gpu_worker.model.encoder_lanes import EncoderLanes, EncoderStep, forward_lanes
from gpu_worker.model.kvcache import BatchKV, EstimatorKV, Workspace
from gpu_worker.model.lane_step import LaneStep
from gpu_worker.model.lanes import Lanes

CHUNK_FRAMES = MEL_PER_TOKEN * (CHUNK_TOKENS + LOOKAHEAD_TOKENS)  # the most new frames a streaming chunk has


@dataclass(frozen=True)
class FlowCache:
    conformer_cnn: Tensor | None = None
    conformer_att: Tensor | None = None
    estimator_cnn: Tensor | None = None
    estimator_att: Tensor | None = None  # reference layout: a voice's setup cache (None once lean)
    estimator_kv: EstimatorKV | None = None  # the lean estimator cache a solve returns (kvcache.py)

    @property
    def offset(self) -> int:
        """Noise offset of the next chunk: the estimator attention cache length."""
        return len(self.estimator())

    def estimator(self) -> EstimatorKV:
        """The estimator attention cache as a lean view (a reference-layout one as its shared frames)."""
        return self.estimator_kv if self.estimator_kv is not None else EstimatorKV.of(self.estimator_att)

    def reference_estimator_att(self) -> Tensor | None:
        """[N, depth, 2, H, L, 2 D] in the reference's order (a copy, or a stored tensor: do not write)."""
        return self.estimator().reference_layout()

    def materialized(self) -> FlowCache:
        """The same cache in reference layout only (estimator_att set, estimator_kv None)."""
        return replace(self, estimator_att=self.reference_estimator_att(), estimator_kv=None)

    def stream_nbytes(self) -> int:
        """Bytes this cache holds beyond the read-only shared estimator frames (a reference-layout
        estimator_att counts in full: it is shared only while it is a voice's setup cache)."""
        tensors = (self.conformer_cnn, self.conformer_att, self.estimator_cnn, self.estimator_att)
        own = self.estimator_kv.own_nbytes() if self.estimator_kv is not None else 0
        return own + sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _trim(x: Tensor | None, dim: int, keep_head: int, keep_tail: int) -> Tensor | None:
    if x is None or x.size(dim) <= keep_head + keep_tail:
        return x
    return torch.cat([x.narrow(dim, 0, keep_head), x.narrow(dim, x.size(dim) - keep_tail, keep_tail)], dim)


def trim_cache(cache: FlowCache, prompt_len: int, tail: int = ATT_CACHE_TAIL) -> FlowCache:
    """Keeps the first `prompt_len` and the last `tail` frames of both attention caches (reference rule).

    The lean estimator cache is trimmed by bookkeeping alone; the conformer cache (a few MB) is copied."""
    est = cache.estimator_kv
    return replace(cache, conformer_att=_trim(cache.conformer_att, 3, prompt_len, tail),
                   estimator_att=_trim(cache.estimator_att, 4, prompt_len, tail),
                   estimator_kv=None if est is None else est.trimmed(prompt_len, tail))


def _pad_rows(rows: list[Tensor], length: int) -> Tensor:
    # rows: [T_i, C] -> [B, length, C], zeros after each row
    out = rows[0].new_zeros(len(rows), length, rows[0].size(-1))
    for i, row in enumerate(rows):
        out[i, : row.size(0)] = row
    return out


def _noise_rows(noise: list[Tensor], offsets: list[int], lengths: list[int], dtype: torch.dtype
                ) -> list[Tensor]:
    # noise[i]: [1, 80, N] -> [T_i, 80], frames [offset_i, offset_i + T_i) of row i's own buffer
    rows = []
    for z, offset, n in zip(noise, offsets, lengths, strict=True):
        if offset + n > z.size(2):
            raise ValueError(f"a noise buffer of {z.size(2)} frames has no frames {offset}..{offset + n}")
        rows.append(z[0, :, offset : offset + n].t().to(dtype))
    return rows


def _steps(x: Tensor) -> list[Tensor]:
    # per-Euler-step views by indexing: unbind's views may not be written in place outside inference mode
    return [x[s] for s in range(x.size(0))]


class Flow(nn.Module):
    def __init__(self, args: FlowArgs):
        super().__init__()
        self.args = args
        enc = args.encoder
        self.input_embedding = nn.Embedding(args.vocab_size, enc.input_size)
        self.spk_embed_affine_layer = nn.Linear(args.spk_embed_dim, args.output_size)
        self.encoder = ConformerEncoder(enc)
        self.encoder_proj = nn.Linear(enc.output_size, args.output_size)
        self.decoder = CFM(args)

    def project_speaker(self, spk_raw: Tensor) -> Tensor:
        return self.spk_embed_affine_layer(F.normalize(spk_raw, dim=1))  # [B, 192] -> [B, 80]

    def encode_chunk(self, tokens: Tensor, cache: FlowCache, last_chunk: bool) -> tuple[Tensor, FlowCache]:
        """tokens [B, T] (with lookahead) -> mu [B, T', 80] and the cache with new conformer caches."""
        h, cnn, att = self.encoder.forward_chunk(
            self.input_embedding(tokens), cache.conformer_cnn, cache.conformer_att, last_chunk)
        return self.encoder_proj(h), replace(cache, conformer_cnn=cnn, conformer_att=att)

    def setup(
        self, prompt_tokens: Tensor, prompt_mel: Tensor, spk_raw: Tensor, noise: Tensor
    ) -> tuple[Tensor, FlowCache]:
        """The setup solve of a voice: encode the prompt (+ lookahead) and solve it with cond = prompt mel."""
        spk, (cache,) = self.setup_batch([prompt_tokens], [prompt_mel], spk_raw, [noise])
        return spk, cache

    def setup_batch(
        self, prompt_tokens: list[Tensor], prompt_mel: list[Tensor], spk_raw: Tensor, noise: list[Tensor]
    ) -> tuple[Tensor, list[FlowCache]]:
        """The setup solves of B voices as one batched encoder pass and one masked solve: rows as `setup`'s
        (tokens [1, Tp_i + 3], mel [1, 2 Tp_i, 80], noise [1, 80, N]), spk_raw [B, 192] -> spk [B, 80]."""
        look, up = self.args.encoder.pre_lookahead_len, self.args.encoder.up_stride
        for tokens, mel in zip(prompt_tokens, prompt_mel, strict=True):
            if (tokens.size(1) - look) * up != mel.size(1):
                raise ValueError(f"prompt mel needs {up} frames per token, {look} lookahead tokens excluded: "
                                 f"got tokens {tuple(tokens.shape)}, mel {tuple(mel.shape)}")
        spk = self.project_speaker(spk_raw)
        b = len(prompt_tokens)
        if b == 1:  # the single-row encoder: a voice installed alone keeps the bits it always had
            mu0, cache0 = self.encode_chunk(prompt_tokens[0], FlowCache(), last_chunk=False)
            mu, caches = [mu0], [cache0]
        else:
            mu, caches = self.encode_chunks(prompt_tokens, [FlowCache()] * b, [False] * b)
        _, caches = self.solve_chunk_batch(mu, spk, noise, caches, cond=prompt_mel)
        return spk, [cache.materialized() for cache in caches]

    def encode_chunks(self, tokens: list[Tensor], caches: list[FlowCache], last_chunks: list[bool]
                      ) -> tuple[list[Tensor], list[FlowCache]]:
        """encode_chunk of B streams in one batched encoder pass: tokens[i] [1, T_i] -> mu_i [1, T'_i, 80]."""
        n_in = [t.size(1) for t in tokens]
        padded = torch.cat([F.pad(t, (0, max(n_in) - t.size(1))) for t in tokens])  # [B, max T], id 0 past
        h, cnn, att = self.encoder.forward_chunks(
            self.input_embedding(padded), n_in, last_chunks, [c.conformer_cnn for c in caches],
            [c.conformer_att for c in caches])
        mu = self.encoder_proj(h)  # [B, 2 max T', 80]
        up, look = self.args.encoder.up_stride, self.args.encoder.pre_lookahead_len
        n_out = [up * (t if last else t - look) for t, last in zip(n_in, last_chunks, strict=True)]
        new = [replace(c, conformer_cnn=k, conformer_att=a) for c, k, a in zip(caches, cnn, att, strict=True)]
        return [mu[i : i + 1, :n] for i, n in enumerate(n_out)], new

    def stream_chunks(
        self, tokens: list[Tensor], spk: Tensor, caches: list[FlowCache], last_chunks: list[bool],
        noise: list[Tensor], workspace: Workspace | None = None, copy_shared: bool = False,
    ) -> tuple[Tensor, list[int], list[FlowCache]]:
        """One chunk of each of B streams: tokens[i] [1, T_i] -> mel [B, 80, max T'], T'_i, new caches."""
        mu, encoded = self.encode_chunks(tokens, caches, last_chunks)
        mel, new_caches = self.solve_chunk_batch(mu, spk, noise, encoded, workspace=workspace,
                                                 copy_shared=copy_shared)
        return mel, [m.size(1) for m in mu], new_caches

    def solve_chunk_batch(
        self, mu: list[Tensor], spk: Tensor, noise: list[Tensor], caches: Sequence[FlowCache | None],
        cond: list[Tensor] | None = None, workspace: Workspace | None = None, copy_shared: bool = False,
    ) -> tuple[Tensor, list[FlowCache]]:
        """One masked CFM solve over rows of different streams (shapes in the module docstring);
        `workspace` lends the memory of the solve's one-step attention buffer (`kvcache.Workspace`);
        `copy_shared`: the voices' frames copied next to each row (`kvcache.BatchKV`), not read in place."""
        rows = [c or FlowCache() for c in caches]
        n_new = [m.size(1) for m in mu]
        t_max, dtype, a = max(n_new), mu[0].dtype, self.args.dit
        noise_rows = _noise_rows(noise, [c.offset for c in rows], n_new, dtype)
        cond_rows = [torch.zeros_like(m[0]) for m in mu] if cond is None else [c[0].to(dtype) for c in cond]
        kv = BatchKV([c.estimator() for c in rows], n_new, mu[0], steps=self.args.n_timesteps, depth=a.depth,
                     heads=a.num_heads, head_dim=a.head_dim, tail=ATT_CACHE_TAIL, chunk_frames=CHUNK_FRAMES,
                     workspace=workspace, copy_shared=copy_shared)
        sizes = torch.tensor([n_new, kv.n_alive]).to(spk.device, non_blocking=True)  # one host -> device copy
        lengths, alive = sizes[0], sizes[1]
        slot = torch.arange(t_max + max(kv.n_alive), device=spk.device)
        key_mask = None  # no padding (steady-state batches): SDPA may pick its unmasked kernels
        if min(n_new) < t_max or min(kv.n_alive) < max(kv.n_alive):
            key_mask = (slot < lengths[:, None]) | ((slot >= t_max) & (slot < t_max + alive[:, None]))
        x, new_conv = self.decoder.solve(
            _pad_rows(noise_rows, t_max), _pad_rows([m[0] for m in mu], t_max), spk,
            _pad_rows(cond_rows, t_max), _steps(self._gather_conv(rows, mu[0])), kv, key_mask, lengths)
        mel = x.masked_fill((slot[:t_max] >= lengths[:, None])[..., None], 0.0).transpose(1, 2)
        b, out = len(rows), []
        for i, (cache, est) in enumerate(zip(rows, kv.results(), strict=True)):
            cnn = new_conv[:, :, i :: b].clone()
            out.append(replace(cache, estimator_cnn=cnn, estimator_att=None, estimator_kv=est))
        return mel, out

    def solve_lanes(self, mu: Tensor, plan: Tensor, lanes: Lanes, window: int) -> tuple[Tensor, Tensor]:
        """One masked CFM solve over lanes 0..B-1 (`lanes.py`): mu [B, T, 80] (row i valid up to its new
        frames, zeros after), plan: `Lanes.plan(...)` on the device (0 new frames: a lane without a
        chunk) -> mel [B, 80, T] (zeros past each row's frames) and the new conv caches
        [N, depth, 2B, 2C, 2] for `Lanes.commit_conv` once the step succeeded. The rows' new estimator
        frames go into their lanes as the solve runs, to slots no frame that counts holds (a retry writes
        them again). No shape depends on a tensor's values, and nothing is read back to the host."""
        step = LaneStep.of(lanes, plan, window)
        x, new_conv = self.decoder.solve(step.noise().to(mu.dtype), mu, lanes.spk[: step.rows],
                                         torch.zeros_like(mu), step.conv(), step, step.own_bias, step.n_new,
                                         pairs=True)
        padding = torch.arange(mu.size(1), device=mu.device) >= step.n_new[:, None]
        return x.masked_fill(padding[..., None], 0.0).transpose(1, 2), new_conv

    def encode_lanes(self, plan: Tensor, lanes: EncoderLanes) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        """The encoder over lanes 0..B-1: plan `EncoderLanes.plan(...)` on the device -> mu [B, up T, 80]
        (zeros past each row's new frames) and the rows' new encoder buffers, for `EncoderLanes.commit`
        once the step succeeded. Row i's mu equals `encode_chunks`' up to float rounding."""
        step = EncoderStep.of(lanes.shape, plan)
        h, first, second, cnn = forward_lanes(self.encoder, self.input_embedding(step.tokens), step, lanes)
        padding = torch.arange(h.size(1), device=h.device) >= (step.n * lanes.shape.up)[:, None]
        return self.encoder_proj(h).masked_fill(padding[..., None], 0.0), (first, second, cnn)

    def step_lanes(self, tokens_plan: Tensor, plan: Tensor, lanes: Lanes, window: int
                   ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
        """A decode step's flow over lanes 0..B-1: `encode_lanes`, then `solve_lanes` on its mu."""
        assert lanes.encoder is not None, "lanes built without encoder caches"
        mu, encoded = self.encode_lanes(tokens_plan, lanes.encoder)
        mel, new_conv = self.solve_lanes(mu, plan, lanes, window)
        return mel, new_conv, encoded

    def _gather_conv(self, caches: list[FlowCache], like: Tensor) -> Tensor:
        """Per-row estimator conv caches -> [N, depth, 2B, 2C, 2] (zeros for rows without one)."""
        a, b = self.args.dit, len(caches)
        conv = like.new_zeros(self.args.n_timesteps, a.depth, 2 * b, 2 * a.hidden_size, 2)
        for i, cache in enumerate(caches):
            if cache.estimator_cnn is not None:
                conv[:, :, i :: b] = cache.estimator_cnn
        return conv

    def inference(
        self, tokens: Tensor, prompt_tokens: Tensor, prompt_mel: Tensor, spk_raw: Tensor, noise: Tensor
    ) -> Tensor:
        """Whole utterance after its prompt, full attention (no caches): -> mel [1, 80, 2 T]."""
        spk = self.project_speaker(spk_raw)
        all_tokens = torch.cat([prompt_tokens, tokens], dim=1).clamp(min=0)
        mu = self.encoder_proj(self.encoder(self.input_embedding(all_tokens)))  # [1, T_all, 80]
        n, n_prompt, a = mu.size(1), prompt_mel.size(1), self.args.dit
        cond = torch.cat([prompt_mel.to(mu.dtype), mu.new_zeros(1, n - n_prompt, mu.size(2))], dim=1)
        conv = mu.new_zeros(a.depth, 2, 2 * a.hidden_size, 2)
        kv = mu.new_zeros(a.depth, 2, a.num_heads, n, 2 * a.head_dim)  # reused by every step
        steps = self.args.n_timesteps
        z = noise[0, :, :n].t()[None].to(mu.dtype)
        x, _ = self.decoder.solve(z, mu, spk, cond, [conv] * steps, [kv] * steps)
        return x[:, n_prompt:].transpose(1, 2)
