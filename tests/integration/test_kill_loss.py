"""A SIGKILLed worker loses no message on RabbitMQ: `scripts/kill_loss_probe.py` (a worker shaped like
the GPU worker, killed while it takes messages off the queue) against the real RabbitMQ.

On kombu's Redis transport the same probe loses messages (docs/RELIABILITY.md gives the figure): a
kill between its pop and its record of the delivery takes the message along, and only the maintenance
sweep sends such a job again (tests/tasks/test_schedule.py). RabbitMQ keeps every delivered message
until it is acknowledged and requeues a dead consumer's at once, which is why deployments run it.
"""

from __future__ import annotations

import sys

import pytest

from tests.conftest import REPO, XDIST_WORKER, redis_url

sys.path.insert(0, str(REPO / "scripts"))

import kill_loss_probe  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# The probe flushes the database it records finished tasks in: one per set of test databases.
PROBE_DONE_DB = {"gw0": 14, "gw1": 9}[XDIST_WORKER]


def test_a_worker_sigkilled_five_times_loses_no_message_on_rabbitmq(amqp_url: str,
                                                                    redis_session_lock: None) -> None:
    lost = kill_loss_probe.probe(amqp_url, redis_url(PROBE_DONE_DB), kills=5, tasks=600)
    assert lost == 0
