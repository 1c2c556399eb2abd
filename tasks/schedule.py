"""The periodic maintenance sweep, sent by the CPU workers themselves (no celery beat to deploy).

Every `maintenance_interval_s` each CPU worker's timer asks the feature store for the period's claim
(`FeatureStore.claim_sweep`, a key that lives for 0.9 of the period); the one that gets it sends
`maintenance.sweep` to the cpu queue, where any worker runs it. So a cluster of N workers sweeps about
once per period, and a job whose message was lost (a worker SIGKILLed between taking it and claiming
the job, a broker that lost its data) is rung again (`app.lifecycle`) without anyone having to set up a
cron.

The timer runs in the worker's main process (its event loop, or Celery's timer thread); the tick only
sets a key and publishes a message, and never raises into the loop. Not in here: the sweep itself
(`app.reconcile.sweep`, run by the `maintenance.sweep` task).
"""

from __future__ import annotations

import logging
from typing import Any

import kombu.exceptions
import redis
from celery import bootsteps

from app.broker.wire import SWEEP_TASK
from app.settings import Settings, get_settings
from app.storage.feature_store import FeatureStore

log = logging.getLogger(__name__)

CLAIM_FRACTION = 0.9  # a claim expires before its owner's next tick, so that tick can claim again


class PeriodicSweep(bootsteps.StartStopStep):
    """A worker bootstep: `maintenance.sweep` once per `maintenance_interval_s` for the whole cluster."""

    requires = ("celery.worker.components:Timer",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        self.tref: Any = None
        self.store: FeatureStore | None = None

    def start(self, worker: Any) -> None:
        settings = get_settings()
        if settings.maintenance_interval_s <= 0:
            return
        self.store = FeatureStore.from_url(settings.feature_store_url, ttl_s=settings.feature_ttl_s)
        self.tref = worker.timer.call_repeatedly(
            settings.maintenance_interval_s, tick, (worker.app, self.store, settings))

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        if self.store is not None:
            self.store.close()
            self.store = None


def tick(app: Any, store: FeatureStore, settings: Settings) -> bool:
    """Send the period's sweep if this worker is first to claim the period; True if it sent it."""
    try:
        if not store.claim_sweep(settings.queue_cpu, CLAIM_FRACTION * settings.maintenance_interval_s):
            return False
        app.send_task(SWEEP_TASK, queue=settings.queue_cpu)
    except (redis.RedisError, kombu.exceptions.OperationalError, OSError) as exc:
        log.warning("periodic maintenance sweep not sent: %s (next try in %.0f s)", exc,
                    settings.maintenance_interval_s)
        return False
    log.info("periodic maintenance sweep sent to %s", settings.queue_cpu)
    return True
