"""Checks a token2wav model folder and lists all its problems, not just the first (`wavefarm model check`).

    check_folder(path, preset=None) -> Report(folder, preset, problems); `report.ok` when there are none
    python -m gpu_worker.checkpoint.check DIR [--preset P] [--print-env]   what `wavefarm model check` (and
        `model pull`, with --print-env) runs: one line per problem and exit 1, or the ok line and exit 0

What is checked, each file on its own so one bad file does not hide another:
    the five files of `app.speech.MODEL_FILES` are there
    flow.yaml is the supported architecture (`gpu_worker.checkpoint.flow_yaml`, the worker's own reader)
    flow.pt and hift.pt: names, shapes and kinds of dtype against the modules built on `meta` (nothing is
        allocated), as `gpu_worker.checkpoint.load` will assign them; weights are read with weights_only=True
    campplus.onnx and the S3 tokenizer: readable ONNX with the inputs (and CAM++'s output) the worker
        feeds them (`gpu_worker.voices.speaker`, `app.s3`); their weights are not checked here

The preset is the one flow.yaml describes; when flow.yaml is missing or refused, the one the weights fit
best, so their report still means something. The CLI runs this as a child process because `app` never
imports the worker packages (docs/ARCHITECTURE.md). Not in here: loading anything onto a device, running
a model, downloading (`app.cli.model`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch

from app.errors import ModelLoadError, first_line
from app.s3 import S3_MELS
from app.speech import CAMPPLUS_ONNX, FLOW_PT, FLOW_YAML, HIFT_PT, MODEL_FILES, TOKENIZER_ONNX
from gpu_worker.checkpoint.flow_yaml import read_flow_config
from gpu_worker.checkpoint.load import _build_flow, _read_state_dict, normalize_hift_state
from gpu_worker.model.config import ModelArgs
from gpu_worker.model.hift import HiFTGenerator
from gpu_worker.voices.speaker import FBANK_BINS, SPEAKER_DIM

PRESETS = ("full", "tiny")  # ModelArgs.preset's names; the first is what the releases are
SHOWN_PER_KIND = 5  # missing keys, unexpected keys, ... listed one by one before "and N more"

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Report:
    """What `check_folder` found: the preset it checked against and one line per problem."""

    folder: Path
    preset: str
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class Mismatch:
    """How one state dict differs from a module's: each list holds one line per key."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shapes: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.missing) + len(self.unexpected) + len(self.shapes) + len(self.dtypes)

    def lines(self, file: Path) -> list[str]:
        out = []
        for kind, kinds, items in (("missing key", "missing keys", self.missing),
                                   ("unexpected key", "unexpected keys", self.unexpected),
                                   ("shape mismatch", "shape mismatches", self.shapes),
                                   ("dtype mismatch", "dtype mismatches", self.dtypes)):
            out += [f"{file}: {kind} {item}" for item in items[:SHOWN_PER_KIND]]
            if len(items) > SHOWN_PER_KIND:
                out.append(f"{file}: ... and {len(items) - SHOWN_PER_KIND} more ({len(items)} {kinds})")
        return out


def compare_state(module: torch.nn.Module, state: State) -> Mismatch:
    """Every difference between `state` and what `module.load_state_dict(strict=True)` takes."""
    expected = module.state_dict()
    found = Mismatch(missing=sorted(expected.keys() - state.keys()),
                     unexpected=sorted(state.keys() - expected.keys()))
    for name in sorted(expected.keys() & state.keys()):
        got, want = state[name], expected[name]
        if got.shape != want.shape:
            found.shapes.append(f"{name}: {tuple(got.shape)}, expected {tuple(want.shape)}")
        elif got.dtype.is_floating_point != want.dtype.is_floating_point or got.is_complex():
            found.dtypes.append(f"{name}: {got.dtype}, expected a {want.dtype}-like tensor")
    return found


def check_folder(path: str | Path, *, preset: str | None = None) -> Report:
    """Checks every file of a token2wav folder; `preset` forces the architecture (default: detected)."""
    folder = Path(path)
    if not folder.is_dir():
        return Report(folder, preset or PRESETS[0], [f"{folder}: not a folder"])
    problems = [f"{folder / name}: missing" for name in MODEL_FILES if not (folder / name).is_file()]
    states: dict[str, State] = {}
    for name in (FLOW_PT, HIFT_PT):
        if (folder / name).is_file():
            try:
                states[name] = _read_state_dict(folder / name)
            except ModelLoadError as exc:
                problems.append(str(exc))
    if HIFT_PT in states:
        states[HIFT_PT] = normalize_hift_state(states[HIFT_PT])
    chosen = preset or _detect_preset(folder, states)
    args = ModelArgs.preset(chosen)
    if (folder / FLOW_YAML).is_file():
        try:
            read_flow_config(folder / FLOW_YAML, args.flow)
        except ModelLoadError as exc:
            problems.append(str(exc))
    for name, mismatch in _weights_mismatches(args, states).items():
        problems += mismatch.lines(folder / name)
    for name, check in ((CAMPPLUS_ONNX, _campplus_problems), (TOKENIZER_ONNX, _tokenizer_problems)):
        if (folder / name).is_file():
            problems += _onnx_problems(folder / name, check)
    return Report(folder, chosen, problems)


def _detect_preset(folder: Path, states: dict[str, State]) -> str:
    for name in PRESETS:
        try:
            read_flow_config(folder / FLOW_YAML, ModelArgs.preset(name).flow)
            return name
        except ModelLoadError:
            continue
    # flow.yaml is missing or refused: judge the weights against the architecture they fit best.
    return min(PRESETS, key=lambda name: sum(m.count for m in _weights_mismatches(
        ModelArgs.preset(name), states).values()))


def _weights_mismatches(args: ModelArgs, states: dict[str, State]) -> dict[str, Mismatch]:
    with torch.device("meta"):  # shapes only: nothing is allocated
        modules: dict[str, torch.nn.Module] = {FLOW_PT: _build_flow(args.flow),
                                               HIFT_PT: HiFTGenerator(args.hift)}
    return {name: compare_state(modules[name], state) for name, state in states.items()}


def _onnx_problems(file: Path, check: Callable[[Sequence[Any], Sequence[Any]], str | None]) -> list[str]:
    try:
        model = onnx.load(str(file), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and onnx's own errors: all one answer
        return [f"{file}: not a readable ONNX model ({first_line(exc)})"]
    initializers = {init.name for init in model.graph.initializer}
    # Older exporters list initializers among the graph inputs; the worker feeds only the others.
    inputs = [(i.name, _dims(i)) for i in model.graph.input if i.name not in initializers]
    outputs = [(o.name, _dims(o)) for o in model.graph.output]
    problem = check(inputs, outputs)
    return [f"{file}: {problem}"] if problem else []


def _dims(value: onnx.ValueInfoProto) -> tuple[int | str, ...] | None:
    """An input's or output's shape: ints where fixed, the symbol (or '?') where not; None if unknown."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tensor.shape.dim)


def _show(values: Sequence[tuple[str, Any]]) -> str:
    shown = [f"{name} {list(dims) if dims is not None else '(no shape)'}" for name, dims in values]
    return ", ".join(shown) or "none"


def _campplus_problems(inputs: Sequence[Any], outputs: Sequence[Any]) -> str | None:
    # gpu_worker.voices.speaker.CampPlus feeds one fbank [1, T, 80] and reads one embedding [1, 192].
    shape_in = inputs[0][1] if len(inputs) == 1 else None
    shape_out = outputs[0][1] if len(outputs) == 1 else None
    fits_in = shape_in is not None and len(shape_in) == 3 and shape_in[2] == FBANK_BINS
    fits_out = len(outputs) == 1 and (not shape_out or not isinstance(shape_out[-1], int)
                                      or shape_out[-1] == SPEAKER_DIM)
    if fits_in and fits_out:
        return None
    return (f"expected one input (1, T, {FBANK_BINS}) and one output (1, {SPEAKER_DIM}), "
            f"got inputs {_show(inputs)} and outputs {_show(outputs)}")


def _tokenizer_problems(inputs: Sequence[Any], outputs: Sequence[Any]) -> str | None:
    # The S3 tokenizer v2 reads log-mel [B, 128, T] first (the released file adds its lengths as a second
    # input); app.s3 converts the file to torch, so only the interface is checked here.
    shape = inputs[0][1] if inputs else None
    if shape is not None and len(shape) == 3 and shape[1] == S3_MELS:
        return None
    return f"expected a first input (B, {S3_MELS}, T) of log-mel frames, got inputs {_show(inputs)}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wavefarm model check",
                                     description="List everything wrong with a token2wav model folder.")
    parser.add_argument("dir", type=Path, help="the folder (flow.yaml, flow.pt, hift.pt, two ONNX files)")
    parser.add_argument("--preset", choices=PRESETS, help="check against this (default: flow.yaml's)")
    parser.add_argument("--print-env", action="store_true",
                        help="when it passes, also print the WAVEFARM_* lines that select the folder")
    args = parser.parse_args(argv)
    report = check_folder(args.dir, preset=args.preset)
    for problem in report.problems:
        print(problem)
    if not report.ok:
        print(f"{report.folder}: {len(report.problems)} problem(s) (preset {report.preset})")
        return 1
    print(f"ok: {report.folder} is a complete token2wav folder (preset {report.preset})")
    if args.print_env:
        print(f"WAVEFARM_MODEL_DIR={report.folder}")
        if report.preset != PRESETS[0]:  # the settings' default is the released architecture
            print(f"WAVEFARM_MODEL_PRESET={report.preset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
