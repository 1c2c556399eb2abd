"""The reconciler's job rules besides dead workers' (`app.reconcile.dead_workers`): rules 1, 4 and 5 of
`app.reconcile.sweep`.

- orphan files (`remove_orphans`): files under the artifact root that no database row refers to
  (partial outputs of a killed worker, temp files, references whose rows never committed), older than
  `orphan_grace_s`, are removed (the age guard keeps a file whose row is still being committed, or one
  being written);
- bells due (`ring_due`): a queued job not claimed within `stuck_job_after_s` of its last ring (then
  twice as long, and so on) is rung again, `RING_GROUP` at a time: its message may have been lost (a
  broker that lost its data, a kill between the commit and the send, a consumer killed before its claim);
  a text job without tokens gets its `synth` while its guide speech is stored (the GPU worker tokenizes
  it), else its `job.tokenize` (which speaks it again);
- abandoned voices (`reclaim_voices`): features still stored for a voice whose every job was cancelled
  are reclaimed.
"""

from __future__ import annotations

import logging
from datetime import timedelta

from sqlalchemy.orm import Session

from app import lifecycle
from app.context import Context
from app.db import queries
from app.db.models import utcnow
from app.db.session import session_scope
from app.reconcile.report import SweepReport
from app.storage.artifacts import ArtifactStore
from app.voices.service import reclaim_abandoned_voice

log = logging.getLogger(__name__)

# Due jobs rung together: each group is routed once per voice and committed before the next is routed,
# so a long backlog of one voice still spreads over the live workers as job-by-job rings spread it, and
# a sweep that finds hundreds of jobs waiting behind a long queue (a book's chapter) rings them at a
# group's cost in commits and broker rounds, not a job's (issue 44: the CPU worker's share of a book).
RING_GROUP = 8


def remove_orphans(*, session: Session, artifacts: ArtifactStore, grace_s: float,
                   report: SweepReport) -> None:
    referenced = queries.referenced_paths(session=session)
    for path in artifacts.list_orphans(referenced=referenced, older_than_s=grace_s):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.errors.append(f"could not remove {path.name}: {exc}")
            continue
        report.orphans_removed.append(str(path.relative_to(artifacts.root)))


def ring_due(*, ctx: Context, report: SweepReport) -> None:
    """Queued jobs not claimed within their ring's wait, rung again (module docstring), RING_GROUP at a
    time (`lifecycle.ring_many`)."""
    now = utcnow()
    with session_scope(ctx.sessions) as session:
        due = [job.id for job in queries.list_due_rings(
            session=session, now=now, quiet_before=now - timedelta(seconds=ctx.settings.stuck_job_after_s))]
    for start in range(0, len(due), RING_GROUP):
        group = due[start:start + RING_GROUP]
        # a text job whose guide speech is still stored goes to the GPU worker, which tokenizes it:
        # `job.tokenize` would only send the same `synth` after a CPU task's round trips
        stored = [job_id for job_id in group if ctx.store.has_guide_speech(job_id)]
        with session_scope(ctx.sessions) as session:
            sent = lifecycle.ring_many(session=session, sender=ctx.sender, settings=ctx.settings,
                                       job_ids=group, speech_stored=stored)
        for job_id, what in sent.items():
            log.warning("maintenance: job %s was not claimed in time; its %s sent again", job_id, what)
            report.jobs_requeued.append(job_id)


def reclaim_voices(*, ctx: Context, report: SweepReport) -> None:
    with session_scope(ctx.sessions) as session:
        for voice_id in queries.list_abandoned_ready_voices(session=session):
            if reclaim_abandoned_voice(session=session, store=ctx.store, voice_id=voice_id):
                report.voices_reclaimed.append(voice_id)
