"""Deployment settings: one pydantic-settings object read from WAVEFARM_* variables.

Build it once at a process entry point (`get_settings()`) and pass it down
explicitly; library code never reads the environment itself. Model
hyper-parameters live in the model's dataclass, not here.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DAY_S = 24 * 3600
FLOW_STEPS = (6, 8, 10)  # Euler steps a worker may run: the reference's 10, and two faster counts


def parse_voice_map(text: str) -> dict[str, str]:
    """'alloy=Ada, echo=bob' -> {'alloy': 'Ada', 'echo': 'bob'} (names case folded); ValueError saying the
    form on anything else."""
    mapping: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, sep, voice = (piece.strip() for piece in entry.partition("="))
        if not sep or not name or not voice:
            raise ValueError(f"openai_voices entry {entry!r} is not name=voice (as 'alloy=Ada,echo=bob')")
        mapping[name.casefold()] = voice
    return mapping


class Settings(BaseSettings):
    """Everything a wavefarm process may be configured with (`WAVEFARM_<NAME>`)."""

    # `model_dir` and `model_preset` would collide with pydantic's `model_` namespace.
    model_config = SettingsConfigDict(
        env_prefix="WAVEFARM_", extra="ignore", protected_namespaces=("settings_",), frozen=True
    )

    # State and transport.
    database_url: str = Field(
        default="", description="SQLAlchemy URL; empty: <artifact_root>/../wavefarm.sqlite"
    )
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/1"
    feature_store_url: str = "redis://127.0.0.1:6379/2"
    artifact_root: Path = Path("./var/artifacts")
    queue_cpu: str = Field(default="cpu", min_length=1, description="Celery queue of the CPU tasks")
    queue_gpu: str = Field(default="gpu", min_length=1, description="Celery queue of the synth task")

    # Model and device.
    model_dir: Path | None = Field(default=None, description="checkpoint folder; None means dummy weights")
    model_preset: Literal["full", "tiny"] = "full"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    hift_dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="the vocoder's dtype; a reduced one keeps its F0 predictor, source and "
        "last conv in float32 (deviation: docs/PERFORMANCE.md)"
    )
    cuda_graphs: bool = Field(
        default=True, description="on a CUDA device, each decode step's flow (the encoder's chunk and the "
        "solve) and the vocoder run as CUDA graphs, their steady shapes captured as the worker starts "
        "(gpu_worker.accel); no effect on a CPU")
    flow_steps: int = Field(
        default=10, description="Euler steps of the flow's solve: 10 is the reference's; 6 and 8 are faster "
        "and deviate from it (docs/PERFORMANCE.md); a voice installed for one count is not used with another")
    torch_threads: int = Field(
        default=0, ge=0, description="CPU threads of the GPU worker's engine; 0 keeps torch's default"
    )
    cpu_worker_threads: int = Field(
        default=1, ge=0, description="torch threads in each CPU worker process (one process per core); "
        "0 keeps torch's default"
    )
    install_lane: bool = Field(
        default=False, description="a CPU worker's voice installs (the device half) on a side thread "
        "beside the decode loop; give the engine half the cores (WAVEFARM_TORCH_THREADS). A CUDA worker "
        "always installs on such a thread (CAM++ runs on the CPU), its device work on a side stream"
    )
    cpu_linear: Literal["onednn", "blas"] = Field(
        default="onednn", description="float32 linears on a CPU: oneDNN (faster where measured) or the BLAS"
    )

    # Engine.
    micro_batch_size: int = Field(default=8, ge=1, le=256)
    worker_slots: int = Field(default=8, ge=1, le=1024)
    prep_wait_ms: int = Field(default=2000, ge=0)
    admission_window_ms: int = Field(
        default=500, ge=0, description="an idle engine waits up to this long (half of it after the "
        "latest arrival) for more jobs, so a burst starts in one step; 0: start at once"
    )
    install_batch: int = Field(
        default=1, ge=1, le=64, description="new voices whose stored features one engine pump finds share "
        "a setup solve, up to this many; 1: one solve per voice (bit-reproducible installs; no faster on "
        "the CPUs measured, docs/PERFORMANCE.md)")
    voice_cache_capacity: int = Field(default=8, ge=1, description="installed voices per worker")
    prep_queue_full: int = Field(
        default=64, ge=0, description="a job whose voice is not prepared yet, claimed while more than this "
        "many tasks wait on the cpu queue, is prepared inline at once (prep path queue_full) rather than "
        "after prep_wait_ms; 0: never")

    # Routing across GPU workers (`app.submission.routing`).
    voice_affinity: Literal["auto", "on", "off"] = Field(
        default="auto", description="send a job to the GPU worker that holds its voice (its own queue); "
        "auto: when more than one GPU worker is alive")
    affinity_max_backlog: int = Field(
        default=32, ge=1, description="a GPU worker with this many live jobs claimed or queued on its own "
        "queue takes no more by affinity: they go to the shared gpu queue")
    feature_ttl_s: int = Field(default=7 * DAY_S, ge=1)

    # Limits on what clients may send.
    max_reference_bytes: int = Field(default=20 * 1024 * 1024, ge=1)
    max_reference_seconds: float = Field(default=60.0, gt=0)
    max_tokens: int = Field(
        default=25 * 3600, ge=1, description="speech tokens per job (25 per second of audio)"
    )
    max_text_job_s: float = Field(
        default=600.0, gt=0, description="a text job's estimated speech (15 characters a second) may be this "
        "long; a longer text is refused with the way to render it as a book, in chapters")
    max_batch_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1, description="request body of POST /v1/jobs/batch (up to 1000 jobs)"
    )
    submit_threads: int | None = Field(
        default=None, ge=1, le=40, description="job submissions (single, batch, speech) an API process "
        "writes at once; the others wait on its event loop, not in threads fighting for the GIL "
        "(docs/SCALING.md). Unset: 8 on PostgreSQL, 2 on SQLite (one writer at a time)")

    # Books.
    lexicon: Path | None = Field(
        default=None, description="a pronunciation lexicon file (JSON or YAML, docs/BOOKS.md) every book's "
        "text goes through; a book's own lexicon is laid over it")
    lexicon_budget_s: float = Field(
        default=10.0, gt=0, description="wall seconds a book's lexicon patterns may take in all, over every "
        "segment; past it the book is refused")
    book_parse_timeout_s: float = Field(
        default=300.0, gt=0, description="wall seconds a CPU worker's child process may spend reading and "
        "planning one book (docs/RELIABILITY.md, \"Hostile input\")")
    book_parse_cpu_s: int = Field(
        default=120, ge=1, description="CPU seconds of that child (RLIMIT_CPU); a 1,000-page PDF took 20 s "
        "(docs/RELIABILITY.md)")
    book_parse_quick_cpu_s: int = Field(
        default=15, ge=1, description="a book's first reading is in the quick lane: this many CPU seconds "
        "(and four times as many wall seconds); a book that needs more is read again in the long lane, "
        "with the limits above (docs/BOOKS.md, \"Reading lanes\")")
    book_parse_long_slots: int = Field(
        default=1, ge=1, description="long-lane readings at once over all CPU workers: the rest of their "
        "processes keep reading quick books, so worst-case uploads never hold up everyone's")
    book_parse_memory_mb: int = Field(
        default=2048, ge=256, description="address space of that child, MB (RLIMIT_AS)")
    book_parse_output_mb: int = Field(
        default=256, ge=16, description="largest file that child may write, MB (RLIMIT_FSIZE): the plan, "
        "the cover")
    book_max_timed_span_s: float = Field(
        default=48 * 3600.0, gt=0, description="a timed subtitle book's cues must start within this many "
        "seconds (its chapter file is that long)")

    # Jobs.
    visibility_timeout_s: int = Field(default=6 * 3600, ge=1, description="must exceed the longest job")
    progress_interval_s: float = Field(default=1.0, gt=0)
    job_max_attempts: int = Field(default=3, ge=1)
    job_lease_s: float = Field(
        default=30.0, gt=0, description="a claimed job is its GPU worker's for this long after each progress "
        "report; once it passed (the worker died), the reconciler queues the job again")
    step_deadline_s: float = Field(
        default=600.0, gt=0, description="an engine step running longer than this is hung: the GPU worker "
        "exits non-zero so its supervisor restarts it and its jobs are redelivered")

    speech_first_audio_timeout_s: float = Field(
        default=300.0, gt=0, description="a speech request (POST /v1/audio/speech) whose job has written no "
        "audio after this long is answered 503 (no GPU worker took the job) or 504 (one did), and its job is "
        "cancelled")

    openai_voices: str = Field(
        default="", description="OpenAI voice names mapped to stored voices for POST /v1/audio/speech, as "
        "'alloy=Ada,echo=bob' (each an id, name or id prefix); a stored voice named alloy needs no entry")

    # Maintenance (`maintenance.sweep`, `wavefarm maintenance`).
    orphan_grace_s: float = Field(
        default=3600.0, ge=0, description="files nothing refers to are removed once this old")
    stuck_job_after_s: float = Field(
        default=120.0, gt=0, description="a queued job's message (its doorbell) is sent again once it has "
        "waited this long, and again after twice as long, and so on (a lost message costs this much)")
    maintenance_interval_s: float = Field(
        default=120.0, ge=0, description="CPU workers send `maintenance.sweep` this often (one of them per "
        "period, by a Redis claim); 0: never (run `wavefarm maintenance` from cron instead)")

    api_token: SecretStr | None = None
    api_url: str = Field(default="http://127.0.0.1:8000", pattern=r"^https?://\S+$",
                         description="where the client commands (submit, status, voices, book ...) find the "
                         "API; --api overrides it")

    # The quality gate (app.quality; how each default was chosen: docs/QUALITY.md).
    quality_min_mos: float = Field(default=1.6, ge=1, le=5, description="DNSMOS overall score a clip needs")
    quality_min_similarity: float = Field(
        default=0.6, ge=-1, le=1, description="GE2E cosine similarity of a clip to its reference voice")
    quality_max_wer: float = Field(default=0.6, ge=0, description="word error rate a clip may have")
    quality_min_words: int = Field(default=5, ge=1, description="shorter texts skip the word check")
    quality_min_length_ratio: float = Field(default=0.4, gt=0, description="duration / the text's estimate")
    quality_max_length_ratio: float = Field(default=2.5, gt=0)
    quality_min_dbfs: float = Field(default=-50.0, le=0, description="a quieter clip is silence")
    quality_rerenders: int = Field(default=2, ge=0, le=10, description="a book's segment that fails the gate "
                                   "is rendered again with another seed this many times, then kept marked")
    test_quiet_renders: str | None = Field(
        default=None, pattern=r"^\d+(@\d+)?(,\d+(@\d+)?)*$",
        description="a test hook for the quality gate's tests, inert unset: token counts, N (every seed) or "
        "N@SEED (that seed only), comma-separated; the GPU worker writes a job of N tokens 60 dB quieter "
        "(the gate hears silence)")

    @model_validator(mode="after")
    def _default_database_url(self) -> Settings:
        if not self.database_url:
            path = (self.artifact_root.parent / "wavefarm.sqlite").resolve()
            # frozen model: set through object.__setattr__ once, during validation
            object.__setattr__(self, "database_url", f"sqlite:///{path}")
        return self

    @field_validator("openai_voices")
    @classmethod
    def _voice_map_form(cls, text: str) -> str:
        parse_voice_map(text)
        return text

    def openai_voice_map(self) -> dict[str, str]:
        """`openai_voices` as {OpenAI name, case folded: the stored voice it means}."""
        return parse_voice_map(self.openai_voices)

    @field_validator("flow_steps")
    @classmethod
    def _supported_flow_steps(cls, steps: int) -> int:
        if steps not in FLOW_STEPS:
            raise ValueError(f"flow steps must be one of {FLOW_STEPS}, not {steps}")
        return steps

    @model_validator(mode="after")
    def _visibility_outlasts_prep_wait(self) -> Settings:
        if self.visibility_timeout_s * 1000 <= self.prep_wait_ms:
            raise ValueError("visibility_timeout_s must be longer than prep_wait_ms (and the longest job)")
        return self

    @model_validator(mode="after")
    def _lease_outlasts_reports(self) -> Settings:
        if self.job_lease_s < 3 * self.progress_interval_s:
            raise ValueError("job_lease_s must be at least three progress_interval_s: a running job renews "
                             "its lease with each progress report")
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, read from the environment once. Entry points only."""
    return Settings()
