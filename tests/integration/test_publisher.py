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


def raw_messages(settings: Settings, queue: str) -> list[Any]:
    """The queue's messages as a worker's consumer receives them (each acknowledged), oldest first."""
    from kombu import Connection, Queue

    from app.broker.celery_config import redis_options
    from app.broker.queues import is_amqp

    options = {} if is_amqp(settings.broker_url) else redis_options(settings)
    taken = []
    with Connection(settings.broker_url, transport_options=options) as conn:
        bound = Queue(queue)(conn.channel())
        while (message := bound.get()) is not None:
            taken.append(message)
            message.ack()
    return taken


def test_the_publishers_messages_are_celerys_own(worker_settings: Settings) -> None:
    """A task sent by Celery's `send_task` and the same task sent by the Publisher, alone or in a round
    (Redis's pipelined one), arrive as the same message: headers (`argsrepr` included, which the
    Publisher writes without Celery's saferepr for plain ids), body and properties."""
    settings = worker_settings.model_copy(update={"queue_gpu": f"same-{uuid.uuid4().hex[:8]}"})
    app = make_celery(settings)
    publisher = Publisher(app)
    args_of = {"plain": ["7f0c1d2e-aaaa-bbbb-cccc-0123456789ab"], "escaped": ["it's \\ é"],
               "mixed": ["b-1", 3]}
    try:
        for how in ("alone", "round"):
            for kind, args in args_of.items():
                task_id = f"{how}-{kind}-{uuid.uuid4().hex[:6]}"
                app.send_task(wire.SYNTH_TASK, args=args, task_id=task_id, queue=settings.queue_gpu,
                              priority=wire.broker_priority(6))
                if how == "alone":
                    publisher.send_task(wire.SYNTH_TASK, args=args, task_id=task_id, queue=settings.queue_gpu,
                                        priority=wire.broker_priority(6))
                else:
                    with publisher.round() as one:
                        one.send_task(wire.SYNTH_TASK, args=args, task_id=task_id, queue=settings.queue_gpu,
                                      priority=wire.broker_priority(6))
                celerys, ours = raw_messages(settings, settings.queue_gpu)
                assert ours.headers == celerys.headers
                assert ours.decode() == celerys.decode()
                mine, theirs = ({k: v for k, v in m.properties.items() if k != "delivery_tag"}
                                for m in (ours, celerys))
                assert mine == theirs and mine["priority"] == wire.broker_priority(6)
    finally:
        publisher.close()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_messages_copied_from_one_built_message_are_each_celerys_own(
        broker: str, worker_settings: Settings, request: pytest.FixtureRequest) -> None:
    """The Publisher builds a task's message once per queue and priority and copies it with each job's
    id and arguments: every copy, interleaved across queues and priorities (a worker's own queue, which
    Celery adds as it routes, among them) and on both brokers (RabbitMQ's priorities turned around), is
    the message Celery's `send_task` sends for that job, in the thread that sends it."""
    url = request.getfixturevalue("amqp_url") if broker == "rabbitmq" else worker_settings.broker_url
    tag = uuid.uuid4().hex[:8]
    settings = worker_settings.model_copy(update={"broker_url": url, "queue_gpu": f"copies-{tag}"})
    own = f"copies-own-{tag}"  # not among the app's queues, as a GPU worker's own queue is not
    app = make_celery(settings)
    publisher = Publisher(app)
    sends = [(settings.queue_gpu, 6), (own, 6), (settings.queue_gpu, 2), (settings.queue_gpu, 6), (own, 6),
             (settings.queue_gpu, 2)]
    try:
        for i, (queue, priority) in enumerate(sends):
            job_id, args = str(uuid.uuid4()), [f"job-{i}-{tag}"]

            def send_both(job_id: str = job_id, args: list[str] = args, queue: str = queue,
                          priority: int = priority) -> None:
                for sender in (app, publisher):
                    sender.send_task(wire.SYNTH_TASK, args=args, task_id=job_id, queue=queue,
                                     priority=wire.broker_priority(priority))

            if i % 2:  # from a thread of its own, as the API's thread pool sends (`reply_to` is per thread)
                thread = threading.Thread(target=send_both)
                thread.start()
                thread.join()
            else:
                send_both()
            celerys, ours = raw_messages(settings, queue)
            assert ours.headers == celerys.headers and ours.headers["id"] == job_id
            assert ours.decode() == celerys.decode() and ours.decode()[0] == args
            assert ({k: v for k, v in ours.properties.items() if k != "delivery_tag"}
                    == {k: v for k, v in celerys.properties.items() if k != "delivery_tag"})
        assert len(publisher.shapes) == 3  # built once for each queue and priority, then copied
        with app.connection_for_write() as conn:
            for queue in (settings.queue_gpu, own):
                conn.default_channel.queue_delete(queue)
    finally:
        publisher.close()


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_a_queue_is_declared_once_per_connection_and_every_message_arrives(
        broker: str, worker_settings: Settings, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Single messages through the pooled producer: the first declares its queue; the next ones find it in
    kombu's record of what the connection declared, and skip kombu's declare check (which binds copies of
    the queue and its exchange on every publish), and each still reaches the queue."""
    from kombu import Queue
    from kombu.messaging import Producer

    url = request.getfixturevalue("amqp_url") if broker == "rabbitmq" else worker_settings.broker_url
    queue = f"declared-{uuid.uuid4().hex[:8]}"
    settings = worker_settings.model_copy(update={"broker_url": url, "queue_gpu": queue})
    declared: list[str] = []  # the queues declared on the broker
    checked: list[str] = []  # the queues kombu checked before a publish
    real_declare, real_check = Queue.declare, Producer.maybe_declare

    def declare(self: Queue, *args: Any, **kwargs: Any) -> Any:
        declared.append(self.name)
        return real_declare(self, *args, **kwargs)

    def check(self: Producer, entity: Any, *args: Any, **kwargs: Any) -> Any:
        checked.append(entity.name)
        return real_check(self, entity, *args, **kwargs)

    monkeypatch.setattr(Queue, "declare", declare)
    monkeypatch.setattr(Producer, "maybe_declare", check)
    app = make_celery(settings)
    publisher = Publisher(app)
    try:
        for i in range(3):
            publisher.send_task(wire.SYNTH_TASK, args=[f"job-{i}"], queue=queue,
                                priority=wire.broker_priority(i))
        assert declared == [queue] and checked == [queue]
        with app.connection_for_write() as conn:
            assert conn.default_channel.queue_declare(queue, passive=True).message_count == 3
            conn.default_channel.queue_delete(queue)
    finally:
        publisher.close()


def test_a_round_on_redis_is_one_pipeline_and_a_worker_runs_every_task_of_it(
        cpu_worker: str, worker_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing of the round reaches Redis before it ends, then every message goes in one pipeline (one
    round trip), and the session's CPU worker consumes and runs each one."""
    import redis.client

    executed: list[list[str]] = []
    real_execute = redis.client.Pipeline.execute

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        commands = [str(c[0][0]) for c in self.command_stack]
        if "LPUSH" in commands:  # a pipeline with messages (the queue's declaration has its own: LLEN, SADD)
            executed.append(commands)
        return real_execute(self, *args, **kwargs)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    app = make_celery(worker_settings)
    publisher = Publisher(app)
    task_ids = [f"round-{i}-{uuid.uuid4()}" for i in range(8)]
    try:
        with publisher.round() as one:
            for task_id in task_ids:
                one.send_task(wire.SWEEP_TASK, args=[], task_id=task_id, queue=worker_settings.queue_cpu,
                              priority=wire.broker_priority(5))
            assert executed == []
        assert executed == [["LPUSH"] * len(task_ids)]
        for task_id in task_ids:
            assert app.AsyncResult(task_id).get(timeout=120) is not None  # run, and its result stored
    finally:
        publisher.close()


def test_a_round_on_redis_whose_pipeline_fails_raises_as_it_ends_and_counts_nothing_sent(
        worker_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its sender is `deferred` (no message counts as sent before the round ends), and the pipeline's
    failure raises out of the round: `app.submission.batch` then takes every job of the batch back."""
    import redis.client

    def execute(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise redis.exceptions.ConnectionError("the broker went away")

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    settings = worker_settings.model_copy(update={"queue_gpu": f"failed-{uuid.uuid4().hex[:8]}"})
    publisher = Publisher(make_celery(settings))
    try:
        with pytest.raises(Exception) as raised:
            with publisher.round() as one:
                assert getattr(one, "deferred", False)
                for i in range(3):
                    wire.send_synth(one, settings, f"job-{i}", priority=i)
        assert isinstance(raised.value.__cause__, redis.exceptions.ConnectionError)
        monkeypatch.undo()
        assert raw_messages(settings, settings.queue_gpu) == []
    finally:
        publisher.close()


def test_a_round_on_rabbitmq_writes_its_messages_a_chunk_at_a_time(
        amqp_url: str, worker_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """py-amqp writes each message with a system call of its own; a round's 300 go out in a few writes, and
    all reach the queue, in order."""
    settings = worker_settings.model_copy(update={"broker_url": amqp_url,
                                                  "queue_gpu": f"chunks-{uuid.uuid4().hex[:8]}"})
    publisher = Publisher(make_celery(settings))
    try:
        with publisher.round() as one:  # connected, and the queue declared, before the writes are counted
            wire.send_synth(one, settings, "job-first", priority=0)
            transport = one.producer.channel.connection.transport
        writes = []
        real_write = transport._write  # the socket's sendall, which py-amqp's every write goes through

        def write(data: Any) -> Any:
            writes.append(len(data))
            return real_write(data)

        monkeypatch.setattr(transport, "_write", write)
        with publisher.round() as one:
            assert one.producer.channel.connection.transport is transport  # the pool's one connection
            for i in range(300):
                wire.send_synth(one, settings, f"job-{i}", priority=0)
        monkeypatch.undo()
        assert sum(writes) > 300 * 100 and len(writes) < 30, (len(writes), sum(writes))
        taken = [m.headers["id"] for m in raw_messages(settings, settings.queue_gpu)]
        assert taken == ["job-first"] + [f"job-{i}" for i in range(300)]
        with publisher.app.connection_for_write() as conn:
            conn.default_channel.queue_delete(settings.queue_gpu)
    finally:
        publisher.close()
