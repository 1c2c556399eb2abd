"""The reference implementation's batch-1 speed on the same weights, voice and tokens.

The reference is the published `stepaudio2` package (a test-only dependency): its flow
(`CausalMaskedDiffWithXvec.setup_cache` / `inference_chunk`) and `HiFTGenerator`, built the way its
`Token2wav` driver builds them (HyperPyYAML from the folder's flow.yaml, flow.pt strict, hift.pt with the
`generator.` prefix stripped) but on the bench's device instead of the driver's hard-coded `.cuda()`,
and driven the way `Token2wav.stream` drives them: one `inference_chunk` per chunk, both attention caches
trimmed to prompt + 100 frames, HiFT over [8 cached mel frames | chunk] with the cached source, the
hamming cross-fade, and the last 3840 samples held back.

The reference CFM and DiT hold working buffers registered at fixed shapes (16 steps, 16 blocks, 1000
frames); they are given the same layout for the preset's sizes (unchanged for `full`). Its noise buffer,
drawn unseeded by the reference, is replaced by a seeded one.

    reference_loader() -> hyperpyyaml's loader, with the reference's flow modules importable under the
        `cosyvoice2.*` names its flow.yaml uses, without running the `stepaudio2` package's __init__ (its
        LLM side imports transformers and librosa, which the GPU machine lacks)
    reference_hift(args) -> the reference HiFTGenerator for `args` (random weights; for parity tests)
    build_reference(setup, dtype=fp32) -> Reference(flow, hift, dtype)   the flow in `dtype` (fp32 by
        default, whatever the bench's own dtype: the baseline a user would otherwise pick)
    reference_fps(setup, ref, voice_index, timed) -> {fps, rtf, setup_solve_s, chunk_s, ...}
    open_reference_stream(setup, ref, voice_index) / reference_chunk(setup, stream, k)   the same, one
        chunk at a time (for measurements interleaved with ours)
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from app.speech import FLOW_PT, FLOW_YAML, HIFT_PT
from bench.engine.decode import CHUNK_FRAMES, MEL_RATE
from bench.engine.machine import Timer, summarize
from bench.engine.workload import BenchSetup, chunk_tokens
from gpu_worker.model.config import (
    ATT_CACHE_TAIL,
    CHUNK_TOKENS,
    HIFT_MEL_CACHE,
    HIFT_SOURCE_CACHE,
    LOOKAHEAD_TOKENS,
    SAMPLES_PER_MEL,
    SILENCE_TOKEN,
    FlowArgs,
    HiftArgs,
)
from gpu_worker.voices.prompt import fit_prompt_mel, seeded_noise

REF_STEPS, REF_FRAMES = 16, 1000  # the reference's hard-coded working-buffer sizes
NOISE_SEED = 7
# The reference's first chunk after its cache is first trimmed ran 1.6x slower than every later one
# (run 3: 4.8-5.0 s against 2.9-3.0 s per chunk, in each of three sweeps and in the rotation), so it
# warms up one chunk more than our decoder before anything is timed.
REFERENCE_WARMUP_CHUNKS = -(-ATT_CACHE_TAIL // CHUNK_FRAMES) + 1  # its caches trimmed, + one


@dataclass
class Reference:
    flow: Any  # stepaudio2 CausalMaskedDiffWithXvec
    hift: Any  # stepaudio2 HiFTGenerator
    dtype: torch.dtype = torch.float32  # the flow's


def fit_buffers(flow: Any, args: FlowArgs, *, steps: int = REF_STEPS, frames: int = REF_FRAMES) -> None:
    """Size a reference flow's working buffers (built on meta) to `args`' model: `steps` Euler steps of
    `frames` cached frames (the reference hard-codes the full model's)."""
    d = args.dit
    cnn = (d.depth, 2, 2 * d.hidden_size, 2)
    att = (d.depth, 2, d.num_heads, frames, 2 * d.head_dim)
    cfm, estimator = flow.decoder, flow.decoder.estimator
    cfm.cnn_cache_buffer = torch.zeros(steps, *cnn, device="meta")
    cfm.att_cache_buffer = torch.zeros(steps, *att, device="meta")
    estimator.cnn_cache_buffer = torch.zeros(cnn, device="meta")
    estimator.att_cache_buffer = torch.zeros(att, device="meta")


FLOW_MODULES = ("flow.flow", "flow.flow_matching", "flow.decoder_dit", "transformer.upsample_encoder_v2")


def reference_loader() -> Any:
    """hyperpyyaml's `load_hyperpyyaml`, with `cosyvoice2.<m>` naming `stepaudio2.cosyvoice2.<m>` for the
    reference's flow modules (what its flow.yaml names). The `stepaudio2` package is entered without its
    __init__ when nothing imported it yet: a bare package module over its folder."""
    if "stepaudio2" not in sys.modules:
        spec = importlib.util.find_spec("stepaudio2")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("the reference (`stepaudio2-minicpmo`) is not installed",
                                      name="stepaudio2")
        package = types.ModuleType("stepaudio2", "the reference, entered without its __init__")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["stepaudio2"] = package
    for name in FLOW_MODULES:
        importlib.import_module(f"stepaudio2.cosyvoice2.{name}")
    for name in [m for m in sys.modules if m.startswith("stepaudio2.cosyvoice2")]:
        sys.modules.setdefault(name.removeprefix("stepaudio2."), sys.modules[name])
    from hyperpyyaml import load_hyperpyyaml  # type: ignore[import-untyped]  # test-only dependency

    return load_hyperpyyaml


def _build_flow(setup: BenchSetup, dtype: torch.dtype) -> Any:
    load_hyperpyyaml = reference_loader()
    with open(setup.folder / FLOW_YAML, encoding="utf-8") as f, torch.device("meta"):
        flow = load_hyperpyyaml(f)["flow"]
    fit_buffers(flow, setup.args.flow)
    flow.to_empty(device=setup.device)
    state = torch.load(setup.folder / FLOW_PT, map_location="cpu", weights_only=True)
    flow.load_state_dict(state, strict=True)
    for name, buf in flow.named_buffers():
        if "cache_buffer" in name:
            buf.zero_()
    flow.decoder.rand_noise = seeded_noise(NOISE_SEED, setup.device, torch.float32)[0]
    for embed in (flow.encoder.embed, flow.encoder.up_embed):  # positional tables were built on meta
        embed.pos_enc.pe = None
        embed.pos_enc.extend_pe(torch.zeros(1, setup.args.flow.encoder.pos_max_len, device=setup.device))
    return flow.to(dtype).eval()


def reference_hift(args: HiftArgs) -> Any:
    """The reference's `HiFTGenerator` with `args`' layout, random weights, in eval mode (the parity tests
    and the benchmark load theirs into it)."""
    from stepaudio2.flashcosyvoice.modules import hifigan  # type: ignore[import-untyped]

    a = args
    return hifigan.HiFTGenerator(
        in_channels=a.in_channels, base_channels=a.base_channels, nb_harmonics=a.nb_harmonics,
        sampling_rate=a.sampling_rate, nsf_alpha=a.nsf_alpha, nsf_sigma=a.nsf_sigma,
        nsf_voiced_threshold=a.nsf_voiced_threshold, upsample_rates=list(a.upsample_rates),
        upsample_kernel_sizes=list(a.upsample_kernel_sizes),
        istft_params={"n_fft": a.istft_n_fft, "hop_len": a.istft_hop_len},
        resblock_kernel_sizes=list(a.resblock_kernel_sizes),
        resblock_dilation_sizes=[list(d) for d in a.resblock_dilation_sizes],
        source_resblock_kernel_sizes=list(a.source_resblock_kernel_sizes),
        source_resblock_dilation_sizes=[list(d) for d in a.source_resblock_dilation_sizes],
        lrelu_slope=a.lrelu_slope, audio_limit=a.audio_limit,
        f0_predictor=hifigan.ConvRNNF0Predictor(in_channels=a.in_channels, cond_channels=a.f0_cond_channels),
    ).eval()


def _build_hift(setup: BenchSetup) -> Any:
    hift = reference_hift(setup.args.hift)
    state = torch.load(setup.folder / HIFT_PT, map_location="cpu", weights_only=True)
    hift.load_state_dict({k.replace("generator.", ""): v for k, v in state.items()}, strict=True)
    return hift.to(setup.device).eval()  # Token2wav keeps HiFT in float32


def build_reference(setup: BenchSetup, dtype: torch.dtype = torch.float32) -> Reference:
    return Reference(_build_flow(setup, dtype), _build_hift(setup), dtype)


class ReferenceStream:
    """`Token2wav.stream`'s state and arithmetic for one stream (flow caches, HiFT tails)."""

    def __init__(self, ref: Reference, prompt_len: int, spk_raw: torch.Tensor, cache: dict[str, Any]):
        self.ref, self.prompt_len, self.spk, self.cache = ref, prompt_len, spk_raw, cache
        device = spk_raw.device
        self.window = torch.from_numpy(np.hamming(2 * HIFT_SOURCE_CACHE)).to(device)
        self.mel = torch.zeros(1, 80, 0, device=device)
        self.source = torch.zeros(1, 1, 0, device=device)
        self.speech = torch.zeros(1, 0, device=device)

    def _trim(self) -> None:
        keep = self.prompt_len + ATT_CACHE_TAIL
        est, conf = self.cache["estimator_att_cache"], self.cache["conformer_att_cache"]
        if est.shape[4] > keep:
            self.cache["estimator_att_cache"] = torch.cat(
                [est[:, :, :, :, : self.prompt_len], est[:, :, :, :, -ATT_CACHE_TAIL:]], dim=4)
        if conf.shape[3] > keep:
            self.cache["conformer_att_cache"] = torch.cat(
                [conf[:, :, :, : self.prompt_len, :], conf[:, :, :, -ATT_CACHE_TAIL:, :]], dim=3)

    def step(self, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        """tokens [T] -> the chunk's audio [S] (float32)."""
        token = tokens.to(self.spk.device, torch.int32)[None]
        chunk_mel, self.cache = self.ref.flow.inference_chunk(
            token=token, spk=self.spk, cache=self.cache, last_chunk=last, n_timesteps=10)
        self._trim()
        mel = torch.cat([self.mel, chunk_mel.float()], dim=2)
        speech, source = self.ref.hift(mel, self.source)
        if self.speech.shape[-1] > 0:
            n = self.window.numel() // 2
            speech = speech.clone()
            speech[..., :n] = speech[..., :n] * self.window[:n] + self.speech[..., -n:] * self.window[n:]
        self.mel = mel[..., -HIFT_MEL_CACHE:].clone()
        self.source = source[:, :, -HIFT_SOURCE_CACHE:].clone()
        self.speech = speech[:, -HIFT_SOURCE_CACHE:].clone()
        out = speech if last else speech[:, :-HIFT_SOURCE_CACHE]
        return out[0].cpu()


def open_reference_stream(setup: BenchSetup, ref: Reference, voice_index: int
                          ) -> tuple[ReferenceStream, float]:
    """The reference's setup solve of the voice -> its stream and the solve's seconds. The noise seed is
    fixed inside (the reference HiFT draws its source noise from the global RNG: fork it around calls)."""
    host = setup.host(voice_index)
    tokens, spk_raw = setup.speaker.quantize_and_embed(host.logmel128, host.fbank80)
    tokens, spk_raw = tokens.to(setup.device), spk_raw.to(setup.device, ref.dtype)
    prompt_mel = fit_prompt_mel(host.mel80[None].to(setup.device, ref.dtype), 2 * tokens.size(1))
    silence = torch.full((1, LOOKAHEAD_TOKENS), SILENCE_TOKEN, dtype=tokens.dtype, device=setup.device)
    with torch.random.fork_rng(devices=[]), Timer(setup.device) as solve:
        torch.manual_seed(NOISE_SEED)
        prompt_tokens = torch.cat([tokens, silence], 1).int()
        cache = ref.flow.setup_cache(prompt_tokens, prompt_mel, spk_raw, n_timesteps=10)
    return ReferenceStream(ref, prompt_mel.size(1), spk_raw, cache), solve.s


def reference_chunk(setup: BenchSetup, stream: ReferenceStream, k: int) -> tuple[float, int]:
    """Steady-state chunk k of the reference stream -> (seconds, audio samples)."""
    window = CHUNK_TOKENS + LOOKAHEAD_TOKENS
    with Timer(setup.device) as timer:
        audio = stream.step(chunk_tokens(window, seed=10_000 * (100 + k)), last=False)
    return timer.s, audio.numel()


def reference_fps(setup: BenchSetup, ref: Reference, voice_index: int, timed: int) -> dict[str, Any]:
    """Setup solve of the voice, REFERENCE_WARMUP_CHUNKS untimed chunks, then `timed` steady chunks."""
    stream, solve_s = open_reference_stream(setup, ref, voice_index)
    chunk_s, samples = [], 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(NOISE_SEED)
        for k in range(REFERENCE_WARMUP_CHUNKS + timed):
            seconds, n = reference_chunk(setup, stream, k)
            if k >= REFERENCE_WARMUP_CHUNKS:
                chunk_s.append(seconds)
                samples += n
    frames = samples / SAMPLES_PER_MEL
    total = sum(chunk_s)
    return {"batch": 1, "timed_steps": timed, "frames": frames, "frames_expected": timed * CHUNK_FRAMES,
            "seconds": total, "fps": frames / total, "rtf": total / (frames / MEL_RATE),
            "step_s": summarize(chunk_s), "step_s_all": chunk_s, "setup_solve_s": solve_s,
            "driver": "Token2wav.stream arithmetic, reference flow + HiFTGenerator, batch 1",
            "dtype": {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[ref.dtype]}
