"""Writes seeded random weights in the released token2wav folder layout (tests, benchmarks, demo).

    write_official_layout(folder, args, seed) -> Code2Wav (the model whose weights were written)
        flow.yaml                       HyperPyYAML text with the four `!new:` tags, values from args
        flow.pt                         plain state dict
        hift.pt                         `generator.`-prefixed, old-style weight norm (weight_g / weight_v)
        campplus.onnx                   a small stand-in with CAM++'s signature: (1, T, 80) -> (1, 192)
        speech_tokenizer_v2_25hz.onnx   random initializers named as `s3tokenizer.load_model` expects

The two ONNX files are stand-ins: they have the real files' interfaces, not their networks. The
tokenizer file only has to satisfy s3tokenizer's ONNX -> torch converter, which walks node and
initializer names; s3tokenizer builds the network itself at its fixed full size (about 124 M weights,
a 0.5 GB file in float32), so its weights cannot be smaller than that.

Not in here: reading folders (`gpu_worker.checkpoint.load`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import helper, numpy_helper

from app.speech import CAMPPLUS_ONNX, FLOW_PT, FLOW_YAML, HIFT_PT, TOKENIZER_ONNX
from gpu_worker.checkpoint.flow_yaml import Field, Node, flow_schema
from gpu_worker.checkpoint.load import random_code2wav
from gpu_worker.model import Code2Wav
from gpu_worker.model.config import FlowArgs, ModelArgs

SPEAKER_DIM = 192
# s3tokenizer 0.3.0 (model_v2.ModelConfig): fixed sizes of the v2 tokenizer it builds.
S3_MELS, S3_STATE, S3_LAYERS, S3_FSMN_KERNEL, S3_FSQ_DIM = 128, 1280, 6, 31, 8


def write_official_layout(folder: str | Path, args: ModelArgs, seed: int, *,
                          old_style_weight_norm: bool = True, generator_prefix: bool = True,
                          tokenizer: bool = True, tokenizer_dtype: np.dtype | type = np.float32) -> Code2Wav:
    """Writes a complete model folder with seeded random weights and returns the model written."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = random_code2wav(args, seed)
    (folder / FLOW_YAML).write_text(render_flow_yaml(args.flow), encoding="utf-8")
    torch.save({k: v.contiguous() for k, v in model.flow.state_dict().items()}, folder / FLOW_PT)
    torch.save(hift_checkpoint_state(model.hift.state_dict(), old_style_weight_norm=old_style_weight_norm,
                                     generator_prefix=generator_prefix), folder / HIFT_PT)
    write_campplus_onnx(folder / CAMPPLUS_ONNX, seed)
    if tokenizer:
        write_s3_tokenizer_onnx(folder / TOKENIZER_ONNX, seed, dtype=tokenizer_dtype)
    return model


def render_flow_yaml(args: FlowArgs) -> str:
    """flow.yaml text as released (one `flow:` object, nested `!new:` tags), values from `args`."""
    return "".join(_render_node("flow", flow_schema(args), 0))


def _render_node(key: str, node: Node, depth: int) -> list[str]:
    pad = "    " * depth
    lines = [f"{pad}{key}: !new:{node.module}.{node.cls}\n"]
    for name, sub in node.fields.items():
        if isinstance(sub, Node):
            lines += _render_node(name, sub, depth + 1)
        elif sub.written:
            lines.append(f"{pad}    {name}: {_yaml_scalar(sub)}\n")
    return lines


def _yaml_scalar(spec: Field) -> str:
    value = spec.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return repr(value)


def hift_checkpoint_state(state: dict[str, torch.Tensor], *, old_style_weight_norm: bool,
                          generator_prefix: bool) -> dict[str, torch.Tensor]:
    """Our HiFT state dict renamed to one of the released styles."""
    out = {}
    for key, value in state.items():
        if old_style_weight_norm:
            key = key.replace("parametrizations.weight.original0", "weight_g")
            key = key.replace("parametrizations.weight.original1", "weight_v")
        out[("generator." if generator_prefix else "") + key] = value.contiguous()
    return out


class _SpeakerStandIn(nn.Module):
    """fbank (1, T, 80) -> embedding (1, 192): conv, ReLU, mean+std pooling over time, linear."""

    def __init__(self, channels: int = 64):
        super().__init__()
        self.conv = nn.Conv1d(80, channels, 3, padding=1)
        self.proj = nn.Linear(2 * channels, SPEAKER_DIM)

    def forward(self, fbank: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(fbank.transpose(1, 2)))  # [1, C, T]
        stats = torch.cat([h.mean(dim=2), (h.var(dim=2, unbiased=False) + 1e-5).sqrt()], dim=1)
        return self.proj(stats)


def write_campplus_onnx(path: str | Path, seed: int) -> None:
    """A CAM++ stand-in with the real signature, exported by torch's TorchScript ONNX exporter.

    torch 2.11's default (dynamo) exporter needs onnxscript, which is not a dependency; the TorchScript
    exporter works offline and is enough for a fixed, control-flow-free network.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = _SpeakerStandIn().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, 200, 80),), str(path), dynamo=False, opset_version=17,
                          input_names=["input"], output_names=["output"], dynamic_axes={"input": {1: "T"}})


def _s3_tensors() -> list[tuple[str, str, tuple[int, ...]]]:
    """(node name, initializer name, ONNX shape) in s3tokenizer's naming; MatMul weights are [in, out]."""
    specs = [("/conv1/Conv", "onnx::Conv_2216", (S3_STATE, S3_MELS, 3)),
             ("/conv1/Conv", "onnx::Conv_2217", (S3_STATE,)),
             ("/conv2/Conv", "onnx::Conv_2218", (S3_STATE, S3_STATE, 3)),
             ("/conv2/Conv", "onnx::Conv_2219", (S3_STATE,))]
    n = 3000  # anonymous initializer ids, clear of the converter's special names
    for i in range(S3_LAYERS):
        b = f"/blocks.{i}"
        for ln in ("attn_ln", "mlp_ln"):
            specs += [(f"{b}/{ln}/LayerNormalization", f"blocks.{i}.{ln}.weight", (S3_STATE,)),
                      (f"{b}/{ln}/LayerNormalization", f"blocks.{i}.{ln}.bias", (S3_STATE,))]
        for proj in ("query", "key", "value", "out"):
            specs.append((f"{b}/attn/{proj}/MatMul", f"onnx::MatMul_{n}", (S3_STATE, S3_STATE)))
            n += 1
            if proj != "key":  # the tokenizer's key projection has no bias
                specs.append((f"{b}/attn/{proj}/Add", f"blocks.{i}.attn.{proj}.bias", (S3_STATE,)))
        specs.append((f"{b}/attn/fsmn_block/Conv", f"blocks.{i}.attn.fsmn_block.weight",
                      (S3_STATE, 1, S3_FSMN_KERNEL)))
        for j, (d_in, d_out) in ((0, (S3_STATE, 4 * S3_STATE)), (2, (4 * S3_STATE, S3_STATE))):
            specs.append((f"{b}/mlp/mlp.{j}/MatMul", f"onnx::MatMul_{n}", (d_in, d_out)))
            specs.append((f"{b}/mlp/mlp.{j}/Add", f"blocks.{i}.mlp.mlp.{j}.bias", (d_out,)))
            n += 1
    specs += [("/quantizer/project_in/MatMul", "onnx::MatMul_2536", (S3_STATE, S3_FSQ_DIM)),
              ("/quantizer/project_in/Add", "quantizer.project_in.bias", (S3_FSQ_DIM,))]
    return specs


def _op_type(node_name: str) -> str:
    return node_name.rsplit("/", 1)[-1]


def write_s3_tokenizer_onnx(path: str | Path, seed: int, *, dtype: np.dtype | type = np.float32) -> None:
    """Random S3 tokenizer v2 initializers in a graph whose node and initializer names are the ones
    `s3tokenizer.load_model` converts. The graph is a chain of the named ops; it is not the tokenizer."""
    rng = np.random.default_rng(seed)
    # 124 M independent normals take seconds; cycling a prime-length pool from random offsets is
    # random enough for a stand-in and costs a memory copy.
    pool = rng.standard_normal(1_000_003, dtype=np.float32)
    initializers: list[onnx.TensorProto] = []
    inputs_of: dict[str, list[str]] = {}  # node name -> its initializer names
    for node_name, init_name, shape in _s3_tensors():
        values = np.resize(np.roll(pool, -int(rng.integers(pool.size))), shape)
        if len(shape) == 1:  # LayerNorm scales near 1, biases near 0
            centre = 1.0 if node_name.endswith("LayerNormalization") and init_name.endswith("weight") else 0.0
            data = values * np.float32(0.02) + np.float32(centre)
        else:
            fan_in = shape[0] if _op_type(node_name) == "MatMul" else int(np.prod(shape[1:]))
            data = values * np.float32(1.0 / np.sqrt(fan_in))
        initializers.append(numpy_helper.from_array(data.astype(dtype, copy=False), init_name))
        inputs_of.setdefault(node_name, []).append(init_name)
    nodes = []
    previous = "feats"
    for node_name, weights in inputs_of.items():
        op = _op_type(node_name)
        attrs: dict[str, Any] = {"group": S3_STATE} if "fsmn" in node_name else {}
        out = f"{node_name}_output_0"
        if op == "Add":  # exported biases come first: Add(bias, x)
            nodes.append(helper.make_node(op, [*weights, previous], [out], name=node_name))
        else:
            nodes.append(helper.make_node(op, [previous, *weights], [out], name=node_name, **attrs))
        previous = out
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(
        nodes, "speech_tokenizer_v2_standin",
        [helper.make_tensor_value_info("feats", elem, ["B", S3_MELS, "T"])],
        [helper.make_tensor_value_info(previous, elem, None)], initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))


__all__ = ["hift_checkpoint_state", "render_flow_yaml", "write_campplus_onnx",
           "write_official_layout", "write_s3_tokenizer_onnx"]
