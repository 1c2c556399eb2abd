"""Voice-affinity routing: a job's `synth` goes to the GPU worker that already holds its voice.

Every GPU worker consumes the shared gpu queue and a queue of its own (`worker_queue`: the shared
queue's name, a dot, its node name). Installing a voice costs a setup solve (seconds on a GPU, more on a
CPU) and device memory, so a job whose voice a live worker holds is sent to that worker's queue, and the
first job of a voice nobody holds is *placed* on the least busy live worker, so the jobs of the same
voice that follow (a book's segments, a burst) find it there. What the router knows comes from the
database, which every process shares: the workers' heartbeats (`workers`), their installs
(`worker_voices`) and their live jobs (claimed, or queued on their own queue: `jobs.routed_to`).

`route_voice` decides in three statements (live workers with their slots and latest install; their
backlogs; the voice's holders), whatever the number of installs and finished jobs; every decision is
one of `ROUTES`, recorded on the job (`jobs.route`, exported by the API as `wavefarm_jobs_routed{route}`):
  affinity          a live worker holds the voice (installed, or jobs of it claimed or queued there)
  placed            nobody holds it: the least busy live worker, by live jobs, then the one whose latest
                    install is oldest (none first), so that, with every worker idle, new voices go round
                    the workers instead of piling on the first by name. (Not the count of voices each
                    has installed: counting 100,000 installs took 28 ms a decision on PostgreSQL,
                    docs/SCALING.md; `record_install` keeps the latest on the worker's row.)
  spilled           every slot of every holder is taken and a worker that does not hold the voice has a
                    free one: the job starts there now (one more install) rather than queue behind the
                    holder's jobs; that worker then holds the voice too, and the voice's next jobs go to
                    whichever holder is less busy
  shared_off        WAVEFARM_VOICE_AFFINITY=off
  shared_single     `auto` and at most one live GPU worker: nothing to choose
  shared_no_worker  `on` and no live GPU worker (their queues would wait for nobody)
  shared_saturated  the chosen worker has `affinity_max_backlog` live jobs or more
  shared_worker_gone  rung again by the reconciler because the worker it was sent to is gone, and routing
                    now chose the shared queue (a worker chosen instead records its own reason)
A worker is live when it beat within `LIVE_BEAT_S` (it beats every 10 s). A worker that dies with jobs
on its own queue does not strand them: the reconciler (`app.reconcile.sweep`, rule 3, `reroute_gone`) rings
again, where routing says now, every queued job whose doorbell went to a gone worker's queue, and rule 2
queues and rings the jobs it had claimed once their leases pass; the messages left in its queue are
duplicates (the database is the truth, `app.lifecycle`), never moved. The shared queue stays the path
that always works: every worker takes from it, so an idle worker still takes the jobs nobody was chosen
for.

Who routes: a submission (`app.submission.jobs`; `app.submission.batch`, one decision per voice of a batch) as
it inserts the job; `tasks.text` once a text job has its tokens; `lifecycle.ring` for every other doorbell (a
book's segments planned with their tokens, job by job), and `lifecycle.ring_many` for groups (a
`book.tokenize` group and the reconciler's due jobs, 8 at a time: one decision per voice a group). Each
job's route is on its row before its message is sent (both commit first), so the next decision counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from app.broker.wire import TaskSender, send_synth
from app.db import queries
from app.db.models import utcnow
from app.settings import Settings

LIVE_BEAT_S = 30.0  # three missed heartbeats (gpu_worker.worker.runtime.HEARTBEAT_S): no more jobs by
# affinity
ROUTES = ("affinity", "placed", "spilled", "shared_off", "shared_single", "shared_no_worker",
          "shared_saturated", "shared_worker_gone")
QUEUE_SEP = "."
NEVER = datetime(1970, 1, 1, tzinfo=UTC)  # the latest install of a worker that holds none


@dataclass(frozen=True)
class Route:
    queue: str
    worker: str | None  # whose own queue; None: the shared gpu queue
    reason: str  # one of ROUTES


def worker_queue(settings: Settings, worker: str) -> str:
    """A GPU worker's own queue: the shared queue's name, a dot, its node name ("gpu.gpu1@host")."""
    return f"{settings.queue_gpu}{QUEUE_SEP}{worker}"


def shared(settings: Settings, reason: str) -> Route:
    return Route(settings.queue_gpu, None, reason)


class LiveWorkers:
    """The live GPU workers as one process last read them, read again at most once a second
    (`READ_EVERY_S`): the API routes every submission, and the workers' rows change at their heartbeats.
    Liveness is judged again at each use from the heartbeats read, so a worker that dies stops being
    chosen when its last beat passes `LIVE_BEAT_S`, as without the cache; one that stops (its heartbeat
    cleared) or starts is seen within a second. Shared by the threads of a process: the rows and the time
    they were read are replaced together."""

    READ_EVERY_S = 1.0

    def __init__(self) -> None:
        self._read: tuple[datetime, list[tuple[queries.LiveWorker, datetime]]] | None = None

    def rows(self, session: Session, now: datetime) -> list[queries.LiveWorker]:
        read = self._read
        beat_after = now - timedelta(seconds=LIVE_BEAT_S)
        if read is None or not 0 <= (now - read[0]).total_seconds() < self.READ_EVERY_S:
            read = self._read = (now, queries.live_worker_beats(session=session, beat_after=beat_after))
        return [row for row, beat in read[1] if beat >= beat_after]


def route_voice(*, session: Session, settings: Settings, voice_id: str,
                live_workers: LiveWorkers | None = None) -> Route:
    """Where a job of `voice_id` goes now (module docstring); `live_workers`: the process's cache of the
    live workers' rows (None: read them now)."""
    if settings.voice_affinity == "off":
        return shared(settings, "shared_off")
    now = utcnow()
    rows = (live_workers.rows(session, now) if live_workers is not None
            else queries.live_worker_rows(session=session, beat_after=now - timedelta(seconds=LIVE_BEAT_S)))
    live = [row.name for row in rows]
    if settings.voice_affinity == "auto" and len(live) < 2:
        return shared(settings, "shared_single")
    if not live:
        return shared(settings, "shared_no_worker")
    backlog = queries.worker_backlogs(session=session, workers=live)
    holders = queries.voice_holders(session=session, voice_id=voice_id, workers=live)
    last_install = {row.name: row.last_install or NEVER for row in rows}
    slots = {row.name: row.slots or settings.worker_slots for row in rows}

    def least_busy(names: list[str] | set[str]) -> str:
        return min(names, key=lambda name: (backlog[name], last_install[name], name))

    if not holders:
        best, reason = least_busy(live), "placed"
    else:
        best, reason = least_busy(holders), "affinity"
        free = [name for name in live if name not in holders and backlog[name] < slots[name]]
        if backlog[best] >= slots[best] and free:
            best, reason = least_busy(free), "spilled"
    if backlog[best] >= settings.affinity_max_backlog:
        return shared(settings, "shared_saturated")
    return Route(worker_queue(settings, best), best, reason)


def send_routed(*, session: Session, sender: TaskSender, settings: Settings, job_id: str, voice_id: str,
                priority: int, route: Route | None = None) -> Route:
    """Route a job (or use `route`), record it on the job, commit, send its `synth` there."""
    route = route or route_voice(session=session, settings=settings, voice_id=voice_id)
    queries.set_job_route(session=session, job_ids=[job_id], routed_to=route.worker, route=route.reason)
    session.commit()  # the route is known before the message can be delivered (and counted as backlog)
    send_synth(sender, settings, job_id, priority, queue=route.queue)
    return route
