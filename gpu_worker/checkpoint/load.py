"""Model folder -> `Code2Wav`: the released token2wav layout, read safely and validated.

    load_model_folder(path, device=..., dtype=...)   flow.yaml + flow.pt + hift.pt -> Code2Wav (flow in dtype,
                                                      HiFT float32 until prepare_hift)
    read_flow_config(path, args)                      flow.yaml -> FlowArgs, or ModelLoadError (`flow_yaml`)
    load_flow(folder, args.flow) / load_hift(file, args.hift)   one component
    load_dummy(args, seed)                            seeded random weights (the output is noise)
    fuse_weight_norm(model.hift)                      optional, for inference: g * v / |v| folded once
    prepare_hift(model.hift, dtype)                   for inference: weight norm folded, body in `dtype`

flow.yaml is read without executing anything and checked field by field (`gpu_worker.checkpoint.flow_yaml`).
Weights are read with `torch.load(weights_only=True)` and assigned into modules built on `meta`.

Not in here: CAM++ and the S3 tokenizer (`gpu_worker.voices.speaker`), writing folders (`checkpoint_io`).
"""

from __future__ import annotations

import logging
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.errors import ModelLoadError, first_line
from app.speech import FLOW_PT, FLOW_YAML, HIFT_PT
from gpu_worker.checkpoint.flow_yaml import read_flow_config
from gpu_worker.model import Code2Wav
from gpu_worker.model.config import FlowArgs, HiftArgs, ModelArgs
from gpu_worker.model.hift import HiFTGenerator

if TYPE_CHECKING:
    from gpu_worker.model.flow import Flow

log = logging.getLogger(__name__)

NEW_TAG = "!new:"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # by setting name
MAX_FLOW_YAML_BYTES = 64 * 1024  # the released file is about 1 KiB
_ABSENT = object()  # the reference has no default: the field must be in the file


def _read_state_dict(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ModelLoadError(f"{file}: missing")
    try:  # mmap needs the zip format; older checkpoints are read whole
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as exc:  # truncated zip, pickle refused by weights_only, ...: all one answer
        reason = first_line(exc)
        raise ModelLoadError(f"{file}: cannot be read as a weights-only state dict ({reason})") from exc
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in state.items()):
        raise ModelLoadError(f"{file}: expected a flat dict of name -> tensor")
    return state


def _assign(module: torch.nn.Module, state: dict[str, torch.Tensor], file: Path, *,
            device: torch.device, dtype: torch.dtype) -> None:
    """Checks names, shapes and dtypes against `module` (on meta), then assigns the cast tensors."""
    expected = module.state_dict()
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise ModelLoadError(f"{file}: state dict does not match the architecture "
                             f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
                             f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})")
    for name, want in expected.items():
        got = state[name]
        if got.shape != want.shape:
            raise ModelLoadError(f"{file}: {name} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if got.dtype.is_floating_point != want.dtype.is_floating_point or got.is_complex():
            raise ModelLoadError(f"{file}: {name} has dtype {got.dtype}, expected a {want.dtype}-like tensor")
    cast = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=True)
            for k, v in state.items()}
    module.load_state_dict(cast, strict=True, assign=True)
    leftover = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftover:
        raise ModelLoadError(f"{file}: {leftover[0]} was not set by the state dict")
    module.requires_grad_(False).eval()


def normalize_hift_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strips a `generator.` prefix and renames old weight-norm keys to parametrization keys."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("generator.")
        if key.endswith(".weight_g"):
            key = key[: -len("weight_g")] + "parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len("weight_v")] + "parametrizations.weight.original1"
        out[key] = value
    return out


def _build_flow(args: FlowArgs) -> Flow:
    from gpu_worker.model.flow import Flow  # lazily: the flow model is a separate component

    return Flow(args)


def load_model_folder(path: str | Path, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32,
                      args: ModelArgs | None = None) -> Code2Wav:
    """Loads flow.yaml/flow.pt/hift.pt of a released token2wav folder.

    `args` is the supported architecture (default `ModelArgs.full()`); a folder describing anything
    else is refused. HiFT stays in float32 by default: its iSTFT magnitudes are exp() of the output.
    """
    folder, args = Path(path), args or ModelArgs.full()
    if not folder.is_dir():
        raise ModelLoadError(f"{folder}: model folder not found")
    flow = load_flow(folder, args.flow, device=device, dtype=dtype)
    hift = load_hift(folder / HIFT_PT, args.hift, device=device)
    log.info("loaded Code2Wav from %s (flow %.1f M, hift %.1f M parameters) on %s",
             folder, _millions(flow), _millions(hift), device)
    return Code2Wav(flow, hift, args)


def load_flow(folder: str | Path, args: FlowArgs, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> Flow:
    """flow.yaml (validated against `args`) + flow.pt -> Flow, built on meta and assigned."""
    folder = Path(folder)
    flow_args = read_flow_config(folder / FLOW_YAML, args)
    with torch.device("meta"):
        flow = _build_flow(flow_args)
    file = folder / FLOW_PT
    _assign(flow, _read_state_dict(file), file, device=torch.device(device), dtype=dtype)
    return flow


def load_hift(file: str | Path, args: HiftArgs, *, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> HiFTGenerator:
    """hift.pt in any released key style -> HiFTGenerator, built on meta and assigned."""
    file = Path(file)
    with torch.device("meta"):
        hift = HiFTGenerator(args)
    state = normalize_hift_state(_read_state_dict(file))
    _assign(hift, state, file, device=torch.device(device), dtype=dtype)
    return hift


def fuse_weight_norm(module: torch.nn.Module) -> torch.nn.Module:
    """Folds weight-norm parametrizations into plain weights (same outputs, fewer kernels per call).

    For inference after loading: the state dict then has `*.weight` where the checkpoint had g and v.
    """
    from torch.nn.utils import parametrize

    for sub in module.modules():
        if parametrize.is_parametrized(sub, "weight"):
            parametrize.remove_parametrizations(sub, "weight", leave_parametrized=True)
    return module


HIFT_FLOAT32_PARTS = ("f0_predictor", "m_source", "conv_post")


def prepare_hift(hift: HiFTGenerator, dtype: torch.dtype = torch.float32) -> HiFTGenerator:
    """For inference: weight norm folded (in the loaded float32), then the vocoder body cast to `dtype`.

    The parts in `HIFT_FLOAT32_PARTS` stay float32 whatever `dtype` is: with them in bf16 too, a one-off
    probe (not kept) found the random full-size vocoder's audio 14 dB SNR from float32's (the F0 sets
    every sample's phase; conv_post's output is exponentiated and taken as phase by the iSTFT); with them
    kept, 40 dB (`python -m bench.engine.speedups`, docs/PERFORMANCE.md run 3). float32 changes
    nothing: the same weights, bit for bit.
    """
    fuse_weight_norm(hift)
    if dtype != torch.float32:
        for name, child in hift.named_children():
            if name not in HIFT_FLOAT32_PARTS:
                child.to(dtype)
    return hift


def _millions(module: torch.nn.Module) -> float:
    return sum(p.numel() for p in module.parameters()) / 1e6


def random_code2wav(args: ModelArgs, seed: int) -> Code2Wav:
    """The architecture with seeded random float32 weights on the CPU; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        flow, hift = _build_flow(args.flow), HiFTGenerator(args.hift)
        with torch.no_grad():
            for name, param in flow.named_parameters():
                if "pos_bias" in name:  # allocated with torch.empty by the encoder (loading fills them)
                    torch.nn.init.xavier_uniform_(param)
            # An F0 around 100 Hz, so the dummy's source has voiced frames as speech does.
            hift.f0_predictor.classifier.bias.fill_(100.0)
    model = Code2Wav(flow, hift, args)
    model.requires_grad_(False).eval()
    return model


def load_dummy(args: ModelArgs, seed: int, *, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> Code2Wav:
    """Full architecture with seeded random weights, for benchmarks and demos without a checkpoint."""
    log.warning("!!! DUMMY MODEL: Code2Wav with random weights (seed %d); every output is NOISE, "
                "not speech. Point the worker at a real token2wav folder for real audio. !!!", seed)
    model = random_code2wav(args, seed)
    model.flow.to(device=device, dtype=dtype)
    model.hift.to(device=device)
    return model
