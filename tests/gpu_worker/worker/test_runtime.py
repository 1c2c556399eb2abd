"""The worker's runtime builds its engine from the settings: linear path, vocoder dtype, install lane,
admission window, batched installs."""

from __future__ import annotations

import threading

import pytest
import torch

from app.db import queries
from app.db.session import make_engine, make_sessionmaker
from app.dev import SAMPLES
from app.settings import Settings
from gpu_worker.accel.onednn import cpu_linear_of
from gpu_worker.worker.runtime import build_engine


class Nothing:
    """Features source and preparer of an engine that is only built, never run."""

    def get(self, voice_id: str):
        return None

    def prepare(self, job):
        raise AssertionError("not called")


def test_the_worker_runtime_follows_the_setting() -> None:
    for kind in ("blas", "onednn"):
        engine = build_engine(Settings(model_preset="tiny", cpu_linear=kind), Nothing(), Nothing())
        assert cpu_linear_of(engine.decoder.model) == kind


def test_the_worker_runtime_builds_the_vocoder_in_its_setting() -> None:
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        engine = build_engine(Settings(model_preset="tiny", hift_dtype=name), Nothing(), Nothing())
        hift = engine.decoder.model.hift
        assert engine.decoder.hift_dtype() == hift.ups[0].weight.dtype == dtype
        assert hift.conv_post.weight.dtype == hift.f0_predictor.classifier.weight.dtype == torch.float32
        assert not any("parametrizations" in k for k in hift.state_dict())  # weight norm folded


def test_the_worker_runtime_gives_a_cpu_engine_an_install_lane_only_when_asked() -> None:
    assert build_engine(Settings(model_preset="tiny"), Nothing(), Nothing()).resolver.install_lane is None
    engine = build_engine(Settings(model_preset="tiny", install_lane=True), Nothing(), Nothing())
    assert engine.resolver.install_lane is not None
    assert engine.resolver.install_lane.submit(lambda: threading.current_thread().name).result().startswith(
        "wavefarm-install-lane")
    engine.resolver.install_lane.shutdown()


def test_the_worker_runtime_gives_the_engine_its_admission_window() -> None:
    assert build_engine(Settings(model_preset="tiny"), Nothing(), Nothing()).admission_window_s == 0.5
    engine = build_engine(Settings(model_preset="tiny", admission_window_ms=0), Nothing(), Nothing())
    assert engine.admission_window_s == 0


def test_the_worker_runtime_batches_installs_as_set_with_the_real_device_half() -> None:
    from app.audio import load_reference
    from app.voices.features import host_half

    assert build_engine(Settings(model_preset="tiny"), Nothing(), Nothing()).resolver.install_batch == 1
    engine = build_engine(Settings(model_preset="tiny", install_batch=2), Nothing(), Nothing())
    assert engine.resolver.install_batch == 2
    hosts = [host_half(*load_reference((SAMPLES / name).read_bytes()))
             for name in ("voice_a.wav", "voice_b.wav")]
    entries = engine.voices.install_many(hosts)  # through the runtime's batch installer: one setup solve
    assert [e.voice_id for e in entries] == [h.voice_id for h in hosts]
    assert all(e.prompt.prompt_len == 300 and e.voice_id in engine.voices for e in entries)
    assert entries[0].install_s == entries[1].install_s > 0  # one call for both


def test_the_worker_runtime_runs_the_flow_steps_it_is_set_to_and_refuses_a_voice_of_another_count() -> None:
    from app.audio import load_reference
    from app.voices.features import host_half
    from gpu_worker.engine.streams import ChunkRow

    host = host_half(*load_reference((SAMPLES / "voice_a.wav").read_bytes()))
    tokens = torch.arange(100, 128)
    engines = {n: build_engine(Settings(model_preset="tiny", flow_steps=n), Nothing(), Nothing())
               for n in (6, 10)}
    audio = {}
    for n, engine in engines.items():
        assert engine.decoder.model.flow.decoder.n_steps == n
        prompt = engine.voices.install(host).prompt
        assert prompt.flow_steps == n and prompt.estimator_cnn_cache.size(0) == n
        stream = engine.decoder.open_stream(prompt, seed=1)
        audio[n] = engine.decoder.step([ChunkRow(stream, tokens, False)])[0]
    assert audio[6].shape == audio[10].shape and not torch.equal(audio[6], audio[10])
    with pytest.raises(ValueError, match="installed for 10 flow steps"):
        engines[6].decoder.open_stream(engines[10].voices.get(host.voice_id).prompt, seed=1)


def test_only_the_supported_flow_step_counts_are_accepted() -> None:
    with pytest.raises(ValueError, match="flow steps must be one of"):
        Settings(flow_steps=7)


def test_cuda_graphs_leave_a_cpu_worker_eager_and_their_figures_reach_the_worker_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from gpu_worker.accel.graphs import GraphedHiFT
    from gpu_worker.worker.metrics import WorkerMetrics

    engine = build_engine(Settings(model_preset="tiny", cuda_graphs=True), Nothing(), Nothing())
    assert not isinstance(engine.decoder.model.hift, GraphedHiFT)  # the setting is for CUDA devices
    assert engine.decoder.stats() == {}
    graphed = GraphedHiFT(engine.decoder.model.hift)
    graphed.capture_s, graphed.graph_bytes = 1.5, 4096
    engine.decoder.model.hift = graphed
    registry = CollectorRegistry()
    WorkerMetrics(registry, engine.snapshot)
    text = generate_latest(registry).decode()
    for line in ('wavefarm_worker_cuda_graphs{part="vocoder"} 0.0',
                 'wavefarm_worker_cuda_graphs{part="flow"} 0.0',
                 'wavefarm_worker_graph_capture_seconds_total{part="vocoder"} 1.5',
                 'wavefarm_worker_graph_bytes{part="vocoder"} 4096.0'):
        assert line in text


def test_a_worker_records_its_slots_as_it_registers_for_the_router(make_runtime) -> None:
    rt = make_runtime(model_preset="tiny", worker_slots=3, micro_batch_size=3)
    with rt.sessions() as session:
        assert queries.worker_slots(session=session, workers=[rt.worker_id]) == {rt.worker_id: 3}


def test_a_runtime_that_fails_to_build_leaves_no_heartbeat_behind(sqlite_url, artifacts, store,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each synth task asks for the runtime again while none exists: a build that failed after its
    registration must not leave its heartbeat thread beating under the name the next build takes (it
    logged "another process registered under this name" ever more often, and the worker took no job)."""
    from gpu_worker.worker import runtime as worker_runtime
    from tests.support.runtime import settings_for

    def broken(*_: object, **__: object) -> None:
        raise OSError("no such folder for the metrics")

    monkeypatch.setattr(worker_runtime, "WorkerMetrics", broken)
    beating = {t.ident for t in threading.enumerate() if t.name == "wavefarm-heartbeat"}
    with pytest.raises(OSError):
        worker_runtime.build_runtime(settings_for(sqlite_url, artifacts), "gpu-broken@test")
    engine = make_engine(sqlite_url)
    with make_sessionmaker(engine)() as session:
        assert queries.get_worker(session=session, name="gpu-broken@test").heartbeat_at is None  # stopped
    engine.dispose()
    stopped = [t for t in threading.enumerate() if t.name == "wavefarm-heartbeat" and t.ident not in beating]
    for thread in stopped:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in stopped)
