"""Speaker-side models of the device half: S3 tokenizer v2 (prompt tokens) and CAM++ (speaker embedding).

    S3Quantizer.load(path, device=...)(logmel128 [128, T16]) -> prompt tokens [1, Tp] int64
    CampPlus(path, device=..., intra_op_threads=1)(fbank80 [Tf, 80]) -> embedding [1, 192] float32
    quantize_and_embed(logmel128, fbank80, tokenizer, campplus) -> (tokens [1, Tp], embedding [1, 192])
    SpeakerFrontend: both, with the `quantize_and_embed` method gpu_worker.prompt's `Speaker` asks for

CAM++ runs on onnxruntime's CPU provider; on a CUDA device, when `tensorrt` is importable, a TensorRT
engine is built from the same ONNX file and called with the same signature (one lock per engine: an
execution context serves one call at a time). Inputs longer than the engine's profile fall back to
onnxruntime.

`S3Quantizer` lives in `app.s3` (the CPU-side book pipeline tokenizes speech with it too) and is
re-exported here. Not in here: the host half that computes the log-mel and fbank (`app.features`),
the setup solve.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from app.errors import ModelLoadError
from app.s3 import S3_MELS, S3_VOCAB, S3Quantizer, _require_file
from gpu_worker.loading import CAMPPLUS_ONNX, TOKENIZER_ONNX

log = logging.getLogger(__name__)

__all__ = ["S3_MELS", "S3_VOCAB", "CampPlus", "S3Quantizer", "SpeakerFrontend", "quantize_and_embed",
           "tensorrt_available"]

FBANK_BINS, SPEAKER_DIM = 80, 192
TRT_MAX_FRAMES = 3000  # 30 s of fbank; a 6 s prompt has 598
TRT_OPT_FRAMES = 600


class _TensorRTSpeaker:
    """CAM++ as a TensorRT engine built from the ONNX bytes; torch CUDA tensors in and out."""

    def __init__(self, onnx_bytes: bytes, device: torch.device):
        import tensorrt as trt  # optional: the `cuda` extra

        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        network = builder.create_network(0)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse(onnx_bytes):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT cannot parse CAM++: {errors}")
        self.input_name = network.get_input(0).name
        self.output_name = network.get_output(0).name
        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        profile.set_shape(self.input_name, (1, 1, FBANK_BINS), (1, TRT_OPT_FRAMES, FBANK_BINS),
                          (1, TRT_MAX_FRAMES, FBANK_BINS))
        config.add_optimization_profile(profile)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise RuntimeError("TensorRT could not build the CAM++ engine")
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
        self.context = self.engine.create_execution_context()
        self.device = device
        self.lock = threading.Lock()

    def __call__(self, fbank: Tensor) -> Tensor:
        # fbank: [1, T, 80] float32 on the CUDA device -> [1, 192]
        stream = torch.cuda.current_stream(self.device)
        x = fbank.contiguous()
        x.record_stream(stream)  # the engine reads it asynchronously on this stream
        out = torch.empty(1, SPEAKER_DIM, device=self.device, dtype=torch.float32)
        with self.lock:
            self.context.set_input_shape(self.input_name, tuple(x.shape))
            self.context.set_tensor_address(self.input_name, x.data_ptr())
            self.context.set_tensor_address(self.output_name, out.data_ptr())
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT CAM++ execution failed")
        return out


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


class CampPlus:
    """CAM++ speaker encoder: fbank [Tf, 80] (mean-normalised) -> embedding [1, 192] on `device`."""

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu", intra_op_threads: int = 1,
                 use_tensorrt: bool | None = None):
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
        if use_tensorrt is None:
            use_tensorrt = self.device.type == "cuda" and tensorrt_available()
        self.trt: Any = self._build_tensorrt(onnx_bytes) if use_tensorrt else None
        log.info("CAM++ from %s on %s", file, "TensorRT" if self.trt else "onnxruntime CPU")

    def _build_tensorrt(self, onnx_bytes: bytes) -> _TensorRTSpeaker | None:
        if self.device.type != "cuda":
            raise ValueError(f"CAM++ TensorRT needs a CUDA device, not {self.device}")
        try:
            return _TensorRTSpeaker(onnx_bytes, self.device)
        except Exception as exc:  # tensorrt raises assorted types; a slower CAM++ beats no worker
            log.warning("CAM++ stays on onnxruntime: %s", exc)
            return None

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
        if self.trt is not None and x.size(1) <= TRT_MAX_FRAMES:
            return self.trt(x.to(self.device, torch.float32))
        feed = {self.input_name: x.detach().to("cpu", torch.float32).numpy()}
        out = np.asarray(self.session.run(None, feed)[0], dtype=np.float32).reshape(1, -1)
        if out.shape != (1, SPEAKER_DIM):
            raise ValueError(f"CAM++ returned {out.shape}, expected (1, {SPEAKER_DIM})")
        return torch.from_numpy(out).to(self.device)


def quantize_and_embed(host_logmel128: Tensor, host_fbank80: Tensor, tokenizer: S3Quantizer,
                       campplus: CampPlus) -> tuple[Tensor, Tensor]:
    """Device half, step 1: prompt tokens [1, Tp] int64 and speaker embedding [1, 192] float32, on the
    tokenizer's device (CAM++ results are moved there)."""
    tokens = tokenizer(host_logmel128)
    embedding = campplus(host_fbank80).to(tokens.device)
    return tokens, embedding


class SpeakerFrontend:
    """S3 tokenizer + CAM++ of one model folder; satisfies `gpu_worker.prompt.Speaker`."""

    def __init__(self, tokenizer: S3Quantizer, campplus: CampPlus):
        self.tokenizer = tokenizer
        self.campplus = campplus

    @classmethod
    def from_folder(cls, folder: str | Path, *, device: str | torch.device = "cpu", intra_op_threads: int = 1,
                    use_tensorrt: bool | None = None) -> SpeakerFrontend:
        folder = Path(folder)
        return cls(S3Quantizer.load(folder / TOKENIZER_ONNX, device=device),
                   CampPlus(folder / CAMPPLUS_ONNX, device=device, intra_op_threads=intra_op_threads,
                            use_tensorrt=use_tensorrt))

    def quantize_and_embed(self, logmel128: Tensor, fbank80: Tensor) -> tuple[Tensor, Tensor]:
        return quantize_and_embed(logmel128, fbank80, self.tokenizer, self.campplus)
