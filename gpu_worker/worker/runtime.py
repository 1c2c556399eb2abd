"""The GPU worker's composition root: settings -> the model, the decoder, the voice cache, the engine,
and the long-lived runtime around them.

    build_model(settings)                      -> (Code2Wav, Speaker): the folder's weights, or dummy
                                                  ones; the vocoder's dtype; acceleration (`accel`);
                                                  the probes of `fallbacks` (a missing bf16 kernel:
                                                  float32; the fused attention kernel)
    build_engine(settings, features, preparer) -> Engine, with its `EngineConfig` from the settings
    build_runtime(settings, worker_id)         -> Runtime: connections, this worker's install records, the
                                                  engine thread (`loop`) and its metrics (`metrics`), its
                                                  row in `workers` and the heartbeat (`presence`), the
                                                  text jobs' tokenizer lane (`guide`)
    guide_tokenizer(settings)                  -> the S3 tokenizer on the device (the stand-in without a
                                                  model folder)
    runtime(worker_id, sender)                 the process's runtime, built on first use

The `synth` tasks (`gpu_worker.worker.job`, `gpu_worker.worker.process`) are thin adapters over the runtime.
Nothing else builds a model for the service; the benchmarks and tests build theirs here too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import torch
from prometheus_client import REGISTRY, CollectorRegistry
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.broker.queues import Broker
from app.broker.wire import TaskSender
from app.context import Context
from app.db import queries
from app.db.session import session_scope
from app.s3 import S3Quantizer, StandInTokenizer, Tokenizer
from app.settings import Settings, get_settings
from app.speech import PROMPT_FRAMES, TOKENIZER_ONNX
from gpu_worker import fallbacks
from gpu_worker.accel.flow_graphs import graph_flow
from gpu_worker.accel.graphs import graph_hift
from gpu_worker.accel.onednn import use_cpu_linear
from gpu_worker.accel.tensorrt import on_tensorrt
from gpu_worker.checkpoint.load import DTYPES, load_dummy, load_model_folder, prepare_hift
from gpu_worker.engine.core import Engine, EngineConfig, FeatureSource, InlinePreparer
from gpu_worker.engine.decoder import StreamingDecoder
from gpu_worker.model import Code2Wav
from gpu_worker.model.config import ModelArgs
from gpu_worker.voices.cache import VoiceCache, install_lane
from gpu_worker.voices.prompt import Speaker, StandInSpeaker, install_voice, install_voices
from gpu_worker.voices.speaker import SpeakerFrontend
from gpu_worker.worker.adapters import ReferencePreparer, StoreFeatures
from gpu_worker.worker.bookkeeping import Bookkeeper, InstallRecords
from gpu_worker.worker.guide import TokenizeLane
from gpu_worker.worker.loop import EngineLoop
from gpu_worker.worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

HEARTBEAT_S = 10.0  # app.reconcile.dead_workers.WORKER_GONE_S counts a worker gone after six missed beats
EngineFactory = Callable[[Settings, FeatureSource, InlinePreparer], Engine]
DUMMY_SEED = 0
INLINE_PREP_THREADS = 1
_runtime: Runtime | None = None  # the process's runtime (see `runtime()`)
_runtime_lock = threading.Lock()


def engine_config(settings: Settings) -> EngineConfig:
    return EngineConfig(micro_batch_size=settings.micro_batch_size, prep_wait_ms=settings.prep_wait_ms,
                        admission_window_ms=settings.admission_window_ms,
                        install_batch=settings.install_batch)


def dummy_weights_note(settings: Settings) -> str:
    """What a job rendered without a model folder is told (its record's notes, the CLI, the web page)."""
    return (f"rendered with dummy weights (the GPU worker has no WAVEFARM_MODEL_DIR; preset "
            f"{settings.model_preset}): the audio is noise, not speech")


def model_dtype(settings: Settings) -> torch.dtype:
    """The configured dtype, or float32 where a kernel the model needs is missing in it (counted)."""
    return fallbacks.usable_dtype(torch.device(settings.device), DTYPES[settings.dtype])


def build_model(settings: Settings, dtype: torch.dtype | None = None) -> tuple[Code2Wav, Speaker]:
    """The model and the speaker models (S3 + CAM++) on the configured device, ready for inference, in
    `dtype` (default: `model_dtype(settings)`)."""
    device, dtype = torch.device(settings.device), dtype or model_dtype(settings)
    fallbacks.attention_probe(device, dtype)
    preset = ModelArgs.preset(settings.model_preset)
    args = replace(preset, flow=replace(preset.flow, n_timesteps=settings.flow_steps))
    speaker: Speaker
    if settings.model_dir is None:
        model = load_dummy(args, DUMMY_SEED, device=device, dtype=dtype)
        speaker = StandInSpeaker(device)
    else:
        model = load_model_folder(settings.model_dir, device=device, dtype=dtype, args=args)
        frontend = SpeakerFrontend.from_folder(settings.model_dir, device=device)
        frontend.campplus = on_tensorrt(frontend.campplus)  # on CUDA, when tensorrt is installed
        speaker = frontend
    prepare_hift(model.hift, DTYPES[settings.hift_dtype])  # g v / |v| folded once; the body's dtype
    use_cpu_linear(model, settings.cpu_linear)
    if settings.cuda_graphs and device.type == "cuda":
        # a wrapper with the module's call signature and attributes, not a HiFTGenerator subclass
        model.hift = graph_hift(model.hift, settings.micro_batch_size)  # type: ignore[assignment]
    return model, speaker


def guide_tokenizer(settings: Settings) -> Tokenizer:
    """The tokenizer of text jobs' guide speech, on the worker's device: the model folder's S3 tokenizer
    (a copy of its own beside the speaker models': the lane's thread runs it), or the stand-in."""
    if settings.model_dir is None:
        return StandInTokenizer()
    return S3Quantizer.load(settings.model_dir / TOKENIZER_ONNX, device=settings.device)


def build_engine(settings: Settings, features: FeatureSource, preparer: InlinePreparer) -> Engine:
    """Model, speaker models, decoder and voice cache on the configured device -> the engine."""
    if settings.torch_threads:
        # Small models on a busy CPU lose more to thread hand-offs than they gain (docs/PERFORMANCE.md).
        torch.set_num_threads(settings.torch_threads)
    dtype = model_dtype(settings)
    model, speaker = build_model(settings, dtype)
    device = torch.device(settings.device)
    decoder = StreamingDecoder(model, device=device, dtype=dtype,
                               micro_batch_size=settings.micro_batch_size)
    if device.type == "cuda":  # a lane for every job the slots hold, from the start: tensors that never move
        lanes = decoder.reserve(PROMPT_FRAMES, max(settings.worker_slots, settings.micro_batch_size))
        if settings.cuda_graphs:
            model.flow = graph_flow(model.flow, lanes, lanes.capacity)  # type: ignore[assignment]
    voices = VoiceCache(partial(install_voice, speaker=speaker, decoder=decoder), device=device,
                        max_voices=settings.voice_cache_capacity,
                        batch_installer=partial(install_voices, speaker=speaker, decoder=decoder))
    # Inline host halves run beside the decode loop (CPU work; torch releases the GIL in it).
    pool = ThreadPoolExecutor(max_workers=INLINE_PREP_THREADS, thread_name_prefix="wavefarm-inline-prep")
    # installs off the engine thread: on CUDA always (CAM++'s CPU half must not stall the decode)
    lane = install_lane(device, asked=settings.install_lane)
    return Engine(decoder, voices, features=features, preparer=preparer, config=engine_config(settings),
                  prep_pool=pool, install_lane=lane)


class Presence:
    """This process's row in `workers`: registered before the runtime claims any job (so a job claimed
    earlier under the same name was its killed predecessor's), a heartbeat every HEARTBEAT_S on its own
    thread, and marked stopped on a warm shutdown so nothing waits for its jobs."""

    def __init__(self, sessions: sessionmaker[Session], name: str, slots: int | None = None,
                 dummy_weights: bool | None = None) -> None:
        self.sessions, self.name = sessions, name
        with session_scope(sessions) as session:
            self.started_at = queries.register_worker(session=session, name=name, slots=slots,
                                                      dummy_weights=dummy_weights).started_at
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="wavefarm-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with session_scope(self.sessions) as session:
                    if not queries.beat(session=session, name=self.name, started_at=self.started_at):
                        log.error("worker %s: another process registered under this name", self.name)
            except OperationalError as exc:  # the database away for a while: beat again next time
                log.warning("worker %s: heartbeat not recorded: %s", self.name, exc)

    def stop(self) -> None:
        self._stop.set()
        try:
            with session_scope(self.sessions) as session:
                queries.mark_worker_stopped(session=session, name=self.name, started_at=self.started_at)
        except OperationalError as exc:
            log.warning("worker %s: not marked stopped: %s", self.name, exc)


class CpuBacklog:
    """How many tasks wait on the cpu queue, asked of the broker at most once a second: a job whose voice
    is still waiting for its CPU preparation behind more than `prep_queue_full` of them is prepared
    inline at once (prep path `queue_full`) instead of after the prep wait."""

    TTL_S = 1.0

    def __init__(self, settings: Settings, broker: Broker,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings, self.clock = settings, clock
        self._broker = broker  # the runtime's: closed with it
        self._depth, self._asked = 0, float("-inf")
        self._lock = threading.Lock()

    def depth(self) -> int:
        with self._lock:
            if self.clock() - self._asked >= self.TTL_S:
                try:
                    self._depth = self._broker.queue_depth(self.settings.queue_cpu)
                except Exception as exc:  # the broker away: no hint (the job waits as usual)
                    log.warning("cpu queue depth unknown: %s", exc)
                    self._depth = 0
                self._asked = self.clock()
            return self._depth

    def full(self) -> bool:
        bound = self.settings.prep_queue_full
        return bound > 0 and self.depth() > bound


@dataclass(kw_only=True)
class Runtime(Context):
    """A GPU worker process's clients (`app.context.Context`: its sender is the worker's Celery app, for
    the doorbells its reconciler rings) and what it adds: the engine loop, the bookkeeping of settling
    jobs and installs, metrics, the heartbeat."""

    worker_id: str
    loop: EngineLoop
    book: Bookkeeper
    installs: InstallRecords
    metrics: WorkerMetrics
    presence: Presence
    cpu_backlog: CpuBacklog
    guide: TokenizeLane

    def close(self) -> None:
        self.loop.stop()
        self.guide.close()
        self.presence.stop()
        self.book.drain()
        try:  # its device memory goes with the process: no job should be routed here for these voices
            with session_scope(self.sessions) as session:
                queries.clear_worker_voices(session=session, worker_id=self.worker_id)
        except OperationalError as exc:
            log.warning("worker %s: installs not cleared: %s", self.worker_id, exc)
        super().close()


def build_runtime(settings: Settings, worker_id: str, engine_factory: EngineFactory = build_engine,
                  registry: CollectorRegistry | None = None, sender: TaskSender | None = None) -> Runtime:
    """Everything one GPU worker process holds. Its metrics go to `registry` (a fresh one by default: a
    process may build several runtimes, as the tests do; the worker's own is the default registry); its
    doorbells go through `sender` (the worker's Celery app; by default a producer app of its own)."""
    ctx = Context.build(settings, sender)
    presence = None
    try:
        ctx.artifacts.ensure_layout()
        engine = engine_factory(settings, StoreFeatures(ctx.store), ReferencePreparer(ctx))
        with ctx.session() as session:  # a restarted worker's device memory is empty
            queries.clear_worker_voices(session=session, worker_id=worker_id)
        presence = Presence(ctx.sessions, worker_id, settings.worker_slots,
                            dummy_weights=settings.model_dir is None)  # before any claim of this process
        book = Bookkeeper()
        installs = InstallRecords(book, ctx.sessions, worker_id)
        metrics = WorkerMetrics(registry if registry is not None else CollectorRegistry(), engine.snapshot)
        loop = EngineLoop(engine, installs.on_voice_event, metrics)
        guide = TokenizeLane(guide_tokenizer(settings), device=settings.device)
        loop.start()
    except BaseException:  # no runtime: its heartbeat must not outlive it (the next build registers anew)
        if presence is not None:
            presence.stop()
        ctx.close()
        raise
    log.info("GPU worker %s ready: device %s, preset %s, %d slots, micro-batch %d", worker_id,
             settings.device, settings.model_preset, settings.worker_slots, settings.micro_batch_size)
    return Runtime(**ctx.clients(), worker_id=worker_id, loop=loop, book=book, installs=installs,
                   metrics=metrics, presence=presence, cpu_backlog=CpuBacklog(settings, ctx.broker),
                   guide=guide)


def runtime(worker_id: str, sender: TaskSender) -> Runtime:
    """The process's runtime, built on first use (the `worker_ready` signal builds it eagerly) around the
    worker's Celery app (`sender`); its metrics are in the default registry, which `wavefarm gpu-worker
    --metrics-port` serves."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = build_runtime(get_settings(), worker_id, registry=REGISTRY, sender=sender)
        return _runtime


def current_runtime() -> Runtime | None:
    """The runtime if this process built one (shutdown must not build it)."""
    return _runtime
