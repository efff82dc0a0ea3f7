"""server/kv_events.py without a server: the two encodings, vLLM's config JSON, a full queue."""

from __future__ import annotations

import json
import time

import msgpack
import pytest

from scheduler.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored
from server.kv_events import (
    KVEventPublisher,
    KVEventsConfig,
    default_topic,
    encode_batch,
    parse_vllm_config,
)
from server.settings import Settings

EVENTS = [BlockStored([7, 8], None, [1, 2, 3, 4]), BlockRemoved([7]), AllBlocksCleared()]


def test_array_encoding_is_vllms_array_like_structs():
    ts, events, rank = msgpack.unpackb(encode_batch(EVENTS, 2, "array", 12.5))
    assert (ts, rank) == (12.5, 0)
    assert events == [
        ["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU"],
        ["BlockRemoved", [7], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_map_encoding_is_tagged_maps_in_a_positional_batch():
    ts, events, rank = msgpack.unpackb(encode_batch(EVENTS, 2, "map", 1.0))
    assert (ts, rank) == (1.0, 0)  # the batch stays positional (vllm-router reads it so)
    assert [e["type"] for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_a_lora_blocks_events_carry_its_id_and_name():
    stored = BlockStored([9], None, [1, 2], lora_id=1, lora_name="pirate")
    _, (array,), _ = msgpack.unpackb(encode_batch([stored], 2, "array", 1.0))
    assert array == ["BlockStored", [9], None, [1, 2], 2, 1, "GPU"]
    _, (mapped,), _ = msgpack.unpackb(encode_batch([stored], 2, "map", 1.0))
    assert (mapped["lora_id"], mapped["lora_name"]) == (1, "pirate")


def test_vllm_config_json():
    vllm = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    text = json.dumps({**vllm, "topic": "t", "hwm": 10})
    assert parse_vllm_config(text) == {"endpoint": "tcp://*:5557", "topic": "t", "hwm": 10}
    assert parse_vllm_config('{"enable_kv_cache_events": false, "endpoint": "x"}') == {}
    with pytest.raises(ValueError, match="only zmq"):
        parse_vllm_config('{"publisher": "kafka"}')


def test_default_topic_is_llm_ds_for_array_and_empty_for_map():
    array = Settings(model="m", host="10.0.0.2", port=8001, kv_events_encoding="array")
    assert default_topic(array, "tiny") == "kv@10.0.0.2:8001@tiny"
    # vllm-router 0.1.17 drops frames whose topic is not "" (tests/deploy/test_router_kv_aware.py)
    assert default_topic(Settings(model="m", kv_events_encoding="map"), "tiny") == ""


def test_a_full_queue_drops_batches_and_never_blocks():
    config = KVEventsConfig(endpoint="inproc://kv-test-full", topic="t", max_queue_size=2)
    publisher = KVEventPublisher(config, block_size=4)
    publisher._queue.put(None)  # stop the sender: nothing leaves the queue any more
    publisher._thread.join(timeout=2)
    t0 = time.perf_counter()
    for _ in range(100):
        publisher.publish([AllBlocksCleared()])
    assert time.perf_counter() - t0 < 0.1
    assert publisher.num_dropped >= 98
    publisher._pub.close(linger=0)
