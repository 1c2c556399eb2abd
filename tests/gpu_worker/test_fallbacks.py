"""Degrade, never die (`gpu_worker.fallbacks`), each failure injected on the CPU: a missing bf16 kernel
(the worker builds in float32 and decodes), a refused fused attention kernel (the written-out arithmetic,
the same audio within rounding), TensorRT missing or failing to build (CAM++ stays on onnxruntime); each
logged once at ERROR, counted every time, and served as wavefarm_worker_fallbacks_total{part,reason}."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from app.settings import Settings
from gpu_worker import fallbacks
from gpu_worker.accel import tensorrt
from gpu_worker.engine.streams import Audio, EngineJob, Finished
from gpu_worker.model import attention
from gpu_worker.worker.metrics import WorkerMetrics
from gpu_worker.worker.runtime import build_engine
from tests.support.fakes import FakePreparer, host_features

VOICE = "a" * 64


@pytest.fixture(autouse=True)
def clean_counts():
    fallbacks.reset()
    yield
    fallbacks.reset()


class Store:
    """The feature store holding one voice with a real-length prompt."""

    def get(self, voice_id: str):
        return host_features(voice_id, seed=1) if voice_id == VOICE else None


def decode_one(engine) -> torch.Tensor:
    engine.add(EngineJob("j1", VOICE, list(range(40)), seed=3))
    audio, done = [], False
    for _ in range(5000):  # steps; an idle one (the admission window) sleeps as the worker's loop does
        engine.fetch_features()
        events = engine.step()
        if not events:
            time.sleep(min(engine.idle_hint_s(), 0.01))
        for event in events:
            if isinstance(event, Audio):
                audio.append(event.samples)
            done = done or isinstance(event, Finished)
        if done:
            break
    assert done
    return torch.cat(audio)


def metrics_text(engine) -> str:
    registry = CollectorRegistry()
    WorkerMetrics(registry, engine.snapshot)
    return generate_latest(registry).decode()


def test_a_missing_bf16_kernel_builds_the_worker_in_float32_logs_once_and_counts(monkeypatch, caplog):
    def refuse(device, dtype):
        if dtype == torch.bfloat16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'BFloat16\'')

    monkeypatch.setattr(fallbacks, "KERNEL_KINDS", refuse)
    settings = Settings(model_preset="tiny", dtype="bf16")
    with caplog.at_level(logging.DEBUG, logger="gpu_worker.fallbacks"):
        engine = build_engine(settings, Store(), FakePreparer())
        build_engine(settings, Store(), FakePreparer())  # a second build: counted, not shouted
    assert engine.decoder.dtype == torch.float32
    assert next(engine.decoder.model.flow.parameters()).dtype == torch.float32
    assert decode_one(engine).numel() == 40 * 960  # and the job goes on
    assert fallbacks.counts("worker") == {("dtype", "bfloat16_kernel_missing"): 2}
    loud = [r for r in caplog.records if r.levelno == logging.ERROR and "FALLBACK" in r.message]
    assert len(loud) == 1 and "BFloat16" in loud[0].message
    assert 'wavefarm_worker_fallbacks_total{part="dtype",reason="bfloat16_kernel_missing"} 2.0' in \
        metrics_text(engine)


def test_bf16_that_runs_is_kept_and_counts_nothing():
    assert fallbacks.usable_dtype(torch.device("cpu"), torch.bfloat16) == torch.bfloat16
    assert fallbacks.usable_dtype(torch.device("cpu"), torch.float32) == torch.float32
    assert fallbacks.total() == 0


def test_a_refused_fused_attention_kernel_falls_back_to_the_written_out_arithmetic(monkeypatch):
    store = Store()
    plain = decode_one(build_engine(Settings(model_preset="tiny"), store, FakePreparer()))
    assert fallbacks.total() == 0  # the CPU's fused kernel runs here

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(attention, "_fused", broken)
    monkeypatch.setattr(attention, "_FUSED", {})
    engine = build_engine(Settings(model_preset="tiny"), store, FakePreparer())
    assert fallbacks.counts("worker") == {("attention", "fused_kernel_refused"): 1}
    written_out = decode_one(engine)
    assert written_out.shape == plain.shape and (written_out - plain).abs().max().item() < 1e-4
    assert 'wavefarm_worker_fallbacks_total{part="attention",reason="fused_kernel_refused"} 1.0' in \
        metrics_text(engine)


class CudaCampPlus:
    """A CAM++ on a CUDA device (as far as `on_tensorrt` asks): its device and ONNX bytes."""

    device = torch.device("cuda")
    onnx_bytes = b"not an onnx file"


def test_tensorrt_missing_or_failing_leaves_campplus_on_onnxruntime_and_counts_it(monkeypatch):
    campplus = CudaCampPlus()
    monkeypatch.setattr(tensorrt, "tensorrt_available", lambda: False)
    assert tensorrt.on_tensorrt(campplus) is campplus

    def no_engine(onnx_bytes, device):
        raise RuntimeError("TensorRT cannot parse CAM++: bad bytes")

    monkeypatch.setattr(tensorrt, "tensorrt_available", lambda: True)
    monkeypatch.setattr(tensorrt, "_Engine", no_engine)
    assert tensorrt.on_tensorrt(campplus) is campplus
    assert tensorrt.on_tensorrt(campplus) is campplus
    assert fallbacks.counts("worker") == {("speaker", "tensorrt_not_installed"): 1,
                                          ("speaker", "tensorrt_build_failed"): 2}
