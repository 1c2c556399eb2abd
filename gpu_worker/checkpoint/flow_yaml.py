"""flow.yaml, read without executing anything and checked against the supported architecture.

    read_flow_config(path, args) -> FlowArgs, or ModelLoadError naming the field and the file
    flow_schema(args)            -> the released file's structure with the values `args` implies
                                    (`checkpoint_io` writes flow.yaml from it too)

flow.yaml is HyperPyYAML: its `!new:module.Class` tags would import and call code. Here they become plain
data (a YAML safe loader with one constructor for `!new:`); every other tag is refused, and every field is
checked against the supported architecture (`ModelArgs.full()` unless told otherwise), so a file that
describes anything else fails with a ModelLoadError naming the field and the file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from app.errors import ModelLoadError, first_line
from gpu_worker.model.config import FlowArgs

MAX_FLOW_YAML_BYTES = 64 * 1024  # the released file is about 1 KiB
NEW_TAG = "!new:"
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
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_FlowYamlLoader)  # a SafeLoader subclass
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{file}: missing") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{file}: cannot be read ({exc})") from exc
    except yaml.YAMLError as exc:
        raise ModelLoadError(f"{file}: not a supported flow.yaml ({first_line(exc)})") from exc
    if not isinstance(data, dict) or set(data) != {"flow"}:
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ModelLoadError(f"{file}: expected exactly one top-level field `flow`, found {keys}")
    _check_node(flow_schema(args), data["flow"], "flow", file)
    return args
