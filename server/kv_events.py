"""KV events as vLLM publishes them (vllm/distributed/kv_events.py): msgpack EventBatch over a
ZMQ PUB socket, frames [topic, 8-byte big-endian sequence number, payload], and an optional
ROUTER replay socket (send the first wanted sequence number as 8 bytes big-endian; get
[seq, payload] frames, then [-1, b""]).

Encodings (--kv-events-encoding):
- "array" (default): vLLM's array-like structs, what llm-d's kv-cache manager decodes:
  EventBatch = [ts, events, data_parallel_rank]; BlockStored = ["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium]; BlockRemoved = ["BlockRemoved",
  block_hashes, medium]; AllBlocksCleared = ["AllBlocksCleared"].
- "map": the newer tagged maps inside the same positional batch, what vllm-router decodes:
  [ts, [{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
  "block_size", "lora_id", "medium", "lora_name"}, {"type": "BlockRemoved", ...}], 0].
  Its replay answers carry the topic too, [topic, seq, payload] and [topic, -1, b""]: vllm-router
  0.1.17's DEALER drops a reply of fewer than 4 frames ([b"", topic, seq, payload]), so it
  would ignore vLLM's [seq, payload].
Block hashes are unsigned 64-bit ints (scheduler.kv_blocks.block_hash); medium is "GPU" as
vLLM names its device cache, whatever the device.

The engine thread only puts a batch on a bounded queue (put_nowait): a slow or absent
subscriber never stalls a step; when the queue is full the batch is dropped and counted, and
a subscriber that sees a gap in the sequence numbers should replay or resync.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from scheduler.kv_blocks import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("cellserve.kv_events")
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class KVEventsConfig:
    endpoint: str
    topic: str
    replay_endpoint: str | None = None
    encoding: str = "array"
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000


def parse_vllm_config(text: str) -> dict[str, Any]:
    """vLLM's --kv-events-config JSON -> our fields (publisher must be "zmq")."""
    raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    if not raw.get("enable_kv_cache_events", True):
        return {}
    if raw.get("publisher", "zmq") not in ("zmq", "null"):
        raise ValueError(f"unsupported KV events publisher {raw['publisher']!r}: only zmq")
    if raw.get("publisher") == "null":
        return {}
    keys = ("endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm", "max_queue_size")
    return {k: raw[k] for k in keys if raw.get(k) is not None}


def encode_event(event: KVEvent, block_size: int, encoding: str) -> Any:
    if isinstance(event, BlockStored):
        fields: dict[str, Any] = {
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": block_size,
            "lora_id": event.lora_id,
            "medium": MEDIUM,
        }
        tag = "BlockStored"
    elif isinstance(event, BlockRemoved):
        fields = {"block_hashes": event.block_hashes, "medium": MEDIUM}
        tag = "BlockRemoved"
    else:
        assert isinstance(event, AllBlocksCleared)
        fields, tag = {}, "AllBlocksCleared"
    if encoding == "array":
        return [tag, *fields.values()]
    if isinstance(event, BlockStored):
        fields["lora_name"] = event.lora_name
    return {"type": tag, **fields}


def encode_batch(events: list[KVEvent], block_size: int, encoding: str, ts: float) -> bytes:
    body = [encode_event(e, block_size, encoding) for e in events]
    batch = [ts, body, 0]
    import msgpack  # the kv-events extra: imported only when events are on

    return msgpack.packb(batch, use_bin_type=True)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind where the address is a wildcard or local transport, else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        import zmq  # the kv-events extra (pyzmq): imported only when events are on

        self.config = config
        self.block_size = block_size
        self.num_dropped = 0
        self._queue: queue.Queue[list[KVEvent] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        if _binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: Any = None  # zmq.Socket (ROUTER)
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        # NOTE: frames between the empty delimiter and [seq, payload] in a replay answer
        self._replay_head = (self._topic,) if config.encoding == "map" else ()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Engine thread: never blocks."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                log.warning("KV events queue full: dropping batches (subscribers will see gaps)")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = encode_batch(events, self.block_size, self.config.encoding, time.time())
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        head = (client, b"", *self._replay_head)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((*head, END_SEQ, b""))


def default_topic(settings: Any, model_name: str) -> str:
    """llm-d's `kv@<host>:<port>@<model>` for the array encoding; "" for the map encoding,
    the only topic vllm-router 0.1.17 accepts from a static --kv-event-source (it drops frames
    whose topic is not its own empty one)."""
    if settings.kv_events_encoding == "map":
        return ""
    return f"kv@{settings.host}:{settings.port}@{model_name}"


def start_kv_events(settings: Any, backend: Any) -> KVEventPublisher | None:
    """The publisher the settings ask for, hooked to the engine; None when KV events are off.
    Raises ValueError on a bad --kv-events-config (the server then refuses to start)."""
    fields = parse_vllm_config(settings.kv_events_config) if settings.kv_events_config else {}
    flags = {
        "endpoint": settings.kv_events_endpoint,
        "topic": settings.kv_events_topic,
        "replay_endpoint": settings.kv_events_replay_endpoint,
    }
    fields.update({k: v for k, v in flags.items() if v is not None})
    if not fields.get("endpoint"):
        return None
    fields.setdefault("topic", default_topic(settings, backend.model_name))
    config = KVEventsConfig(encoding=settings.kv_events_encoding, **fields)
    publisher = KVEventPublisher(config, settings.kv_events_block_size)
    backend.engine.enable_kv_events(settings.kv_events_block_size, publisher.publish)
    log.info("KV events: %s, topic %r, %s encoding", config.endpoint, config.topic, config.encoding)
    return publisher
