"""CAM++ on TensorRT: an engine built from the same ONNX file onnxruntime runs, called like `CampPlus`.

`on_tensorrt(campplus)` returns a `TensorRTCampPlus` when the campplus's device is CUDA and `tensorrt`
(the optional `cuda` extra) is importable and builds the engine; otherwise the campplus as it was, with
the reason logged once loudly and counted (`gpu_worker.fallbacks`: wavefarm_worker_fallbacks_total{part=
"speaker"}; a slower CAM++ beats no worker). Inputs longer than the engine's profile, and calls
while a build is impossible, go to the onnxruntime CAM++ it wraps. An execution context serves one call
at a time, so calls hold a lock.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
from torch import Tensor

from gpu_worker import fallbacks
from gpu_worker.voices.speaker import FBANK_BINS, SPEAKER_DIM, CampPlus

log = logging.getLogger(__name__)

TRT_MAX_FRAMES = 3000  # 30 s of fbank; a 6 s prompt has 598
TRT_OPT_FRAMES = 600


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401 - importable is what is asked
    except ImportError:
        return False
    return True


class _Engine:
    """The TensorRT engine of CAM++'s ONNX bytes: torch CUDA tensors in and out."""

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


class TensorRTCampPlus:
    """CAM++ with `CampPlus`'s call: fbank80 [Tf, 80] or [1, Tf, 80] -> [1, 192] float32 on its device."""

    def __init__(self, campplus: CampPlus, engine: _Engine) -> None:
        self.campplus, self.engine, self.device = campplus, engine, campplus.device

    @torch.inference_mode()
    def __call__(self, fbank80: Tensor) -> Tensor:
        x = fbank80[None] if fbank80.dim() == 2 else fbank80
        if x.dim() == 3 and x.size(0) == 1 and x.size(2) == FBANK_BINS and 0 < x.size(1) <= TRT_MAX_FRAMES:
            return self.engine(x.to(self.device, torch.float32))
        return self.campplus(fbank80)  # checks the shape, refuses a bad one


def on_tensorrt(campplus: CampPlus) -> CampPlus | TensorRTCampPlus:
    """CAM++ on TensorRT where it can be (module docstring), else `campplus` unchanged."""
    if campplus.device.type != "cuda":
        return campplus
    if not tensorrt_available():
        fallbacks.record("worker", "speaker", "tensorrt_not_installed",
                         "CAM++ stays on onnxruntime (install the `cuda` extra for TensorRT)")
        return campplus
    try:
        engine = _Engine(campplus.onnx_bytes, campplus.device)
    except Exception as exc:  # tensorrt raises assorted types; a slower CAM++ beats no worker
        fallbacks.record("worker", "speaker", "tensorrt_build_failed",
                         f"CAM++ stays on onnxruntime: {type(exc).__name__}: {exc}")
        return campplus
    log.info("CAM++ on TensorRT (%s)", campplus.device)
    return TensorRTCampPlus(campplus, engine)


def engine_of(campplus: Any) -> _Engine | None:
    """The TensorRT engine behind a CAM++, if it runs on one."""
    return campplus.engine if isinstance(campplus, TensorRTCampPlus) else None
