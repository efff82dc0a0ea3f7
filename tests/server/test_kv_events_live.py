"""KV events from a real engine (tiny random Llama): a ZMQ subscriber decodes vLLM's
array-encoded EventBatch and its view (stored - removed) equals the blocks the replica holds
(prefix cache and running requests), through inserts, extensions and LRU evictions; a running
request's blocks are announced while it runs and never twice; a late subscriber replays."""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import zmq

from tests.deploy.tooling import free_port
from tests.live_server import start_server
from tests.scheduler.test_kv_blocks_running import held_blocks
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
    """The blocks of the prefix cache and of the running requests now."""
    engine = server.app.state.backend.engine
    with engine._cond:  # the engine thread changes holders under this lock
        return held_blocks(engine.scheduler)


def chain(server, ids: list[int]) -> list[int]:
    return [h for h, _, _ in server.app.state.backend.engine.scheduler.prefix.ledger.chain(ids)]


def num_running(server) -> int:
    engine = server.app.state.backend.engine
    with engine._cond:
        return len(engine.scheduler.running)


class SlowWorker:
    """The real worker, `delay` seconds slower per step: a request stays running long enough
    to be looked at."""

    def __init__(self, worker, delay: float) -> None:
        self._worker, self._delay = worker, delay

    def execute(self, plan):
        time.sleep(self._delay)
        return self._worker.execute(plan)

    def __getattr__(self, name: str):
        return getattr(self._worker, name)


@contextlib.contextmanager
def slow_engine(server, delay: float = 0.05) -> Iterator[None]:
    engine = server.app.state.backend.engine
    with engine._cond:
        engine.worker = SlowWorker(engine.worker, delay)
    try:
        yield
    finally:
        with engine._cond:
            engine.worker = engine.worker._worker


@contextlib.contextmanager
def stream(url: str, ids: list[int], max_tokens: int) -> Iterator[Iterator[str]]:
    """A streamed completion whose first chunk has come; leaving the block early drops it."""
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body["ignore_eos"] = True
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = (line for line in resp.iter_lines() if line.startswith("data: "))
        next(lines)
        yield lines


def wait_running(server, n: int) -> None:
    deadline = time.monotonic() + 10
    while num_running(server) != n:
        assert time.monotonic() < deadline, f"{num_running(server)} running, not {n}"
        time.sleep(0.02)


@contextlib.contextmanager
def frozen(server) -> Iterator[None]:
    """The engine parked at its next step's end, right after publishing (its lock released):
    what the subscriber drains now is every batch up to the state the test then reads."""
    engine = server.app.state.backend.engine
    publish = engine._publish_kv_events
    parked, go = threading.Event(), threading.Event()

    def publish_then_park() -> None:
        publish()
        parked.set()
        while not go.is_set():
            engine._cond.wait(0.02)

    engine._publish_kv_events = publish_then_park
    try:
        assert parked.wait(10), "the engine did not finish a step"
        yield
    finally:
        del engine._publish_kv_events
        go.set()


def clear_cache(server) -> None:
    server.app.state.backend.engine.call(lambda sched, _: sched.clear_prefix_cache())


def fresh_subscriber(server, pub: int) -> Subscriber:
    """A subscriber whose view starts from an empty cache (AllBlocksCleared)."""
    sub = Subscriber(pub)
    time.sleep(0.3)  # ZMQ's slow joiner
    clear_cache(server)
    sub.drain()
    assert sub.live == set()
    return sub


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


def test_a_running_request_is_announced_before_it_finishes_and_never_twice(replica):
    server, pub, _ = replica
    sub = fresh_subscriber(server, pub)
    prompt = list(range(60, 80))  # 20 tokens: 5 blocks
    with slow_engine(server), stream(server.url, prompt, max_tokens=40) as lines:
        with frozen(server):
            sub.drain()
            assert num_running(server) == 1, "the request should still be running"
            assert set(chain(server, prompt)) <= sub.live == holder_blocks(server)
        num_removed = sub.num_removed
        assert list(lines)[-1] == "data: [DONE]"
    wait_running(server, 0)
    sub.drain()  # Subscriber.apply fails on a block stored twice
    assert set(chain(server, prompt)) <= sub.live == holder_blocks(server)
    assert sub.num_removed == num_removed  # the cache took them over: nothing went


def test_a_shared_prefix_is_removed_only_when_both_requests_are_gone(replica):
    server, pub, _ = replica
    sub = fresh_subscriber(server, pub)
    shared = list(range(100, 116))  # 4 blocks
    a, b = [*shared, *range(120, 128)], [*shared, *range(130, 138)]
    with slow_engine(server), stream(server.url, a, max_tokens=60):
        with stream(server.url, b, max_tokens=60), frozen(server):
            counters = server.app.state.backend.engine.scheduler.counters
            assert counters.prefix_running_hit_tokens >= len(shared)  # b took a's, running
            sub.drain()
            assert num_running(server) == 2
            assert {*chain(server, a), *chain(server, b)} <= sub.live == holder_blocks(server)
        wait_running(server, 1)  # b's client left: its context went to the cache
        clear_cache(server)  # drops the cache's holders: a still runs
        with frozen(server):
            sub.drain()
            assert num_running(server) == 1
            assert set(chain(server, b)[4:]).isdisjoint(sub.live)  # b's own blocks went
            assert set(chain(server, shared)) <= sub.live == holder_blocks(server)
    wait_running(server, 0)
    clear_cache(server)
    sub.drain()
    assert sub.live == holder_blocks(server) == set()
