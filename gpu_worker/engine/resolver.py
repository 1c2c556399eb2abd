"""How a waiting job's voice becomes ready: the engine's pump, step 1, for jobs without a stream.

`VoiceResolver.resolve` decides for one waiting job: the voice is installed (pin it), another job's
preparation will serve it (wait), the feature store has it (install it: here, or in the install lane),
the store cannot be used or the prep wait ran out (prepare inline: in the lane, in the prep pool, or
here). `collect` hands over the preparations that settled in the lane or the pool. With `install_batch`
above 1, the stored features that one pump finds are installed together at its end, several voices per
setup solve, by `flush` (in the lane where there is one: a CUDA worker always has it). All three say
what the engine is to do as `Start` or `Fail` outcomes, for the engine to apply at once (`collect` and
`flush` are generators, so each outcome is applied before the next voice is looked at); the engine owns
the jobs and their streams, this module owns the preparations in flight and the installs.

Every way a voice became ready is a prep path (`PREP_PATHS`), counted by the engine and recorded on the
job. Installs are announced as `VoiceInstalled` events. No store is read here: `wanted` names the voices
the engine's input side asks it for before a step (`inbox.read_features`), and the answers reach
`resolve` drained from the inbox.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, Protocol

from app.voices.features import PromptHostFeatures
from gpu_worker.engine.inbox import Found
from gpu_worker.engine.streams import EngineEvent, EngineJob, VoiceInstalled
from gpu_worker.voices.cache import Built, InstalledVoice, VoiceCache

log = logging.getLogger(__name__)

# How a job's voice became ready. prepared_ahead: features were in the store when the job arrived;
# already_installed: the voice was installed on this worker; late: the features arrived while the job
# waited; inline: the wait ran out and the worker prepared the voice itself; failed / unavailable: the
# stored features were unusable / the store could not be read, so the worker prepared inline at once;
# queue_full: the voice's CPU preparation waits behind a deep cpu queue (WAVEFARM_PREP_QUEUE_FULL), so
# no waiting; abandoned: the job went away while waiting for its voice.
PREP_PATHS = ("prepared_ahead", "already_installed", "late", "inline", "failed", "unavailable",
              "queue_full", "abandoned")
INLINE_HINTS = ("queue_full", "failed")  # a job with one of these prepares inline at once: no store read


class InlinePreparer(Protocol):
    def prepare(self, job: EngineJob) -> PromptHostFeatures:
        """Compute the job's voice's host features now (read the reference, run the host half)."""


class Waiting(Protocol):
    """What the resolver reads of a job waiting for its voice (the engine's own record of it)."""

    job: EngineJob
    deadline: float  # end of the prep wait
    polled: bool  # the feature store's answer for it arrived at least once


@dataclass(frozen=True)
class Start:
    """The job's voice is installed: pin it and open the job's stream. `installed`: installed for this
    job just now (its timings get `install_s`)."""

    live: Any
    path: str
    installed: bool = False


@dataclass(frozen=True)
class Fail:
    """The job's voice cannot be prepared: the job fails (and only it)."""

    live: Any
    error: BaseException
    path: str


Outcome = Start | Fail


@dataclass
class _Batched:
    """Stored features found this pump, installed with the others at its end (`install_batch` > 1)."""

    live: Any  # the job that found them
    host: PromptHostFeatures
    path: str


@dataclass
class _Preparing:
    future: Future[Any]  # PromptHostFeatures (prep pool), or {voice id: Built | Exception} (install lane)
    path: str  # the prep path of the job that asked for it
    owner: str  # that job's id
    stored: bool = False  # the lane installs stored features: on failure the voice is prepared inline


class VoiceResolver:
    def __init__(self, voices: VoiceCache, *, preparer: InlinePreparer, clock: Callable[[], float],
                 prep_pool: Executor | None = None, install_lane: Executor | None = None,
                 install_batch: int = 1) -> None:
        self.voices = voices
        self.preparer = preparer
        self.clock = clock
        self.prep_pool = prep_pool  # None: inline preparation runs in the engine thread, in order
        self.install_lane = install_lane  # None: installs run in the engine thread (CUDA: side stream)
        self.preparing: dict[str, _Preparing] = {}  # voice id -> preparation in the lane or the pool
        self.install_batch = install_batch  # > 1: stored features found in one pump share setup solves
        self.batched: dict[str, _Batched] = {}  # voice id -> stored features to install at the pump's end
        self.installs = 0

    def wanted(self, jobs: Iterable[EngineJob]) -> list[str]:
        """The voices to ask the store for before the next step: those of `jobs` (queued or waiting) that
        are not installed, not being prepared and not sent straight to inline preparation by a hint."""
        return list(dict.fromkeys(
            job.voice_id for job in jobs
            if job.prep_hint not in INLINE_HINTS and job.voice_id not in self.voices
            and job.voice_id not in self.preparing and job.voice_id not in self.batched))

    def resolve(self, live: Waiting, found: dict[str, Found], events: list[EngineEvent]) -> Outcome | None:
        """What to do now for a job waiting for its voice; None: keep waiting. `found`: the store's answers
        that arrived for this step, by voice id. A job waits for its first answer before its prep wait
        can run out, so features stored before it came are always found (`prepared_ahead`)."""
        voice_id = live.job.voice_id
        if voice_id in self.voices:
            return Start(live, "already_installed")
        if voice_id in self.preparing or voice_id in self.batched:  # another job's will serve this one
            return None
        if live.job.prep_hint in INLINE_HINTS:
            return self._prepare_inline(live, live.job.prep_hint, events)
        if voice_id in found:
            got, first_try, live.polled = found[voice_id], not live.polled, True
            if isinstance(got, PromptHostFeatures):
                path = "prepared_ahead" if first_try else "late"
                return self._install_stored(live, got, path, found, events)
            if isinstance(got, Exception):
                return self._prepare_inline(live, "unavailable" if isinstance(got, ConnectionError)
                                            else "failed", events)
        if live.polled and self.clock() >= live.deadline:
            return self._prepare_inline(live, "inline", events)
        return None

    def collect(self, waiting_for: Callable[[str], list[Any]],
                events: list[EngineEvent]) -> Iterator[Outcome]:
        """Install the settled preparations for the jobs still waiting on them (`waiting_for(voice_id)`,
        asked when that voice's turn comes, after the outcomes before it were applied); drop the others'."""
        for voice_id, prep in list(self.preparing.items()):
            if not prep.future.done():
                continue
            del self.preparing[voice_id]
            waiting = waiting_for(voice_id)
            if not waiting:
                continue  # every job that wanted it went away: nothing is installed
            fresh = voice_id not in self.voices
            owner = next((lv for lv in waiting if lv.job.job_id == prep.owner), waiting[0])
            try:
                self._keep_prepared(prep.future.result(), voice_id, events)
            except Exception as exc:  # the voice cannot be prepared: its jobs fail
                if prep.stored:  # unusable stored features: prepare inline, as without a lane
                    log.warning("job %s: installing stored features of voice %s failed (%s); preparing "
                                "inline", owner.job.job_id, voice_id, exc)
                    outcome = self._prepare_inline(owner, "failed", events)
                    if outcome is not None:
                        yield outcome
                    continue
                for live in waiting:
                    yield Fail(live, exc, prep.path)
                continue
            for live in waiting:
                yield Start(live, prep.path if live is owner else "already_installed",
                            installed=fresh and live is owner)

    def flush(self, waiting_for: Callable[[str], list[Any]], events: list[EngineEvent]) -> Iterator[Outcome]:
        """Install the stored features this pump found (`install_batch` > 1), up to `install_batch`
        voices per batched setup solve, and start every job waiting on each. A batch that fails is
        installed voice by voice, so bad features fail over to inline preparation for their voice only."""
        found, self.batched = list(self.batched.values()), {}
        for i in range(0, len(found), self.install_batch):
            group = found[i : i + self.install_batch]
            if self.install_lane is not None:  # built in the lane, kept as `collect` finds it settled
                future = self.install_lane.submit(self.voices.build_each, [b.host for b in group])
                for b in group:
                    self.preparing[b.live.job.voice_id] = _Preparing(future, b.path, b.live.job.job_id, True)
                continue
            installed = self._install_group([b.host for b in group], events)
            for batched in group:
                voice_id = batched.live.job.voice_id
                got = installed[voice_id]
                if isinstance(got, Exception):
                    log.warning("job %s: installing stored features of voice %s failed (%s); preparing "
                                "inline", batched.live.job.job_id, voice_id, got)
                    outcome = self._prepare_inline(batched.live, "failed", events)
                    if outcome is not None:
                        yield outcome
                elif batched.live in waiting_for(voice_id):
                    yield Start(batched.live, batched.path, installed=True)
                if voice_id in self.voices:  # the others of this pump that wanted it
                    for live in waiting_for(voice_id):
                        yield Start(live, "already_installed")

    def _install_group(self, hosts: list[PromptHostFeatures],
                       events: list[EngineEvent]) -> dict[str, InstalledVoice | Exception]:
        """voice id -> its install, or why it failed (`VoiceCache.build_each`), in this thread."""
        return {voice_id: got if isinstance(got, Exception) else self._adopt(got, events)
                for voice_id, got in self.voices.build_each(hosts).items()}

    def _install_stored(self, live: Waiting, host: PromptHostFeatures, path: str, found: dict[str, Found],
                        events: list[EngineEvent]) -> Outcome | None:
        voice_id = live.job.voice_id
        if self.install_batch > 1:  # installed with the others this pump finds, in `flush`
            self.batched[voice_id] = _Batched(live, host, path)
            return None
        if self.install_lane is not None:
            future = self.install_lane.submit(self.voices.build_each, [host])
            self.preparing[voice_id] = _Preparing(future, path, live.job.job_id, stored=True)
            return None
        try:
            self._install(host, events)
        except Exception as exc:  # bad stored features fall back to inline preparation
            log.warning("job %s: installing stored features of voice %s failed (%s); preparing inline",
                        live.job.job_id, voice_id, exc)
            found[voice_id] = exc  # the step's other jobs of this voice: the same verdict
            return self._prepare_inline(live, "failed", events)
        return Start(live, path, installed=True)

    def _prepare_inline(self, live: Waiting, path: str, events: list[EngineEvent]) -> Outcome | None:
        """Prepare the job's voice here: in the lane or the pool (other rows keep decoding), else now."""
        job = live.job
        future: Future[Any] | None = None
        if self.install_lane is not None:
            future = self.install_lane.submit(lambda: self.voices.build_each([self.preparer.prepare(job)]))
        elif self.prep_pool is not None:
            future = self.prep_pool.submit(self.preparer.prepare, job)
        if future is not None:
            self.preparing[job.voice_id] = _Preparing(future, path, job.job_id)
            return None
        fresh = job.voice_id not in self.voices
        try:
            self._install_host(self.preparer.prepare(job), job.voice_id, events)
        except Exception as exc:  # one job's preparation failing fails that job only
            return Fail(live, exc, path)
        return Start(live, path, installed=fresh)

    def _keep_prepared(self, got: PromptHostFeatures | dict[str, Built | Exception], voice_id: str,
                       events: list[EngineEvent]) -> InstalledVoice:
        if isinstance(got, PromptHostFeatures):  # the prep pool's host half: installed here
            return self._install_host(got, voice_id, events)
        built = got.get(voice_id)  # the lane's build of one voice or of a group
        if built is None:
            raise ValueError(f"the install lane produced voices {sorted(got)}, not {voice_id}")
        if isinstance(built, Exception):
            raise built
        return self.voices.get(voice_id) or self._adopt(built, events)

    def _install_host(self, host: PromptHostFeatures, voice_id: str,
                      events: list[EngineEvent]) -> InstalledVoice:
        if host.voice_id != voice_id:
            raise ValueError(f"inline preparation produced voice {host.voice_id}, not {voice_id}")
        return self.voices.get(voice_id) or self._install(host, events)

    def _install(self, host: PromptHostFeatures, events: list[EngineEvent]) -> InstalledVoice:
        entry = self.voices.install(host)
        self._installed(entry, events)
        return entry

    def _adopt(self, built: Built, events: list[EngineEvent]) -> InstalledVoice:
        entry = self.voices.adopt(built)
        self._installed(entry, events)
        return entry

    def _installed(self, entry: InstalledVoice, events: list[EngineEvent]) -> None:
        self.installs += 1
        log.info("voice %s installed in %.3f s (%d bytes)", entry.voice_id, entry.install_s, entry.nbytes)
        events.append(VoiceInstalled(voice_id=entry.voice_id, nbytes=entry.nbytes, install_s=entry.install_s))
