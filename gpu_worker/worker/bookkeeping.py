"""This worker's records in the database, written off the engine thread.

`Bookkeeper` runs small database writes on its own thread, in order, so the engine thread never waits on
the database; `InstallRecords` turns the engine's voice events and the jobs' pins into `worker_voices`
rows through it (which voices this worker holds, how many live jobs use each, when they were last used).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from app.db import queries
from app.db.session import session_scope
from gpu_worker.engine.streams import EngineEvent, VoiceEvicted, VoiceInstalled

log = logging.getLogger(__name__)


class Bookkeeper:
    """Runs small database writes on its own thread, in order, so the engine thread never waits on them."""

    def __init__(self) -> None:
        self._work: queue.Queue[Callable[[], None]] = queue.Queue()
        threading.Thread(target=self._run, name="wavefarm-bookkeeper", daemon=True).start()

    def put(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def drain(self, timeout: float = 5.0) -> None:
        done = threading.Event()
        self.put(done.set)
        done.wait(timeout)

    def _run(self) -> None:
        while True:
            work = self._work.get()
            try:
                work()
            except Exception:  # bookkeeping must not stop; the next write may succeed
                log.exception("worker bookkeeping write failed")


class InstallRecords:
    """This worker's installed voices in the database (`worker_voices`), written by the bookkeeper."""

    def __init__(self, book: Bookkeeper, sessions: sessionmaker[Session], worker_id: str) -> None:
        self.book, self.sessions, self.worker_id = book, sessions, worker_id

    def on_voice_event(self, event: EngineEvent) -> None:
        """Engine thread: installs and evictions become rows (queued, in order)."""
        if isinstance(event, VoiceInstalled):
            voice_id, nbytes = event.voice_id, event.nbytes
            self.book.put(lambda: self._db(queries.record_install, voice_id=voice_id, nbytes=nbytes))
        elif isinstance(event, VoiceEvicted):
            evicted = event.voice_id
            self.book.put(lambda: self._db(queries.remove_worker_voice, voice_id=evicted))

    def pin(self, voice_id: str, delta: int) -> None:
        self.book.put(lambda: self._db(queries.pin_worker_voice, voice_id=voice_id, delta=delta))

    def _db(self, query: Callable[..., Any], **kwargs: Any) -> None:
        with session_scope(self.sessions) as session:
            query(session=session, worker_id=self.worker_id, **kwargs)
