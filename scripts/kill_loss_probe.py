"""How often a SIGKILLed Celery worker loses a message it had just taken off the broker's queue.

    python scripts/kill_loss_probe.py [--kills 20] [--broker redis://127.0.0.1:6379/14] [--done redis://127.0.0.1:6379/15]
    python scripts/kill_loss_probe.py --broker amqp://guest:guest@127.0.0.1:5672/

kombu's Redis transport pops a message (BRPOP) and only then, in a second command, records it as
unacknowledged; a worker killed in between takes the message with it, and no visibility timeout brings it
back. RabbitMQ hands a message to a consumer and keeps it until that consumer acknowledges it or its
connection closes, when it is requeued: nothing is lost. This starts a worker shaped like wavefarm's GPU
worker (thread pool of 4, acks late, prefetch 1, JSON, priority queues, and a thread that keeps the GIL
busy as the engine thread does) on a queue of short tasks, SIGKILLs it after 2.5-4 s, and counts the
tasks that are now nowhere: not queued, not unacknowledged, not done. On Redis it then puts the
unacknowledged ones back, as a live worker's visibility-timeout scan would (RabbitMQ needs no help). The
maintenance sweep (`tasks/schedule.py`) is what sends such a job again on Redis.
Redis broker: its database is flushed. RabbitMQ: a queue of this run's own, deleted at the end. The
finished tasks are recorded in the Redis database --done (flushed); nothing of wavefarm's runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from kombu import Connection

WORKER_APP = '''
import os, threading, time
import redis
from celery import Celery
app = Celery("probe", broker=os.environ["PROBE_BROKER"])
app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
                task_serializer="json", accept_content=["json"])
if os.environ["PROBE_BROKER"].startswith("amqp"):  # as app.broker.celery_config does for RabbitMQ
    app.conf.update(task_queue_max_priority=9, broker_transport_options={"confirm_publish": True})
else:
    app.conf.update(broker_transport_options={"visibility_timeout": 3600, "queue_order_strategy": "priority",
                                              "priority_steps": list(range(10))})
done = redis.Redis.from_url(os.environ["PROBE_DONE"])
def busy():  # Python-level work holding the GIL, as the GPU worker's engine thread does between kernels
    while True:
        sum(i * i for i in range(20000))
threading.Thread(target=busy, daemon=True).start()
@app.task(name="probe.t")
def t(n):
    time.sleep(0.05)
    done.sadd("done", n)
'''


def task_number(message: dict[str, Any]) -> int:
    return int(json.loads(message["headers"]["argsrepr"])[0])


class RedisQueue:
    """kombu's Redis transport: the queue's lists and the `unacked` hash, read directly."""

    def __init__(self, url: str, queue: str) -> None:
        self.client, self.queue = redis.Redis.from_url(url), queue
        self.client.flushdb()

    def present(self) -> set[int]:
        ids = {task_number(json.loads(raw)) for key in self.client.keys(f"{self.queue}*")
               for raw in self.client.lrange(key, 0, -1)}
        return ids | {task_number(json.loads(raw)[0]) for raw in self.client.hvals("unacked")}

    def after_kill(self) -> None:
        for raw in self.client.hvals("unacked"):  # what a live worker's visibility-timeout scan restores
            self.client.lpush(self.queue, json.dumps(json.loads(raw)[0]))
        self.client.delete("unacked", "unacked_index")

    def close(self) -> None:
        self.client.flushdb()


class AmqpQueue:
    """RabbitMQ: the queue's messages read with basic.get and handed back unacknowledged."""

    def __init__(self, url: str, queue: str) -> None:
        self.url, self.queue = url, queue

    def present(self) -> set[int]:
        with Connection(self.url) as conn:
            channel = conn.channel()
            deadline = time.monotonic() + 30
            while channel.queue_declare(self.queue, passive=True).consumer_count:  # the dead one's requeue
                assert time.monotonic() < deadline, "the killed worker's consumer never went away"
                time.sleep(0.1)
            ids: set[int] = set()
            while (message := channel.basic_get(self.queue, no_ack=False)) is not None:
                ids.add(task_number({"headers": message.properties["application_headers"]}))
            return ids  # closing the channel requeues every message it got

    def after_kill(self) -> None:
        pass  # RabbitMQ requeued the dead consumer's messages when its connection closed

    def close(self) -> None:
        with Connection(self.url) as conn:
            conn.channel().queue_delete(self.queue)


def run_worker(env: dict[str, str], folder: Path, queue: str) -> None:
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "probe_app", "worker", "-Q", queue,
                               "-P", "threads", "-c", "4", "--without-gossip", "--without-mingle",
                               "--without-heartbeat", "-l", "WARNING"], env=env, cwd=folder,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(random.uniform(2.5, 4.0))
    worker.kill()
    worker.wait()


def probe(broker: str, done_url: str, kills: int, tasks: int) -> int:
    """SIGKILL the worker `kills` times; the number of tasks lost (printed as it goes)."""
    amqp = broker.startswith("amqp")
    queue = f"probe-{uuid.uuid4().hex[:8]}" if amqp else "probe"
    view = AmqpQueue(broker, queue) if amqp else RedisQueue(broker, queue)
    done = redis.Redis.from_url(done_url)
    done.flushdb()
    folder = Path(tempfile.mkdtemp(prefix="kill-loss-probe-"))
    (folder / "probe_app.py").write_text(WORKER_APP)
    env = {**os.environ, "PROBE_BROKER": broker, "PROBE_DONE": done_url, "PYTHONPATH": str(folder)}
    send = (f"from probe_app import app\nfor n in range({tasks}): "
            f"app.send_task('probe.t', args=[n], queue='{queue}', priority=n % 10)")
    subprocess.run([sys.executable, "-c", send], env=env, check=True)
    lost: list[int] = []
    try:
        for kill in range(kills):
            run_worker(env, folder, queue)
            present = view.present()
            finished = {int(n) for n in done.smembers("done")}
            lost = [n for n in range(tasks) if n not in present and n not in finished]
            print(f"kill {kill + 1}: {len(finished)} done, {len(lost)} lost so far {lost[-3:]}", flush=True)
            view.after_kill()
    finally:
        view.close()
        done.flushdb()
    print(f"{len(lost)} messages lost in {kills} kills ({broker.split('://')[0]})")
    return len(lost)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/14",
                        help="redis://host:port/db (flushed) or amqp://user:password@host:port/vhost")
    parser.add_argument("--done", default="redis://127.0.0.1:6379/15",
                        help="where finished tasks go (flushed)")
    parser.add_argument("--fail-on-loss", action="store_true", help="exit 1 when any message was lost")
    args = parser.parse_args()
    lost = probe(args.broker, args.done, args.kills, args.tasks)
    return 1 if args.fail_on_loss and lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
