"""vllm-router replays a gap from cellserve's replay socket (map encoding): replica B's events
reach the router through a relay that drops one batch, the one announcing a prefix only B
holds; the next batch shows the router the gap, it asks B's --kv-events-replay-endpoint, and
its first request with that prefix goes to B. Without the replay both replicas score 0 and
the router picks the first, A. Skips without vllm-router."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import zmq

from tests.deploy.test_router_kv_aware import BLOCK, REPLICA_FLAGS, Replica, _chat_body, vllm_router
from tests.deploy.tooling import free_port, require_tool
from tests.live_server import start_server_process
from tests.tiny_models import write_tiny_llama


class LossyRelay:
    """A PUB endpoint that forwards `source`'s frames but drops one on demand."""

    def __init__(self, source: str) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.drop_next = threading.Event()
        self.dropped = threading.Event()
        self._source = source
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._forward, daemon=True)

    def __enter__(self) -> LossyRelay:
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _forward(self) -> None:  # NOTE: the sockets live and die in this thread
        ctx = zmq.Context.instance()
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        sub.connect(self._source)
        sub.subscribe(b"")
        pub.bind(self.endpoint)
        self._ready.set()
        while not self._stop.is_set():
            if not sub.poll(50):
                continue
            frames = sub.recv_multipart()
            if self.drop_next.is_set():
                self.drop_next.clear()
                self.dropped.set()
            else:
                pub.send_multipart(frames)
        sub.close(linger=0)
        pub.close(linger=0)


@contextmanager
def two_replicas(tmp: str) -> Iterator[tuple[Replica, Replica, str]]:
    """A and B in the map encoding; B also binds a replay socket (its endpoint is returned)."""
    model = str(write_tiny_llama(f"{tmp}/tiny"))
    pub_a, pub_b, replay_b = free_port(), free_port(), free_port()
    flags = [*REPLICA_FLAGS, "--kv-events-encoding", "map", "--kv-events-block-size", str(BLOCK)]
    a = start_server_process("--model", model, *flags, "--kv-events-endpoint", f"tcp://*:{pub_a}")
    try:
        b = start_server_process(
            "--model", model, *flags, "--kv-events-endpoint", f"tcp://*:{pub_b}",
            "--kv-events-replay-endpoint", f"tcp://*:{replay_b}",
        )  # fmt: skip
        try:
            yield (
                Replica(a, f"tcp://127.0.0.1:{pub_a}"),
                Replica(b, f"tcp://127.0.0.1:{pub_b}"),
                f"tcp://127.0.0.1:{replay_b}",
            )
        finally:
            b.stop()
    finally:
        a.stop()


def _post(url: str, system: str, question: str) -> int:
    """cached_tokens of one chat request."""
    resp = httpx.post(f"{url}/v1/chat/completions", json=_chat_body(system, question), timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_the_router_replays_a_dropped_batch_from_cellserve():
    require_tool("vllm-router")
    private = "PRIVATE: a system prompt only replica B has seen; answer briefly. " * 6
    with (
        tempfile.TemporaryDirectory() as tmp,
        two_replicas(tmp) as (a, b, replay_b),
        LossyRelay(b.events) as relay,
    ):
        b_relayed = Replica(b.server, relay.endpoint)
        extra = ("--kv-event-replay-source", f"{b.server.url}={replay_b}")
        with vllm_router([a, b_relayed], "kv_aware", extra) as router:
            _post(b.server.url, "B's first system prompt, seen live. " * 3, "Hi")
            time.sleep(0.2)  # the router has B's sequence number
            relay.drop_next.set()
            _post(b.server.url, private, "Why?")
            assert relay.dropped.wait(5), "B published no batch for the private prompt"
            _post(b.server.url, "B's next system prompt: the gap shows. " * 3, "Hi")
            time.sleep(0.5)  # the router replays the gap
            cached = _post(router, private, "Say more.")
    # NOTE: 352 of 364 prompt tokens measured; 0 (routed to A) when the answer lacked the
    # topic frame vllm-router reads (server/kv_events.py)
    assert cached >= 10 * BLOCK
