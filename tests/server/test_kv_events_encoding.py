"""server/kv_events.py without a server: the two encodings, vLLM's config JSON, a full queue,
the replay answer's frames."""

from __future__ import annotations

import json
import time

import msgpack
import pytest
import zmq

from scheduler.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored
from server.kv_events import (
    END_SEQ,
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


def replay_answer(encoding: str, num_batches: int, first: int) -> list[list[bytes]]:
    """The frames a DEALER gets for [b"", first] from a publisher that sent `num_batches`."""
    config = KVEventsConfig(
        endpoint=f"inproc://kv-pub-{encoding}",
        replay_endpoint=f"inproc://kv-replay-{encoding}",
        topic="t",
        encoding=encoding,
    )
    publisher = KVEventPublisher(config, block_size=4)
    try:
        for _ in range(num_batches):
            publisher.publish([AllBlocksCleared()])
        deadline = time.monotonic() + 5
        while len(publisher._buffer) < num_batches:
            assert time.monotonic() < deadline, "the publisher did not send"
            time.sleep(0.01)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        answer: list[list[bytes]] = []
        while not answer or answer[-1][-2] != END_SEQ:
            assert dealer.poll(5000), "no replay answer"
            answer.append(dealer.recv_multipart())
        dealer.close(linger=0)
        return answer
    finally:
        publisher.close()


def test_array_replay_answers_as_vllm_does():
    answer = replay_answer("array", num_batches=3, first=1)
    assert [len(frames) for frames in answer] == [3, 3, 3]  # [b"", seq, payload]
    assert [frames[1] for frames in answer] == [
        (1).to_bytes(8, "big"),
        (2).to_bytes(8, "big"),
        END_SEQ,
    ]
    assert msgpack.unpackb(answer[0][2])[1] == [["AllBlocksCleared"]]


def test_map_replay_answers_with_the_topic_as_vllm_router_reads_it():
    # vllm-router 0.1.17 reads [b"", topic, seq, payload]: seq second from last, at least 4 frames
    answer = replay_answer("map", num_batches=3, first=1)
    assert [len(frames) for frames in answer] == [4, 4, 4]
    assert [frames[1] for frames in answer] == [b"t", b"t", b"t"]
    assert [frames[-2] for frames in answer] == [
        (1).to_bytes(8, "big"),
        (2).to_bytes(8, "big"),
        END_SEQ,
    ]
    assert msgpack.unpackb(answer[0][-1])[1] == [{"type": "AllBlocksCleared"}]
    assert answer[-1][-1] == b""
