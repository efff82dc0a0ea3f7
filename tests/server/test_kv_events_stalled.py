"""A KV events subscriber that stops reading costs the engine nothing measurable: one replica
process (tiny random Llama, --threads 1, a small cache so every request stores and evicts
blocks) under the same closed-loop load, in alternating phases with no subscriber and with a
subscriber that connected and never reads. The engine thread only puts a batch on a queue;
the PUB socket drops at its high-water mark, it never blocks.

Reported: generated tokens per second of each phase, their ratio, and the replica's resident
memory (what the socket buffers for the stalled subscriber). CELLSERVE_KV_STALL_S sets a
phase's length (default 6 s; 3 rounds)."""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import threading
import time

import httpx
import zmq

from tests.deploy.tooling import free_port
from tests.live_server import ServerProcess, start_server_process
from tests.tiny_models import write_tiny_llama

PHASE_S = float(os.environ.get("CELLSERVE_KV_STALL_S", "6"))
NUM_ROUNDS = 3


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _generated_tokens(url: str, seconds: float, n_clients: int = 3) -> int:
    """Closed-loop distinct prompts for `seconds`: completion tokens generated."""
    until = time.monotonic() + seconds
    totals = [0] * n_clients

    def client(k: int) -> None:
        rng = random.Random(k * 7919 + int(time.monotonic() * 1000))
        with httpx.Client(base_url=url, timeout=60) as http:
            while time.monotonic() < until:
                prompt = [rng.randint(5, 200) for _ in range(rng.randint(30, 60))]
                body = {"prompt": prompt, "max_tokens": 8, "ignore_eos": True}
                resp = http.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                totals[k] += resp.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=seconds + 60)
    return sum(totals)


def test_a_stalled_subscriber_does_not_slow_the_engine():
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_llama(f"{tmp}/tiny"))
        pub = free_port()
        # fmt: off
        replica: ServerProcess = start_server_process(
            "--model", model, "--threads", "1", "--n-cells", "512", "--n-seq-max", "8",
            "--ctx-per-seq", "128", "--kv-events-endpoint", f"tcp://*:{pub}",
            "--kv-events-block-size", "4",
        )
        # fmt: on
        try:
            _generated_tokens(replica.url, 2)  # warm-up
            ratios, rates = [], {"none": [], "stalled": []}
            rss = [_rss_mib(replica.process.pid)]  # MiB after the warm-up, then each phase
            for _ in range(NUM_ROUNDS):
                rates["none"].append(_generated_tokens(replica.url, PHASE_S) / PHASE_S)
                rss.append(_rss_mib(replica.process.pid))
                stalled = zmq.Context.instance().socket(zmq.SUB)
                stalled.setsockopt(zmq.RCVHWM, 1)  # the backpressure reaches the PUB side soon
                stalled.setsockopt(zmq.RCVBUF, 4096)
                stalled.connect(f"tcp://127.0.0.1:{pub}")
                stalled.setsockopt(zmq.SUBSCRIBE, b"")
                time.sleep(0.3)  # subscribed; from now on it never reads
                rates["stalled"].append(_generated_tokens(replica.url, PHASE_S) / PHASE_S)
                rss.append(_rss_mib(replica.process.pid))
                assert stalled.poll(0), "no batch reached the stalled subscriber"
                stalled.close(linger=0)
                ratios.append(rates["stalled"][-1] / rates["none"][-1])
        finally:
            replica.stop()
    ratio = statistics.median(ratios)
    print(
        f"tokens/s no subscriber {[round(r) for r in rates['none']]}, stalled subscriber "
        f"{[round(r) for r in rates['stalled']]}; stalled/none per round "
        f"{[round(r, 3) for r in ratios]}, median {ratio:.3f}; replica RSS (MiB) after the "
        f"warm-up and each phase (none, stalled, ...) {[round(r) for r in rss]}"
    )
    # NOTE: a loose bound, as the phases share a busy machine (rounds measured 0.77 to 1.31
    # beside another test); a send that blocked on the stalled socket would stop the engine
    assert ratio >= 0.7
