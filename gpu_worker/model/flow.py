"""Flow: speech tokens -> 80-bin mel (Step-Audio 2 token2wav flow), parameter names == released flow.pt.

Offline, one utterance:
    inference(tokens [1, T], prompt_tokens [1, Tp], prompt_mel [1, 2 Tp, 80], spk_raw [1, 192],
              noise [1, 80, N]) -> mel [1, 80, 2 T]
Streaming, one `FlowCache` per stream (reference layouts, so `trim_cache` is the reference's rule):
    setup(prompt_tokens [1, Tp + 3] (3 x silence appended by the caller), prompt_mel [1, 2 Tp, 80],
          spk_raw [1, 192], noise [1, 80, N]) -> spk [1, 80], FlowCache
    encode_chunk(tokens [1, T], cache, last_chunk) -> mu [1, T', 80], FlowCache with new conformer caches
          (T' = 2 (T - 3), or 2 T for the last chunk)
    solve_chunk_batch(mu: list of [1, T'_i, 80], spk [B, 80], noise: list of [1, 80, N], caches: list of
          FlowCache | None, cond: list of [1, T'_i, 80] | None) -> mel [B, 80, max T'_i] (zero past each
          row's T'_i), FlowCaches with new estimator caches
    stream_chunks(tokens: list of [1, T_i], spk [B, 80], caches, last_chunks, noise) -> mel [B, 80, max T'_i],
          [T'_i], new caches: encode_chunk per row, then one solve_chunk_batch
    trim_cache(cache, prompt_len): the caller applies it to every stream after every chunk.
Rows of one solve may come from different streams, voices, cache lengths and chunk sizes (first,
continuing and last chunks, even setup rows with a cond): every Euler step is one DiT call over the
padded batch, with per-row key masks over the padded attention caches and per-row causal-conv caches,
so a row's mel does not depend on the other rows (up to float rounding, about 1e-6). The noise of a
row is its own buffer sliced at [offset, offset + T'), offset = its estimator attention cache length
before the chunk. Input caches are never modified, so a voice's setup cache can be shared by all its
streams. Call everything under `torch.inference_mode()`.

FlowCache layouts (H heads, steps N, L cached frames):
    conformer_cnn [1, C_enc, 6], conformer_att [blocks + up_blocks, 1, H, 2 L1, 2 d_k]   (encoder.py)
    estimator_cnn [N, depth, 2, 2 hidden, 2], estimator_att [N, depth, 2, H, L, 2 head_dim]; dim 2 is
    [cond, uncond]; estimator frames are ordered newest chunk first, as the reference concatenates.

Not in here: the noise buffer's drawing, devices, dtypes, chunking of token streams, HiFT.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from gpu_worker.model.cfm import CFM
from gpu_worker.model.config import ATT_CACHE_TAIL, FlowArgs
from gpu_worker.model.encoder import ConformerEncoder


@dataclass(frozen=True)
class FlowCache:
    conformer_cnn: Tensor | None = None
    conformer_att: Tensor | None = None
    estimator_cnn: Tensor | None = None
    estimator_att: Tensor | None = None

    @property
    def offset(self) -> int:
        """Noise offset of the next chunk: the estimator attention cache length."""
        return 0 if self.estimator_att is None else self.estimator_att.size(4)


def _trim(x: Tensor | None, dim: int, keep_head: int, keep_tail: int) -> Tensor | None:
    if x is None or x.size(dim) <= keep_head + keep_tail:
        return x
    return torch.cat([x.narrow(dim, 0, keep_head), x.narrow(dim, x.size(dim) - keep_tail, keep_tail)], dim)


def trim_cache(cache: FlowCache, prompt_len: int, tail: int = ATT_CACHE_TAIL) -> FlowCache:
    """Keeps the first `prompt_len` and the last `tail` frames of both attention caches (reference rule)."""
    return replace(cache, conformer_att=_trim(cache.conformer_att, 3, prompt_len, tail),
                   estimator_att=_trim(cache.estimator_att, 4, prompt_len, tail))


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
        look, up = self.args.encoder.pre_lookahead_len, self.args.encoder.up_stride
        if (prompt_tokens.size(1) - look) * up != prompt_mel.size(1):
            raise ValueError(f"prompt mel needs {up} frames per token, {look} lookahead tokens excluded: "
                             f"got tokens {tuple(prompt_tokens.shape)}, mel {tuple(prompt_mel.shape)}")
        spk = self.project_speaker(spk_raw)
        mu, cache = self.encode_chunk(prompt_tokens, FlowCache(), last_chunk=False)
        _, (cache,) = self.solve_chunk_batch([mu], spk, [noise], [cache], cond=[prompt_mel])
        return spk, cache

    def stream_chunks(
        self, tokens: list[Tensor], spk: Tensor, caches: list[FlowCache], last_chunks: list[bool],
        noise: list[Tensor],
    ) -> tuple[Tensor, list[int], list[FlowCache]]:
        """One chunk of each of B streams: tokens[i] [1, T_i] -> mel [B, 80, max T'], T'_i, new caches."""
        rows = zip(tokens, caches, last_chunks, strict=True)
        encoded = [self.encode_chunk(tok, cache, last) for tok, cache, last in rows]
        mu = [m for m, _ in encoded]
        mel, new_caches = self.solve_chunk_batch(mu, spk, noise, [c for _, c in encoded])
        return mel, [m.size(1) for m in mu], new_caches

    def solve_chunk_batch(
        self, mu: list[Tensor], spk: Tensor, noise: list[Tensor], caches: list[FlowCache | None],
        cond: list[Tensor] | None = None,
    ) -> tuple[Tensor, list[FlowCache]]:
        """One masked CFM solve over rows of different streams (shapes in the module docstring)."""
        rows = [c or FlowCache() for c in caches]
        n_new = [m.size(1) for m in mu]
        n_old = [c.offset for c in rows]
        t_max, l_max = max(n_new), max(n_old)
        dtype = mu[0].dtype
        noise_rows = _noise_rows(noise, n_old, n_new, dtype)
        cond_rows = [torch.zeros_like(m[0]) for m in mu] if cond is None else [c[0].to(dtype) for c in cond]
        conv, kv = self._gather_caches(rows, t_max, l_max, mu[0])
        lengths = torch.tensor(n_new, device=spk.device)
        slot = torch.arange(t_max + l_max, device=spk.device)
        olds = torch.tensor(n_old, device=spk.device)
        key_mask = (slot < lengths[:, None]) | ((slot >= t_max) & (slot < t_max + olds[:, None]))
        x, new_conv = self.decoder.solve(
            _pad_rows(noise_rows, t_max), _pad_rows([m[0] for m in mu], t_max), spk,
            _pad_rows(cond_rows, t_max), _steps(conv), _steps(kv), key_mask, lengths)
        mel = x.masked_fill((slot[:t_max] >= lengths[:, None])[..., None], 0.0).transpose(1, 2)
        return mel, self._scatter_caches(rows, new_conv, kv, n_new, t_max)

    def _gather_caches(
        self, caches: list[FlowCache], t_max: int, l_max: int, like: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Per-row estimator caches -> padded batch: conv [N, depth, 2B, 2C, 2] and
        kv [N, depth, 2B, H, t_max + l_max, 2D] with row i's old frames at [t_max, t_max + L_i)."""
        a, b = self.args.dit, len(caches)
        conv = like.new_zeros(self.args.n_timesteps, a.depth, 2 * b, 2 * a.hidden_size, 2)
        kv = like.new_zeros(self.args.n_timesteps, a.depth, 2 * b, a.num_heads, t_max + l_max, 2 * a.head_dim)
        for i, cache in enumerate(caches):
            if cache.estimator_cnn is not None:
                conv[:, :, i :: b] = cache.estimator_cnn
            if cache.estimator_att is not None:
                kv[:, :, i :: b, :, t_max : t_max + cache.offset] = cache.estimator_att
        return conv, kv

    @staticmethod
    def _scatter_caches(
        caches: list[FlowCache], new_conv: Tensor, kv: Tensor, n_new: list[int], t_max: int
    ) -> list[FlowCache]:
        b, out = len(caches), []
        for i, cache in enumerate(caches):
            att = kv[:, :, i :: b, :, : n_new[i]]  # newest frames first, then the old cache
            if cache.estimator_att is not None:
                att = torch.cat([att, cache.estimator_att], dim=4)
            cnn = new_conv[:, :, i :: b].clone()
            out.append(replace(cache, estimator_cnn=cnn, estimator_att=att.contiguous()))
        return out

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
