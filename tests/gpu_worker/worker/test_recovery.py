"""Worker death as a GPU worker process meets it (`gpu_worker.worker.recovery`): a process started again
under a node name releases and rings at once the jobs its previous process claimed, and only those. Real
Redis and SQLite, in process; what the worker rings is recorded."""

from __future__ import annotations

from app import lifecycle
from app.db.models import JobStatus
from gpu_worker.worker.recovery import resume_previous
from tests.support.runtime import VOICE_A, job_row, submit


def claim(sessions, job_id: str, worker: str) -> None:
    with sessions() as session:
        assert lifecycle.claim(session=session, job_id=job_id, worker=worker, max_attempts=3, lease_s=600)
        session.commit()


def test_a_worker_started_again_releases_and_rings_its_previous_process_claims_and_no_others(
        make_runtime, sessions) -> None:
    producer = make_runtime()  # gpu-0@test: submits the jobs
    held, elsewhere, own = (submit(producer, sessions, VOICE_A, n_tokens=n) for n in (30, 31, 32))
    claim(sessions, held, "gpu-1@test")  # by the previous process under the next runtime's name
    claim(sessions, elsewhere, "gpu-9@test")  # another name's: not its own
    rt = make_runtime()
    assert rt.worker_id == "gpu-1@test"
    claim(sessions, own, rt.worker_id)  # this process's own claim, after it registered

    assert resume_previous(rt) == [held]
    assert rt.sender.sent == [("synth", [held])]
    assert job_row(sessions, held).status == JobStatus.QUEUED and job_row(sessions, held).attempts == 1
    assert job_row(sessions, elsewhere).status == job_row(sessions, own).status == JobStatus.PREPARING
    assert resume_previous(rt) == []  # once
