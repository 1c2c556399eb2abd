"""What the service tests share: the broker's queued messages as {task, id, args, priority}, a job counter."""

import base64
import json
from typing import Any

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session


def queued(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """Messages waiting in a queue (any priority level), oldest first, as {task, id, args, priority}."""
    out = []
    for key in sorted(client.keys(f"{queue}*")):
        if key.decode() != queue and not key.decode().startswith(f"{queue}\x06\x16"):
            continue
        for raw in reversed(client.lrange(key, 0, -1)):  # kombu LPUSHes, consumers BRPOP
            msg = json.loads(raw)
            args = json.loads(base64.b64decode(msg["body"]))[0]
            out.append(
                {
                    "task": msg["headers"]["task"],
                    "id": msg["headers"]["id"],
                    "args": args,
                    "priority": msg["properties"].get("priority"),
                }
            )
    return out


def count(session: Session, model: type) -> int:
    return session.scalar(select(func.count()).select_from(model)) or 0
