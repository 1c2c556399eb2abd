"""The GPU worker's watchdog: a hung engine step must not hang the service.

A thread checks that the engine keeps finishing steps while it has live jobs. When no step has finished
for `deadline_s` (a step stuck in a driver call, a deadlock), or the engine thread has died, it logs and
exits the process with status 70: the supervisor (systemd, Docker, Kubernetes) restarts the worker and
the broker redelivers its unacknowledged jobs, each a new counted attempt. It never touches the engine.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpu_worker.worker.runtime import EngineLoop

log = logging.getLogger(__name__)

EXIT_HUNG = 70  # exit status of a worker whose engine step outlived its deadline (EX_SOFTWARE)


class Watchdog:
    """Exits the process when the engine stops stepping while it has work (a hung step, or a dead engine
    thread): its supervisor restarts it and the broker redelivers its unacknowledged jobs."""

    def __init__(self, loop: EngineLoop, deadline_s: float, on_hang: Callable[[int], Any] | None = None,
                 interval_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.loop, self.deadline_s, self.clock = loop, deadline_s, clock
        self.on_hang = on_hang or os._exit
        self.interval_s = interval_s if interval_s is not None else min(5.0, deadline_s / 4)
        self._steps, self._since = -1, clock()
        self._stop = threading.Event()

    def hung(self) -> bool:
        """One check: work waiting and no step finished for `deadline_s`."""
        engine = self.loop.engine
        steps, now = engine.stats["steps"], self.clock()
        if steps != self._steps or not engine.live_jobs():
            self._steps, self._since = steps, now
            return False
        return now - self._since > self.deadline_s or not self.loop.alive()

    def start(self) -> None:
        threading.Thread(target=self._run, name="wavefarm-watchdog", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.hung():
                log.critical("engine made no step for %.0f s with %d live jobs: exiting (%d) so the "
                             "supervisor restarts this worker", self.deadline_s,
                             len(self.loop.engine.live_jobs()), EXIT_HUNG)
                logging.shutdown()
                self.on_hang(EXIT_HUNG)
                return
