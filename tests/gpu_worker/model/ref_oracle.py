"""Test helpers for the flow: the reference flow as an oracle, and the shared test inputs.

The reference (stepaudio2-minicpmo, test-only) registers working buffers shaped for the full model
(16 steps, 16 blocks, 1000 frames) and draws its noise buffer unseeded; `reference_flow` builds it on
the meta device, gives those buffers shapes that fit the preset, materialises everything on the CPU,
loads the given weights and installs the caller's noise. `reference_stream` is the reference driver's
streaming loop (`Token2wav.stream` without HiFT and without its hard-coded `.cuda()`), trimming rule
included. The reference is imported lazily, so the helpers below it work without it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from bench.engine.reference import fit_buffers
from gpu_worker.model.config import (
    ATT_CACHE_TAIL,
    CHUNK_TOKENS,
    LOOKAHEAD_TOKENS,
    SILENCE_TOKEN,
    FlowArgs,
)

CACHE_KEYS = ("conformer_cnn_cache", "conformer_att_cache", "estimator_cnn_cache", "estimator_att_cache")


def _reference_modules():
    names = ("flow.flow", "flow.flow_matching", "flow.decoder_dit", "transformer.upsample_encoder_v2")
    return [importlib.import_module(f"stepaudio2.cosyvoice2.{name}") for name in names]


def _build(args: FlowArgs) -> nn.Module:
    ref_flow, ref_cfm, ref_dit, ref_encoder = _reference_modules()
    enc, dit = args.encoder, args.dit
    encoder = ref_encoder.UpsampleConformerEncoderV2(
        input_size=enc.input_size, output_size=enc.output_size, input_layer="linear",
        pre_lookahead_len=enc.pre_lookahead_len, num_blocks=enc.num_blocks, num_up_blocks=enc.num_up_blocks,
        up_stride=enc.up_stride, up_scale_factor=enc.up_scale_factor, attention_heads=enc.attention_heads,
        pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", key_bias=True,
        linear_units=enc.linear_units, normalize_before=True, activation_type="swish")
    estimator = ref_dit.DiT(
        in_channels=dit.in_channels, out_channels=dit.out_channels, mlp_ratio=dit.mlp_ratio, depth=dit.depth,
        num_heads=dit.num_heads, head_dim=dit.head_dim, hidden_size=dit.hidden_size)
    decoder = ref_cfm.CausalConditionalCFM(estimator, inference_cfg_rate=args.inference_cfg_rate)
    return ref_flow.CausalMaskedDiffWithXvec(
        input_size=enc.input_size, output_size=args.output_size, spk_embed_dim=args.spk_embed_dim,
        output_type="mel", vocab_size=args.vocab_size, encoder=encoder, decoder=decoder)


def reference_on_meta(args: FlowArgs) -> nn.Module:
    with torch.device("meta"):
        return _build(args)


def random_state_dict(module: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Weights with unit-scale activations: matrices ~ N(0, 1 / fan_in), norm gains ~ 1 + N(0, 0.1).

    (The reference's own init zeroes the DiT's adaLN and output layers, which would make its velocity 0.)
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, ref in module.state_dict().items():
        x = torch.randn(ref.shape, generator=gen)
        if ref.dim() >= 2:
            x *= ref[0].numel() ** -0.5
        elif "norm" in name and name.endswith("weight"):
            x = 1.0 + 0.1 * x
        else:
            x *= 0.05
        out[name] = x
    return out


def reference_flow(args: FlowArgs, weights: dict[str, torch.Tensor], noise: torch.Tensor,
                   cache_frames: int = 1000) -> nn.Module:
    """A CPU reference flow in eval mode with `weights` and `noise` [1, 80, N] as its noise buffer."""
    flow = reference_on_meta(args)
    fit_buffers(flow, args, steps=args.n_timesteps, frames=cache_frames)
    flow.to_empty(device="cpu")
    flow.load_state_dict(weights, strict=True)
    for name, buf in flow.named_buffers():
        if "cache_buffer" in name:
            buf.zero_()
    flow.decoder.rand_noise = noise.clone()
    for embed in (flow.encoder.embed, flow.encoder.up_embed):  # the tables were built on meta
        pos_enc = embed.pos_enc
        pos_enc.pe = None
        pos_enc.extend_pe(torch.zeros(1, args.encoder.pos_max_len))
    return flow.eval()


def _cloned(cache: dict) -> dict:
    return {key: cache[key].clone() for key in CACHE_KEYS}


def reference_setup(flow: nn.Module, prompt_tokens, prompt_mel, spk_raw) -> dict:
    with torch.inference_mode():
        return _cloned(flow.setup_cache(prompt_tokens, prompt_mel, spk_raw, n_timesteps=flow_steps(flow)))


def flow_steps(flow: nn.Module) -> int:
    return flow.decoder.cnn_cache_buffer.size(0)


def reference_stream(flow: nn.Module, cache: dict, chunks: list[tuple[torch.Tensor, bool]], spk_raw,
                     prompt_len: int, tail: int = ATT_CACHE_TAIL) -> tuple[list[torch.Tensor], list[dict]]:
    """Token2wav.stream's flow part for each (tokens [1, T], last) chunk: mels [1, 80, T'], trimmed caches."""
    mels, caches = [], []
    for tokens, last in chunks:
        with torch.inference_mode():
            mel, cache = flow.inference_chunk(tokens, spk_raw, cache, last_chunk=last,
                                              n_timesteps=flow_steps(flow))
        cache = _cloned(cache)
        est, conf = cache["estimator_att_cache"], cache["conformer_att_cache"]
        if est.shape[4] > prompt_len + tail:
            cache["estimator_att_cache"] = torch.cat([est[..., :prompt_len, :], est[..., -tail:, :]], dim=4)
        if conf.shape[3] > prompt_len + tail:
            cache["conformer_att_cache"] = torch.cat([conf[..., :prompt_len, :], conf[..., -tail:, :]], dim=3)
        mels.append(mel.clone())
        caches.append(cache)
    return mels, caches


# -- shared test inputs ------------------------------------------------------------------------------


@dataclass
class Prompt:
    tokens: torch.Tensor  # [1, Tp]
    mel: torch.Tensor  # [1, 2 Tp, 80]
    spk: torch.Tensor  # [1, 192] raw speaker embedding

    @property
    def setup_tokens(self) -> torch.Tensor:  # [1, Tp + 3]: the prompt followed by 3 silence tokens
        return torch.cat([self.tokens, torch.full((1, LOOKAHEAD_TOKENS), SILENCE_TOKEN)], dim=1)

    @property
    def n_frames(self) -> int:
        return self.mel.size(1)


def seeded_noise(args: FlowArgs, seed: int) -> torch.Tensor:
    return torch.randn(1, args.output_size, args.noise_frames, generator=torch.Generator().manual_seed(seed))


def make_prompt(n_tokens: int, seed: int, vocab: int = 6561) -> Prompt:
    gen = torch.Generator().manual_seed(seed)
    return Prompt(tokens=torch.randint(0, vocab, (1, n_tokens), generator=gen),
                  mel=torch.randn(1, 2 * n_tokens, 80, generator=gen) - 4.0,
                  spk=torch.randn(1, 192, generator=gen))


def random_tokens(n: int, seed: int, vocab: int = 6561) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def split_chunks(tokens: torch.Tensor, new: int = CHUNK_TOKENS, look: int = LOOKAHEAD_TOKENS
                 ) -> list[tuple[torch.Tensor, bool]]:
    """tokens [1, N] -> (chunk [1, new + look], False)..., (tail [1, <= new + look], True) (MODEL.md)."""
    chunks, pos = [], 0
    while tokens.size(1) - pos > new + look:
        chunks.append((tokens[:, pos : pos + new + look], False))
        pos += new
    return [*chunks, (tokens[:, pos:], True)]
