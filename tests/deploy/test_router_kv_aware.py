"""Two cellserve replicas (tiny random Llama) publishing KV events in the map encoding, behind
vllm-router's kv_aware policy: every follow-up of a shared system prompt goes to the replica
whose events announced that prefix, so the replicas serve all of the reusable prefix from
cache; round_robin, on the same replicas and a fresh set of prompts, does not. Skips without
the router (pip install vllm-router, the test extra); fails under CELLSERVE_REQUIRE_TOOLS=1."""

from __future__ import annotations

import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from tests.deploy.tooling import free_port, require_tool
from tests.live_server import ServerProcess, start_server_process
from tests.tiny_models import write_tiny_llama

BLOCK = 16
# fmt: off
REPLICA_FLAGS = [
    "--threads", "1", "--n-cells", "16384", "--ctx-per-seq", "512",
    "--n-seq-max", "16",  # running requests plus prefix holders: 5 system prompts stay
]
# fmt: on
TOPICS = ["books", "engines", "gardens", "rivers", "trains"]  # odd: round_robin alternates
QUESTIONS = ["What is new?", "Give me one tip.", "Why?", "Say more."]


@dataclass
class Replica:
    server: ServerProcess
    events: str  # tcp://127.0.0.1:<port>, the PUB socket the router subscribes to


@dataclass(frozen=True)
class Tally:
    num_cached: int  # cached_tokens the replicas reported, follow-ups only
    num_ideal: int  # the longest prompt prefix an earlier request of the same system shared


def _system(topic: str, policy: str) -> str:
    return f"{topic.upper()} ({policy}): you are an expert on {topic}; answer briefly. " * 6


def _chat_body(system: str, question: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_workload(router: str, replica: str, policy: str) -> Tally:
    """Several systems, several questions each, interleaved and sequential (every request's
    events are out before the next is routed). A follow-up's ideal is the prefix it shares
    with an earlier prompt of its system, cut to whole blocks less the last position."""
    seen: dict[str, list[list[int]]] = {}
    num_cached = num_ideal = 0
    for question in QUESTIONS:
        for topic in TOPICS:
            body = _chat_body(_system(topic, policy), question)
            ids = httpx.post(f"{replica}/v1/chat/completions/render", json=body, timeout=30)
            token_ids = ids.json()["token_ids"]
            resp = httpx.post(f"{router}/v1/chat/completions", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            cached = resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            earlier = seen.setdefault(topic, [])
            if earlier:
                shared = max(_common_prefix(token_ids, e) for e in earlier)
                ideal = min(shared, len(token_ids) - 1) // BLOCK * BLOCK
                num_ideal += ideal
                num_cached += min(cached, ideal)
            earlier.append(token_ids)
            time.sleep(0.05)  # the replica's KV event batch reaches the router
    return Tally(num_cached, num_ideal)


@contextmanager
def vllm_router(replicas: list[Replica], policy: str, extra: tuple[str, ...] = ()) -> Iterator[str]:
    router_bin = require_tool("vllm-router")
    port = free_port()
    # fmt: off
    cmd = [
        router_bin, "--host", "127.0.0.1", "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-urls", *[r.server.url for r in replicas], "--policy", policy,
        "--kv-event-block-size", str(BLOCK), "--kv-event-model", "tiny", "--log-level", "warning",
        *extra,
    ]
    # fmt: on
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.server.url}={r.events}"]
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    router = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:  # ready once it answers a request through a replica
            assert proc.poll() is None, "vllm-router exited"
            try:
                body = _chat_body("warm-up", "Hi")
                if httpx.post(f"{router}/v1/chat/completions", json=body).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vllm-router did not route in 30 s"
            time.sleep(0.3)
        yield router
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.seek(0)
        print(log.read().decode(errors="replace")[-2000:])
        log.close()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[Replica]]:
    require_tool("vllm-router")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_llama(f"{tmp}/tiny"))
        ports = [free_port(), free_port()]
        # fmt: off
        flags = [
            [*REPLICA_FLAGS, "--kv-events-endpoint", f"tcp://*:{p}",
             "--kv-events-encoding", "map", "--kv-events-block-size", str(BLOCK)]
            for p in ports
        ]
        # fmt: on
        with ThreadPoolExecutor(2) as pool:  # the two replicas load side by side
            futures = [pool.submit(start_server_process, "--model", model, *f) for f in flags]
            servers = [f.result() for f in futures]
        try:
            yield [Replica(s, f"tcp://127.0.0.1:{p}") for s, p in zip(servers, ports, strict=True)]
        finally:
            for s in servers:
                s.stop()


def test_kv_aware_sends_each_prefix_to_the_replica_that_holds_it(replicas: list[Replica]):
    with vllm_router(replicas, "kv_aware") as router:
        kv_aware = run_workload(router, replicas[0].server.url, "kv_aware")
    with vllm_router(replicas, "round_robin") as router:
        round_robin = run_workload(router, replicas[0].server.url, "round_robin")
    kv_ratio = kv_aware.num_cached / kv_aware.num_ideal
    rr_ratio = round_robin.num_cached / round_robin.num_ideal
    print(f"cached/ideal: kv_aware {kv_aware} {kv_ratio:.1%}")
    print(f"cached/ideal: round_robin {round_robin} {rr_ratio:.1%}")
    # NOTE: measured 100% for kv_aware and 67.6% for round_robin. kv_aware sends every request
    # to the first replica (new prompts tie at 0 credited tokens, loads are equal): with
    # --n-seq-max 8 (running + prefix holders) it dropped one system prompt's holder (LRU) and
    # measured 80.7-82.5%, each miss credited 0 by the router after the BlockRemoved
    assert kv_ratio >= 0.95
    assert rr_ratio < kv_ratio - 0.15  # the same workload without the events loses prefixes
