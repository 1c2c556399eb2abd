"""What the CLI tests share: the command run in process, the GPU worker's part played for a job."""

from __future__ import annotations

import threading
import time

from app import cli, lifecycle
from app.db.models import JobStatus
from app.db.session import make_engine, make_sessionmaker, session_scope
from app.dev import SAMPLES
from app.settings import Settings
from app.storage.artifacts import ArtifactStore

TOKEN = "cli-test-token"


def run(*argv: str) -> int:
    return cli.main(list(argv))


def finish_later(settings: Settings, job_id: str, delay: float = 1.0) -> threading.Thread:
    """Play the GPU worker: some progress, then the output file and `succeeded`."""
    def work() -> None:
        time.sleep(delay)
        artifacts = ArtifactStore(settings.artifact_root)
        engine = make_engine(settings.database_url)
        with session_scope(make_sessionmaker(engine)) as s:
            lifecycle.renew(session=s, job_id=job_id, frames_done=10)
        time.sleep(0.6)
        relpath = artifacts.output_relpath(job_id, "wav")
        artifacts.write_bytes(relpath, (SAMPLES / "voice_b.wav").read_bytes())
        with session_scope(make_sessionmaker(engine)) as s:
            lifecycle.finish(session=s, job_id=job_id, status=JobStatus.SUCCEEDED, output_path=relpath)
        engine.dispose()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread
