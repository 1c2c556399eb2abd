"""The feature store: prepared voice features and text jobs' guide speech in Redis, plus counters and
cancel flags.

The only module that talks to the feature-store Redis. Values are raw
safetensors bytes (checked on the way in; nothing else, never pickle).
Every feature key has a TTL that each read refreshes, so the store can run
as an LRU cache (`maxmemory-policy volatile-lru`): a miss just means
"prepare again". Counters have no TTL and are therefore never evicted
under volatile-lru.
"""

from __future__ import annotations

import json
from typing import Any, cast

import redis

from app.storage import keys


def check_safetensors(data: bytes) -> None:
    """Refuse anything that is not framed as safetensors: 8-byte header length, then a JSON header."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"feature store values are bytes, not {type(data).__name__}")
    raw = bytes(data[:8])
    if len(raw) < 8:
        raise ValueError("not safetensors: shorter than its header length")
    size = int.from_bytes(raw, "little")
    if size < 2 or 8 + size > len(data):
        raise ValueError("not safetensors: header length out of range")
    try:
        header = json.loads(bytes(data[8 : 8 + size]))
    except ValueError as exc:
        raise ValueError("not safetensors: header is not JSON") from exc
    if not isinstance(header, dict):
        raise ValueError("not safetensors: header is not a JSON object")


class FeatureStore:
    """Voice features by voice id, with TTLs; counters by group and name; job cancel flags."""

    def __init__(self, client: redis.Redis, *, ttl_s: int) -> None:
        self.client = client
        self.ttl_s = ttl_s

    @classmethod
    def from_url(cls, url: str, *, ttl_s: int) -> FeatureStore:
        return cls(redis.Redis.from_url(url, decode_responses=False), ttl_s=ttl_s)

    def close(self) -> None:
        self.client.close()

    # Features -----------------------------------------------------------------

    def put(self, voice_id: str, data: bytes, ttl_s: int | None = None) -> None:
        check_safetensors(data)
        self.client.set(keys.feature_key(voice_id), bytes(data), ex=ttl_s or self.ttl_s)

    def get(self, voice_id: str, ttl_s: int | None = None) -> bytes | None:
        """The features, or None on a miss; a hit pushes the expiry out again (GETEX)."""
        value = cast(bytes | None, self.client.getex(keys.feature_key(voice_id), ex=ttl_s or self.ttl_s))
        return bytes(value) if value is not None else None

    def exists(self, voice_id: str) -> bool:
        return bool(self.client.exists(keys.feature_key(voice_id)))

    def delete(self, voice_id: str) -> bool:
        return bool(self.client.delete(keys.feature_key(voice_id)))

    def ttl(self, voice_id: str) -> int | None:
        """Seconds left, or None when the key is missing."""
        left = int(self.client.ttl(keys.feature_key(voice_id)))
        return None if left == -2 else left

    # Guide speech of text jobs --------------------------------------------------

    def put_guide_speech(self, job_id: str, data: bytes, ttl_s: int | None = None) -> None:
        check_safetensors(data)
        self.client.set(keys.guide_speech_key(job_id), bytes(data), ex=ttl_s or self.ttl_s)

    def put_guide_speeches(self, speech: dict[str, bytes], ttl_s: int | None = None) -> None:
        """`put_guide_speech` for many jobs (job id -> bytes) in one round trip (a `book.tokenize` group)."""
        pipe = self.client.pipeline(transaction=False)
        for job_id, data in speech.items():
            check_safetensors(data)
            pipe.set(keys.guide_speech_key(job_id), bytes(data), ex=ttl_s or self.ttl_s)
        pipe.execute()

    def get_guide_speech(self, job_id: str) -> bytes | None:
        value = cast(bytes | None, self.client.get(keys.guide_speech_key(job_id)))
        return bytes(value) if value is not None else None

    def has_guide_speech(self, job_id: str) -> bool:
        return bool(self.client.exists(keys.guide_speech_key(job_id)))

    def delete_guide_speech(self, job_id: str) -> None:
        self.client.delete(keys.guide_speech_key(job_id))

    def note_phase(self, job_id: str, fields: dict[str, str | int | float]) -> None:
        """Record a text job's phase and its timings (`keys.job_phase_key`), with the store's TTL."""
        pipe = self.client.pipeline()
        pipe.hset(keys.job_phase_key(job_id), mapping=cast(dict[Any, Any], fields))
        pipe.expire(keys.job_phase_key(job_id), self.ttl_s)
        pipe.execute()

    def phase(self, job_id: str) -> dict[str, str]:
        raw = cast(dict[bytes, bytes], self.client.hgetall(keys.job_phase_key(job_id)))
        return {name.decode(): value.decode() for name, value in raw.items()}

    # Preparation claims ---------------------------------------------------------

    def claim_prepare(self, voice_id: str, ttl_s: int) -> bool:
        """True for the first caller in `ttl_s`: that caller enqueues the voice's preparation."""
        return bool(self.client.set(keys.prepare_claim_key(voice_id), b"1", nx=True, ex=ttl_s))

    def release_prepare(self, voice_id: str) -> None:
        self.client.delete(keys.prepare_claim_key(voice_id))

    def claim_sweep(self, queue: str, period_s: float) -> bool:
        """True for the first caller in `period_s`: that caller sends the periodic maintenance sweep."""
        return bool(self.client.set(keys.sweep_sent_key(queue), b"1", nx=True,
                                    px=max(1, int(period_s * 1000))))

    # Counters -------------------------------------------------------------------

    def incr(self, group: str, name: str, amount: int = 1) -> int:
        return int(self.client.hincrby(keys.counter_key(group), name, amount))

    def count(self, group: str, name: str) -> int:
        value = self.client.hget(keys.counter_key(group), name)
        return int(value) if value is not None else 0

    def counters(self, group: str) -> dict[str, int]:
        raw = cast(dict[bytes, bytes], self.client.hgetall(keys.counter_key(group)))
        return {name.decode(): int(value) for name, value in raw.items()}

    def memory(self) -> tuple[int, int]:
        """(bytes used, the maxmemory limit; 0 when unlimited) of the feature-store Redis (INFO memory)."""
        info = cast(dict[str, int], self.client.info("memory"))
        return int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))

    # Cancel flags ---------------------------------------------------------------

    def request_cancel(self, job_id: str, ttl_s: int) -> None:
        self.client.set(keys.cancel_key(job_id), b"1", ex=ttl_s)

    def is_cancelled(self, job_id: str) -> bool:
        return bool(self.client.exists(keys.cancel_key(job_id)))

    def clear_cancel(self, job_id: str) -> None:
        self.client.delete(keys.cancel_key(job_id))

    def join_listeners(self, job_id: str, listener: str, *, owned: bool, ttl_s: int) -> None:
        """Count `listener` among the job's speech listeners (`owned`: it created the job); `ttl_s` at
        least the longest job (the keys outlive a crashed API process's listeners, never a stream)."""
        pipe = self.client.pipeline()
        pipe.sadd(keys.speech_listeners_key(job_id), listener)
        pipe.expire(keys.speech_listeners_key(job_id), ttl_s)
        if owned:
            pipe.set(keys.speech_owned_key(job_id), b"1", ex=ttl_s)
        else:
            pipe.expire(keys.speech_owned_key(job_id), ttl_s)
        pipe.execute()

    def leave_listeners(self, job_id: str, listener: str) -> bool:
        """Take `listener` out, in one transaction; True when it was the last one of a job that a speech
        request created (then its leaving may cancel the job)."""
        pipe = self.client.pipeline()  # MULTI/EXEC: two listeners leaving at once cannot both be "last"
        pipe.srem(keys.speech_listeners_key(job_id), listener)
        pipe.scard(keys.speech_listeners_key(job_id))
        pipe.exists(keys.speech_owned_key(job_id))
        removed, left, owned = pipe.execute()
        return bool(removed) and left == 0 and bool(owned)
