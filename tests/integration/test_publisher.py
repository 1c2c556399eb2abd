"""The producers' `Publisher` against the session's CPU worker: a task it publishes runs, its result is
stored, and the worker's events (received, started, succeeded: what Flower follows a job by) still flow,
while the producer's own `task-sent` event is no longer published."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from app.broker import wire
from app.broker.celery_config import make_celery
from app.broker.publisher import Publisher
from app.settings import Settings


class EventLog:
    """Every task event of the broker's event exchange, by task id, from a thread of its own."""

    def __init__(self, app: Any) -> None:
        self.app, self.seen, self.stop = app, {}, False
        self.thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        with self.app.connection_for_read() as conn:
            receiver = self.app.events.Receiver(conn, handlers={"*": self._on_event})
            for _ in receiver.consume(limit=None, timeout=None, wakeup=False):
                if self.stop:
                    return

    def _on_event(self, event: dict[str, Any]) -> None:
        if "uuid" in event:
            self.seen.setdefault(event["uuid"], []).append(event["type"])

    def wait_for(self, task_id: str, types: set[str], timeout: float, send_marker: bool = False) -> set[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if send_marker:
                with self.app.events.default_dispatcher() as dispatcher:
                    dispatcher.send("task-sent", uuid=task_id, name="publisher-test.marker")
            if types <= set(self.seen.get(task_id, [])):
                break
            time.sleep(0.5)
        return set(self.seen.get(task_id, []))


def test_a_published_task_runs_and_its_worker_events_flow_without_a_sent_event(
        cpu_worker: str, worker_settings: Settings) -> None:
    app = make_celery(worker_settings)
    events = EventLog(app)
    events.thread.start()
    try:
        marker = f"marker-{uuid.uuid4()}"  # the receiver is bound once it sees an event sent after it
        assert events.wait_for(marker, {"task-sent"}, 60, send_marker=True) == {"task-sent"}
        task_id = str(uuid.uuid4())
        publisher = Publisher(app)
        publisher.send_task(wire.SWEEP_TASK, args=[], task_id=task_id, queue=worker_settings.queue_cpu)
        assert app.AsyncResult(task_id).get(timeout=120) is not None  # run, and its result stored
        worker_events = {"task-received", "task-started", "task-succeeded"}
        seen = events.wait_for(task_id, worker_events, 60)
        assert worker_events <= seen and "task-sent" not in seen, seen
    finally:
        events.stop = True
        app.close()


def test_a_round_on_rabbitmq_publishes_every_message_and_awaits_the_confirms_once(
        amqp_url: str, worker_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every message of the round is published before the first wait for a confirm (py-amqp's own
    publish waits for each message's confirm before the next), and all of them reach the queue."""
    import amqp
    from amqp import spec

    events: list[str] = []
    real_publish, real_wait = amqp.Channel._basic_publish, amqp.Channel.wait

    def publish(self: Any, *args: Any, **kwargs: Any) -> Any:
        events.append("publish")
        return real_publish(self, *args, **kwargs)

    def wait(self: Any, method: Any, *args: Any, **kwargs: Any) -> Any:
        if spec.Basic.Ack in (method if isinstance(method, list) else [method]):
            events.append("confirm")
        return real_wait(self, method, *args, **kwargs)

    # Patched on the class and resolved at each call: channels pooled by other tests are not changed.
    monkeypatch.setattr(amqp.Channel, "_basic_publish", publish)
    monkeypatch.setattr(amqp.Channel, "wait", wait)
    settings = worker_settings.model_copy(update={"broker_url": amqp_url,
                                                  "queue_gpu": f"round-{uuid.uuid4().hex[:8]}"})
    publisher = Publisher(make_celery(settings))
    try:
        with publisher.round() as one:
            for i in range(300):
                wire.send_synth(one, settings, f"job-{i}", priority=i % 10)
        with publisher.app.connection_for_write() as conn:
            channel = conn.default_channel
            assert channel.queue_declare(settings.queue_gpu, passive=True).message_count == 300
            channel.queue_delete(settings.queue_gpu)
    finally:
        publisher.close()
    assert events.count("publish") == 300 and events.index("confirm") == 300, events[:5]
