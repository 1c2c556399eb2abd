"""How often a SIGKILLed Celery worker loses a message it had just taken off the Redis queue.

    python scripts/kill_loss_probe.py [--kills 20] [--redis redis://127.0.0.1:6379] [--dbs 14,15]

kombu's Redis transport pops a message (BRPOP) and only then, in a second command, records it as
unacknowledged; a worker killed in between takes the message with it, and no visibility timeout brings it
back. This starts a worker shaped like wavefarm's GPU worker (thread pool of 4, acks late, prefetch 1,
JSON, priority queues, and a thread that keeps the GIL busy as the engine thread does) on a queue of
short tasks, SIGKILLs it after 2.5-4 s, and counts the tasks that are now nowhere: not queued, not
unacknowledged, not done. Between kills it puts the unacknowledged ones back, as a live worker's
visibility-timeout scan would. The maintenance sweep (`tasks/schedule.py`) is what sends such a job again.
Uses two databases of the local Redis (flushed); nothing of wavefarm's runs.
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
from pathlib import Path

import redis

WORKER_APP = '''
import os, threading, time
import redis
from celery import Celery
app = Celery("probe", broker=os.environ["PROBE_BROKER"])
app.conf.update(task_acks_late=True, task_reject_on_worker_lost=True, worker_prefetch_multiplier=1,
                task_serializer="json", accept_content=["json"],
                broker_transport_options={"visibility_timeout": 3600, "queue_order_strategy": "priority",
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
QUEUE = "probe"


def queued_ids(broker: redis.Redis) -> set[int]:
    ids: set[int] = set()
    for key in broker.keys(f"{QUEUE}*"):
        ids.update(json.loads(json.loads(raw)["headers"]["argsrepr"])[0] for raw in broker.lrange(key, 0, -1))
    for raw in broker.hvals("unacked"):
        ids.add(json.loads(json.loads(raw)[0]["headers"]["argsrepr"])[0])
    return ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379")
    parser.add_argument("--dbs", default="14,15", help="broker and result databases (flushed)")
    args = parser.parse_args()
    db_broker, db_done = (int(x) for x in args.dbs.split(","))
    broker = redis.Redis.from_url(f"{args.redis}/{db_broker}")
    done = redis.Redis.from_url(f"{args.redis}/{db_done}")
    broker.flushdb()
    done.flushdb()
    folder = Path(tempfile.mkdtemp(prefix="kill-loss-probe-"))
    (folder / "probe_app.py").write_text(WORKER_APP)
    env = {**os.environ, "PROBE_BROKER": f"{args.redis}/{db_broker}", "PROBE_DONE": f"{args.redis}/{db_done}",
           "PYTHONPATH": str(folder)}
    subprocess.run([sys.executable, "-c", f"from probe_app import app\nfor n in range({args.tasks}): "
                    f"app.send_task('probe.t', args=[n], queue='{QUEUE}')"], env=env, check=True)
    lost: list[int] = []
    for kill in range(args.kills):
        worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "probe_app", "worker", "-Q", QUEUE,
                                   "-P", "threads", "-c", "4", "--without-gossip", "--without-mingle",
                                   "--without-heartbeat", "-l", "WARNING"], env=env, cwd=folder,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(random.uniform(2.5, 4.0))
        worker.kill()
        worker.wait()
        present = queued_ids(broker)
        finished = {int(n) for n in done.smembers("done")}
        lost = [n for n in range(args.tasks) if n not in present and n not in finished]
        print(f"kill {kill + 1}: {len(finished)} done, {len(lost)} lost so far {lost[-3:]}", flush=True)
        for raw in broker.hvals("unacked"):  # what a live worker's visibility-timeout scan restores
            broker.lpush(QUEUE, json.dumps(json.loads(raw)[0]))
        broker.delete("unacked", "unacked_index")
    print(f"{len(lost)} messages lost in {args.kills} kills")
    broker.flushdb()
    done.flushdb()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
