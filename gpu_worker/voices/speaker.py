"""Speaker-side models of the device half: S3 tokenizer v2 (prompt tokens) and CAM++ (speaker embedding).

    S3Quantizer.load(path, device=...)(logmel128 [128, T16]) -> prompt tokens [1, Tp] int64
    CampPlus(path, device=..., intra_op_threads=1)(fbank80 [Tf, 80]) -> embedding [1, 192] float32
    quantize_and_embed(logmel128, fbank80, tokenizer, campplus) -> (tokens [1, Tp], embedding [1, 192])
    SpeakerFrontend: both, with the `quantize_and_embed` method gpu_worker.voices.prompt's `Speaker` asks for

CAM++ runs on onnxruntime's CPU provider here; on CUDA the composition root may put it on TensorRT
(`gpu_worker.accel.tensorrt.on_tensorrt`, a wrapper with the same call).

`S3Quantizer` lives in `app.s3` (the CPU-side book pipeline tokenizes speech with it too) and is
re-exported here. Not in here: the host half that computes the log-mel and fbank (`app.voices.features`),
the setup solve.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.errors import ModelLoadError
from app.s3 import S3_MELS, S3Quantizer, _require_file
from app.speech import CAMPPLUS_ONNX, TOKENIZER_ONNX

log = logging.getLogger(__name__)

__all__ = ["S3_MELS", "CampPlus", "S3Quantizer", "SpeakerFrontend", "quantize_and_embed"]

FBANK_BINS, SPEAKER_DIM = 80, 192


class CampPlus:
    """CAM++ speaker encoder: fbank [Tf, 80] (mean-normalised) -> embedding [1, 192] on `device`."""

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu", intra_op_threads: int = 1):
        import onnxruntime

        file = _require_file(Path(path))
        self.device = torch.device(device)
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = intra_op_threads
        options.inter_op_num_threads = 1
        onnx_bytes = file.read_bytes()
        try:
            self.session = onnxruntime.InferenceSession(onnx_bytes, sess_options=options,
                                                        providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own exception types for bad files
            raise ModelLoadError(f"{file}: not a readable ONNX model ({exc})") from exc
        self._check_signature(file)
        self.input_name = self.session.get_inputs()[0].name
        self.onnx_bytes = onnx_bytes  # what a TensorRT engine is built from (accel.tensorrt)
        log.info("CAM++ from %s on onnxruntime CPU", file)

    def _check_signature(self, file: Path) -> None:
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        shape_in = inputs[0].shape if len(inputs) == 1 else None
        if shape_in is None or len(shape_in) != 3 or shape_in[2] != FBANK_BINS or len(outputs) != 1:
            raise ModelLoadError(f"{file}: expected one input (1, T, {FBANK_BINS}) and one output, "
                                 f"got {[i.shape for i in inputs]} -> {[o.shape for o in outputs]}")

    @torch.inference_mode()
    def __call__(self, fbank80: Tensor) -> Tensor:
        # fbank80: [Tf, 80] or [1, Tf, 80] -> [1, 192] float32 on self.device
        x = fbank80[None] if fbank80.dim() == 2 else fbank80
        if x.dim() != 3 or x.size(0) != 1 or x.size(2) != FBANK_BINS or x.size(1) == 0:
            raise ValueError(f"CAM++ fbank must be [T > 0, 80], got {tuple(fbank80.shape)}")
        feed = {self.input_name: x.detach().to("cpu", torch.float32).numpy()}
        out = np.asarray(self.session.run(None, feed)[0], dtype=np.float32).reshape(1, -1)
        if out.shape != (1, SPEAKER_DIM):
            raise ValueError(f"CAM++ returned {out.shape}, expected (1, {SPEAKER_DIM})")
        return torch.from_numpy(out).to(self.device)


def quantize_and_embed(host_logmel128: Tensor, host_fbank80: Tensor, tokenizer: S3Quantizer,
                       campplus: Any) -> tuple[Tensor, Tensor]:
    """Device half, step 1: prompt tokens [1, Tp] int64 and speaker embedding [1, 192] float32, on the
    tokenizer's device (CAM++ results are moved there)."""
    tokens = tokenizer(host_logmel128)
    embedding = campplus(host_fbank80).to(tokens.device)
    return tokens, embedding


class SpeakerFrontend:
    """S3 tokenizer + CAM++ of one model folder; satisfies `gpu_worker.voices.prompt.Speaker`."""

    def __init__(self, tokenizer: S3Quantizer, campplus: Any):  # a CampPlus, or one on TensorRT
        self.tokenizer = tokenizer
        self.campplus = campplus

    @classmethod
    def from_folder(cls, folder: str | Path, *, device: str | torch.device = "cpu",
                    intra_op_threads: int = 1) -> SpeakerFrontend:
        folder = Path(folder)
        return cls(S3Quantizer.load(folder / TOKENIZER_ONNX, device=device),
                   CampPlus(folder / CAMPPLUS_ONNX, device=device, intra_op_threads=intra_op_threads))

    def quantize_and_embed(self, logmel128: Tensor, fbank80: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_and_embed(logmel128, fbank80, self.tokenizer, self.campplus)
