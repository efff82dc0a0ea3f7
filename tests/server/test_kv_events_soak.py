"""KV events under mixed concurrent load, prefix index over held cells on (tiny random Llama,
a small cache: LRU evictions all the time). The engine is watched at the end of every step,
under its lock: the blocks held then (holders, index nodes and running requests) are
recorded with the number of batches published so far. A ZMQ subscriber decodes vLLM's
array-encoded batches and records its view (stored minus removed) after each. Every step's
record must equal the subscriber's view after that many batches: each block held by the end
of a step went out in that step's batch, and no removal was missed or early.

CELLSERVE_KV_SOAK_S sets the load's duration (default 60 s; the issue's soak is 600, which
needs `--timeout 1400` over the suite's 600 s pytest-timeout)."""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field

import httpx
import msgpack
import pytest
import zmq

from tests.deploy.tooling import free_port
from tests.live_server import LiveServer, start_server
from tests.scheduler.test_kv_blocks_running import cache_blocks, running_blocks
from tests.tiny_models import write_tiny_llama

BLOCK = 8
DURATION_S = float(os.environ.get("CELLSERVE_KV_SOAK_S", "60"))
SYSTEMS = [f"System {k}: you answer questions about topic {k} in one line. " * 3 for k in range(3)]


@dataclass
class StepRecord:
    num_published: int  # batches published when the step ended
    blocks: frozenset[int]  # the blocks of holders, index nodes and running requests then
    num_running_only: int  # of those, held by running requests and by no holder or node


@dataclass
class Watch:
    steps: list[StepRecord] = field(default_factory=list)
    num_published: int = 0


def step_record(engine, num_published: int) -> StepRecord:
    """The blocks of every holder, index node and running request (engine lock held)."""
    cached, running = cache_blocks(engine.scheduler), running_blocks(engine.scheduler)
    return StepRecord(num_published, frozenset(cached | running), len(running - cached))


def watch_engine(engine) -> Watch:
    """Record the cached blocks at the end of every step, after its events were taken."""
    watch = Watch()
    publish, publish_step = engine._publish_kv, engine._publish_kv_events

    def counted(events) -> None:
        watch.num_published += 1
        publish(events)

    def step_end() -> None:
        publish_step()
        record = step_record(engine, watch.num_published)
        if not watch.steps or watch.steps[-1] != record:
            watch.steps.append(record)

    engine._publish_kv = counted
    engine._publish_kv_events = step_end
    return watch


class Subscriber(threading.Thread):
    """Applies vLLM's array-encoded batches; views[k] is stored minus removed after batch k."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)  # this check must see every batch
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.live: set[int] = set()
        self.views: list[frozenset[int]] = []
        self.seqs: list[int] = []
        self.num_stored = self.num_removed = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._read()
        except BaseException as exc:
            self.error = exc
            raise

    def _read(self) -> None:
        while not self.stop.is_set() or self.sock.poll(200):
            if self.sock.poll(50):
                _, seq, payload = self.sock.recv_multipart()
                self.seqs.append(int.from_bytes(seq, "big"))
                self.apply(msgpack.unpackb(payload))
                self.views.append(frozenset(self.live))
        self.sock.close(linger=0)

    def apply(self, batch: list) -> None:
        for event in batch[1]:
            if event[0] == "BlockStored":
                hashes, parent = event[1], event[2]
                assert parent is None or parent in self.live, "a chain starts from a live block"
                assert not self.live & set(hashes), "a live block stored again"
                self.live |= set(hashes)
                self.num_stored += len(hashes)
            elif event[0] == "BlockRemoved":
                assert set(event[1]) <= self.live, "a block removed that was not stored"
                self.live -= set(event[1])
                self.num_removed += len(event[1])
            else:
                self.live.clear()


def client_loop(url: str, seed: int, until: float, tally: dict[str, int]) -> None:
    """NOTE: a connection reset (seen once in a 10-minute run on a loaded 2-core machine,
    cause not found) is counted and the client goes on: the subject here is the KV events."""
    while time.monotonic() < until:
        try:
            _client_loop(url, seed, until, tally)
        except httpx.TransportError:
            tally["transport_error"] += 1
        except BaseException as exc:
            tally[f"error: {exc!r}"[:200]] = 1
            raise
        seed += 1000


def _client_loop(url: str, seed: int, until: float, tally: dict[str, int]) -> None:
    """Shared system prompts, distinct prompts, multi-turn continuations and streams the
    client drops after the first chunk, in random order."""
    rng = random.Random(seed)
    history: list[int] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < until:
            kind = rng.choice(["system", "system", "distinct", "turn", "dropped"])
            max_tokens = rng.randint(1, 8)
            if kind == "system":
                messages = [
                    {"role": "system", "content": rng.choice(SYSTEMS)},
                    {"role": "user", "content": f"Question {rng.randint(0, 999)}?"},
                ]
                body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
                resp = client.post("/v1/chat/completions", json=body)
            else:
                if kind == "turn" and history and len(history) < 80:
                    prompt = history + [rng.randint(5, 200) for _ in range(rng.randint(4, 20))]
                else:
                    prompt = [rng.randint(5, 200) for _ in range(rng.randint(10, 60))]
                body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
                if kind == "dropped":
                    with client.stream("POST", "/v1/completions", json={**body, "stream": True}):
                        pass  # the headers came: the request runs, then its client is gone
                    tally["dropped"] += 1
                    continue
                resp = client.post("/v1/completions", json=body)
                history = prompt
            assert resp.status_code == 200, resp.text
            tally[kind] += 1


@pytest.fixture(scope="module")
def replica():
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_llama(f"{tmp}/tiny"))
        pub = free_port()
        server = start_server(
            model=model,
            threads=1,
            n_cells=384,
            n_seq_max=6,
            ctx_per_seq=128,
            kv_events_endpoint=f"tcp://*:{pub}",
            kv_events_block_size=BLOCK,
        )
        yield server, pub
        server.stop()


def test_every_step_ends_with_the_subscriber_seeing_the_cache(replica: tuple[LiveServer, int]):
    server, pub = replica
    engine = server.app.state.backend.engine
    assert engine.scheduler.seq_ids.radix is not None, "the prefix index is off"
    with engine._cond:
        watch = watch_engine(engine)
    sub = Subscriber(pub)
    sub.start()
    time.sleep(0.5)  # ZMQ's slow joiner: the subscription reaches the PUB socket
    tally = {"system": 0, "distinct": 0, "turn": 0, "dropped": 0, "transport_error": 0}
    until = time.monotonic() + DURATION_S
    clients = [
        threading.Thread(target=client_loop, args=(server.url, k, until, tally), daemon=True)
        for k in range(4)
    ]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=DURATION_S + 180)
        assert not c.is_alive()
    time.sleep(1.0)  # dropped streams finish on the engine
    sub.stop.set()
    sub.join(timeout=30)
    with_running = [s.num_running_only for s in watch.steps if s.num_running_only]
    print(
        f"{DURATION_S:.0f} s: requests {tally}, {len(watch.steps)} distinct step ends, "
        f"{len(sub.views)} batches, blocks stored {sub.num_stored} removed {sub.num_removed}, "
        f"most blocks held {max(len(s.blocks) for s in watch.steps)}, step ends with blocks "
        f"only running requests held {len(with_running)} (most {max(with_running, default=0)}), "
        f"publisher dropped {server.app.state.kv_events.num_dropped}"
    )
    assert not [k for k in tally if k.startswith("error")], tally
    assert sub.error is None, sub.error
    assert server.app.state.kv_events.num_dropped == 0
    assert sub.seqs == list(range(len(sub.seqs))), "a batch was lost on the wire"
    assert len(sub.views) == watch.num_published
    assert sub.num_removed > 0 and max(len(s.blocks) for s in watch.steps) > 0
    assert tally["dropped"] > 0 and tally["turn"] > 0 and tally["system"] > 0
    assert with_running, "no step ended with a running request's own blocks: not checked"
    behind = [
        k
        for k, step in enumerate(watch.steps)
        if step.blocks != (sub.views[step.num_published - 1] if step.num_published else set())
    ]
    if behind:
        step = watch.steps[behind[0]]
        view = sub.views[step.num_published - 1] if step.num_published else frozenset()
        detail = f"cache-only {len(step.blocks - view)}, view-only {len(view - step.blocks)}"
        raise AssertionError(f"{len(behind)} of {len(watch.steps)} step ends; first: {detail}")
