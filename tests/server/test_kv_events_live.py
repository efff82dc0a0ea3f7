"""KV events from a real engine (tiny random Llama): a ZMQ subscriber decodes vLLM's
array-encoded EventBatch and its view (stored - removed) equals the replica's prefix-cache
blocks, through inserts, extensions and LRU evictions; a late subscriber replays."""

from __future__ import annotations

import tempfile
import time

import httpx
import msgpack
import pytest
import zmq

from tests.deploy.tooling import free_port
from tests.live_server import start_server
from tests.tiny_models import write_tiny_llama

BLOCK = 4


@pytest.fixture(scope="module")
def replica():
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_llama(f"{tmp}/tiny"))
        pub, replay = free_port(), free_port()
        server = start_server(
            model=model,
            threads=1,
            n_cells=256,
            n_seq_max=4,
            ctx_per_seq=128,
            kv_events_endpoint=f"tcp://*:{pub}",
            kv_events_replay_endpoint=f"tcp://*:{replay}",
            kv_events_block_size=BLOCK,
        )
        yield server, pub, replay
        server.stop()


class Subscriber:
    """Applies vLLM's array-encoded events: [ts, [[tag, ...fields], ...], dp_rank]."""

    def __init__(self, port: int) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.live: set[int] = set()
        self.tokens: dict[int, list[int]] = {}
        self.topics: set[bytes] = set()
        self.seqs: list[int] = []
        self.num_removed = 0

    def apply(self, payload: bytes) -> None:
        ts, events, rank = msgpack.unpackb(payload)
        assert ts > 0 and rank == 0
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, token_ids, block_size, lora_id, medium = event[1:]
                assert block_size == BLOCK and lora_id is None and medium == "GPU"
                assert len(token_ids) == BLOCK * len(hashes)
                assert parent is None or parent in self.live, "a chain starts from a live block"
                assert not self.live & set(hashes)
                for i, h in enumerate(hashes):
                    self.tokens[h] = token_ids[i * BLOCK : (i + 1) * BLOCK]
                self.live |= set(hashes)
            elif tag == "BlockRemoved":
                hashes, medium = event[1:]
                assert set(hashes) <= self.live
                self.live -= set(hashes)
                self.num_removed += len(hashes)
            else:
                assert tag == "AllBlocksCleared"
                self.live.clear()

    def drain(self, quiet: float = 0.3) -> None:
        deadline = time.monotonic() + quiet
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                topic, seq, payload = self.sock.recv_multipart()
                self.topics.add(topic)
                self.seqs.append(int.from_bytes(seq, "big"))
                self.apply(payload)
                deadline = time.monotonic() + quiet


def complete(url: str, ids: list[int]) -> None:
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text


def holder_blocks(server) -> set[int]:
    engine = server.app.state.backend.engine
    with engine._cond:  # the engine thread changes holders under this lock
        prefix, radix = engine.scheduler.prefix, engine.scheduler.seq_ids.radix
        kept = [prefix.tokens(sid) for sid in prefix.seq_ids]
        kept += [radix.path_tokens(n) for n in radix.nodes()] if radix is not None else []
        return {h for tokens in kept for h, _, _ in prefix.ledger.chain(tokens)}


def test_subscriber_view_matches_the_prefix_cache(replica):
    server, pub, replay = replica
    sub = Subscriber(pub)
    time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the PUB socket
    base = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    complete(server.url, base)
    sub.drain()
    assert sub.live == holder_blocks(server) and len(sub.live) == 2  # 10 tokens: 2 blocks
    assert sorted(sub.tokens[h] for h in sub.live) == sorted([base[:4], base[4:8]])
    complete(server.url, [*base, 15, 16, 17, 18, 19, 20])  # extends the cached prompt
    sub.drain()
    assert sub.live == holder_blocks(server) and len(sub.live) == 4
    for k in range(30):  # distinct prompts: 4 seq ids, 256 cells -> LRU leaves are evicted
        complete(server.url, [30 + k, *range(40, 40 + 20 + k % 7)])
        sub.drain(quiet=0.05)
    sub.drain()
    assert sub.num_removed > 0  # evictions were announced
    assert sub.live == holder_blocks(server)
    assert sub.topics == {f"kv@127.0.0.1:{server.settings.port}@tiny".encode()}
    assert sub.seqs == list(range(len(sub.seqs)))  # no gap: nothing was dropped


def test_a_late_subscriber_replays_the_past_batches(replica):
    server, _, replay = replica
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{replay}")
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    late = Subscriber.__new__(Subscriber)
    late.live, late.tokens, late.num_removed = set(), {}, 0
    while True:
        assert sock.poll(5000), "no replay answer"
        _, seq, payload = sock.recv_multipart()
        if seq == (-1).to_bytes(8, "big", signed=True):
            break
        late.apply(payload)
    assert late.live == holder_blocks(server)
