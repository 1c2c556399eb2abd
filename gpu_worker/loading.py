"""Model folder -> `Code2Wav`: the released token2wav layout, read safely and validated.

    load_model_folder(path, device=..., dtype=...)   flow.yaml + flow.pt + hift.pt -> Code2Wav (flow in dtype,
                                                      HiFT float32 until prepare_hift)
    read_flow_config(path, args)                      flow.yaml -> FlowArgs, or ModelLoadError
    load_flow(folder, args.flow) / load_hift(file, args.hift)   one component
    load_dummy(args, seed)                            seeded random weights (the output is noise)
    fuse_weight_norm(model.hift)                      optional, for inference: g * v / |v| folded once
    prepare_hift(model.hift, dtype)                   for inference: weight norm folded, body in `dtype`

flow.yaml is HyperPyYAML: its `!new:module.Class` tags would import and call code. Here they become
plain data (a YAML safe loader with one constructor for `!new:`); every other tag is refused, and every
field is checked against the supported architecture (`ModelArgs.full()` unless told otherwise), so a
file that describes anything else fails with a ModelLoadError naming the field and the file.
Weights are read with `torch.load(weights_only=True)` and assigned into modules built on `meta`.

Not in here: CAM++ and the S3 tokenizer (`gpu_worker.speaker`), writing folders (`checkpoint_io`).
"""

from __future__ import annotations

import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml

from app.errors import ModelLoadError
from app.speech import FLOW_PT, FLOW_YAML, HIFT_PT
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


@dataclass(frozen=True)
class Field:
    """One scalar of flow.yaml: the value we support, and the reference's default when it is left out."""

    value: Any
    default: Any = _ABSENT
    inert: bool = False  # ignored at inference (dropout rates): any number in [0, 1] is accepted
    written: bool = True  # present in the released file (checkpoint_io writes it)


@dataclass(frozen=True)
class Node:
    """One `!new:` object of flow.yaml: its class, the module the released file names, its fields."""

    cls: str
    module: str
    fields: dict[str, Field | Node] = field(default_factory=dict)


def flow_schema(args: FlowArgs) -> Node:
    """The released flow.yaml's structure, with the values `args` implies (MODEL.md, "Flow")."""
    enc, dit = args.encoder, args.dit
    encoder = Node("UpsampleConformerEncoderV2", "cosyvoice2.transformer.upsample_encoder_v2", {
        "input_size": Field(enc.input_size), "output_size": Field(enc.output_size, 256),
        "input_layer": Field("linear", "linear"), "pre_lookahead_len": Field(enc.pre_lookahead_len, 3),
        "num_blocks": Field(enc.num_blocks, 6), "num_up_blocks": Field(enc.num_up_blocks, 4),
        "up_stride": Field(enc.up_stride, 2), "up_scale_factor": Field(enc.up_scale_factor, 2.0),
        "attention_heads": Field(enc.attention_heads, 4),
        "pos_enc_layer_type": Field("rel_pos_espnet", "rel_pos_espnet"),
        "selfattention_layer_type": Field("rel_selfattn", "rel_selfattn"),
        "key_bias": Field(True, True), "linear_units": Field(enc.linear_units, 2048),
        "dropout_rate": Field(0.1, 0.1, inert=True), "positional_dropout_rate": Field(0.1, 0.1, inert=True),
        "attention_dropout_rate": Field(0.1, 0.0, inert=True),
        "normalize_before": Field(True, True), "activation_type": Field("swish", "swish", written=False),
    })
    estimator = Node("DiT", "cosyvoice2.flow.decoder_dit", {
        "in_channels": Field(dit.in_channels), "out_channels": Field(dit.out_channels),
        "mlp_ratio": Field(dit.mlp_ratio, 4.0), "depth": Field(dit.depth, 28),
        "num_heads": Field(dit.num_heads, 8), "head_dim": Field(dit.head_dim, 64),
        "hidden_size": Field(dit.hidden_size, 256),
    })
    decoder = Node("CausalConditionalCFM", "cosyvoice2.flow.flow_matching", {
        "inference_cfg_rate": Field(args.inference_cfg_rate, 0.7), "estimator": estimator})
    return Node("CausalMaskedDiffWithXvec", "cosyvoice2.flow.flow", {
        "input_size": Field(enc.input_size, 512), "output_size": Field(args.output_size, 80),
        "spk_embed_dim": Field(args.spk_embed_dim, 192), "output_type": Field("mel", "mel"),
        "vocab_size": Field(args.vocab_size, 5121), "encoder": encoder, "decoder": decoder,
    })


class _FlowYamlLoader(yaml.SafeLoader):
    """Safe loader where `!new:module.Class {..}` becomes {"!new": "module.Class", ..}; nothing runs."""


def _construct_new(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, Any]:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(None, None, f"!new:{suffix} must hold a mapping",
                                                node.start_mark)
    return {NEW_TAG: suffix, **loader.construct_mapping(node, deep=True)}


_FlowYamlLoader.add_multi_constructor(NEW_TAG, _construct_new)


def _check_scalar(spec: Field, value: Any, name: str, file: Path) -> None:
    if spec.inert:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and 0.0 <= value <= 1.0
    elif isinstance(spec.value, bool):
        ok = value is spec.value
    elif isinstance(spec.value, float):  # YAML writes 2 for 2.0
        ok = isinstance(value, int | float) and not isinstance(value, bool) and float(value) == spec.value
    elif isinstance(spec.value, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and value == spec.value
    else:
        ok = value == spec.value
    if not ok:
        raise ModelLoadError(f"{file}: {name} = {value!r} is not supported (expected {spec.value!r})")


def _check_node(spec: Node, data: Any, name: str, file: Path) -> None:
    if not isinstance(data, dict) or NEW_TAG not in data:
        raise ModelLoadError(f"{file}: {name} must be a `!new:...{spec.cls}` object")
    if str(data[NEW_TAG]).rsplit(".", 1)[-1] != spec.cls:
        raise ModelLoadError(f"{file}: {name} is `!new:{data[NEW_TAG]}`, expected a {spec.cls}")
    unknown = sorted(str(k) for k in data if k != NEW_TAG and k not in spec.fields)
    if unknown:
        raise ModelLoadError(f"{file}: {name}.{unknown[0]} is not a supported field")
    for key, sub in spec.fields.items():
        if isinstance(sub, Node):
            _check_node(sub, data.get(key), f"{name}.{key}", file)
        elif key in data:
            _check_scalar(sub, data[key], f"{name}.{key}", file)
        elif sub.default is _ABSENT or (not sub.inert and sub.default != sub.value):
            raise ModelLoadError(f"{file}: {name}.{key} is missing (expected {sub.value!r})")


def read_flow_config(path: str | Path, args: FlowArgs | None = None) -> FlowArgs:
    """Parses flow.yaml without executing it and returns its FlowArgs if it is the supported one."""
    file, args = Path(path), args or FlowArgs()
    try:
        if file.stat().st_size > MAX_FLOW_YAML_BYTES:
            raise ModelLoadError(f"{file}: {file.stat().st_size} bytes is too large for a flow.yaml")
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_FlowYamlLoader)  # noqa: S506 (safe subclass)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{file}: missing") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot be read ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ModelLoadError(f"{file}: not a supported flow.yaml ({_first_line(exc)})") from exc
    if not isinstance(data, dict) or set(data) != {"flow"}:
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ModelLoadError(f"{file}: expected exactly one top-level field `flow`, found {keys}")
    _check_node(flow_schema(args), data["flow"], "flow", file)
    return args


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _read_state_dict(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise ModelLoadError(f"{file}: missing")
    try:  # mmap needs the zip format; older checkpoints are read whole
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as exc:  # truncated zip, pickle refused by weights_only, ...: all one answer
        reason = _first_line(exc)
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
    kept, 40 dB (`python -m gpu_worker.bench.speedups`, docs/PERFORMANCE.md run 3). float32 changes
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
