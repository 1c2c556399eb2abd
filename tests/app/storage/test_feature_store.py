"""Feature store on the real Redis (db 12): round trip, TTL and its refresh, counters, flags."""

import time
import uuid

import pytest
import redis

from app.storage import keys
from app.storage.feature_store import FeatureStore, check_safetensors
from app.storage.keys import FEATURE_VERSION
from tests.support.store import VOICE, blob


def test_features_round_trip_as_bytes(store: FeatureStore):
    assert store.get(VOICE) is None and not store.exists(VOICE)
    store.put(VOICE, blob())
    assert store.exists(VOICE) and store.get(VOICE) == blob()
    assert store.delete(VOICE) and not store.delete(VOICE)
    assert store.get(VOICE) is None


def test_the_key_carries_the_feature_version(store: FeatureStore, feature_redis: redis.Redis):
    store.put(VOICE, blob())
    assert feature_redis.keys("*") == [f"wf:feat:v{FEATURE_VERSION}:{VOICE}".encode()]


def test_every_entry_expires_and_a_read_pushes_the_expiry_out(store: FeatureStore):
    store.put(VOICE, blob(), ttl_s=2)
    assert 0 < (store.ttl(VOICE) or 0) <= 2
    time.sleep(1.2)
    assert store.get(VOICE, ttl_s=100) == blob()  # refreshed on use
    assert (store.ttl(VOICE) or 0) > 90
    store.put(VOICE, blob(), ttl_s=1)
    time.sleep(1.5)
    assert store.get(VOICE) is None and store.ttl(VOICE) is None


def test_the_default_ttl_applies(store: FeatureStore):
    store.put(VOICE, blob())
    assert 3500 < (store.ttl(VOICE) or 0) <= 3600


@pytest.mark.parametrize("value", [b"", b"\x80\x04\x95pickle", b"\x02\x00\x00\x00\x00\x00\x00\x00[]", "text"])
def test_only_safetensors_bytes_go_in(store: FeatureStore, value):
    with pytest.raises((TypeError, ValueError)):
        store.put(VOICE, value)
    assert not store.exists(VOICE)


def test_safetensors_check_accepts_real_safetensors():
    check_safetensors(blob())


def test_malformed_ids_never_become_keys(store: FeatureStore):
    for bad in ("../x", "ABC", VOICE.upper(), VOICE + "0", "*"):
        with pytest.raises(ValueError):
            store.put(bad, blob())
    with pytest.raises(ValueError):
        store.request_cancel("not-a-uuid", ttl_s=10)


def test_counters_count_per_group(store: FeatureStore):
    assert store.count(keys.COUNTER_PREP_PATH, "late") == 0
    store.incr(keys.COUNTER_PREP_PATH, "late")
    store.incr(keys.COUNTER_PREP_PATH, "late")
    store.incr(keys.COUNTER_PREP_PATH, "inline", 5)
    assert store.count(keys.COUNTER_PREP_PATH, "late") == 2
    assert store.counters(keys.COUNTER_PREP_PATH) == {"late": 2, "inline": 5}
    assert store.counters(keys.COUNTER_PREPARE) == {}


def test_prepare_claim_is_held_by_the_first_caller(store: FeatureStore):
    assert store.claim_prepare(VOICE, ttl_s=10)
    assert not store.claim_prepare(VOICE, ttl_s=10)
    store.release_prepare(VOICE)
    assert store.claim_prepare(VOICE, ttl_s=10)


def test_cancel_flags(store: FeatureStore):
    job = str(uuid.uuid4())
    assert not store.is_cancelled(job)
    store.request_cancel(job, ttl_s=10)
    assert store.is_cancelled(job)
    store.clear_cancel(job)
    assert not store.is_cancelled(job)
