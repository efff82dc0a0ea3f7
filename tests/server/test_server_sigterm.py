"""SIGTERM on a `cellserve serve` process: running streams finish, new requests get 503, exit 0.

The process serves a tiny random Llama (tests.tiny_models) so that it starts in seconds; the drain
does not depend on the model.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.live_server import start_server_process
from tests.tiny_models import write_tiny_llama

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def test_sigterm_drains_running_stream_then_exits_zero(tiny_model):
    server = start_server_process(
        "--model", tiny_model, "--n-cells", "1024", "--ctx-per-seq", "512", "--drain-timeout", "60"
    )
    try:
        first_chunk = threading.Event()
        data: list[str] = []

        def stream() -> None:
            body = {
                "prompt": "Hello world",
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].strip())
                        first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(120)
        server.terminate()
        assert "[DONE]" not in data  # SIGTERM arrived mid-stream

        for path, method in (("/health", "GET"), ("/v1/completions", "POST")):
            try:
                resp = httpx.request(
                    method, f"{server.url}{path}", json={"prompt": "x"}, timeout=10
                )
                assert resp.status_code == 503, resp.text
            except httpx.ConnectError:
                pass  # already exited: refusing is fine too
        reader.join(timeout=120)
        assert data[-1] == "[DONE]"
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS  # the whole answer came
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        server.stop()


def test_drain_grace_keeps_serving_while_health_says_draining(tiny_model):
    """--drain-grace: after SIGTERM /health is 503 at once (a router stops sending), but a request
    that was already on its way is still served until the grace ends; then admission stops."""
    server = start_server_process(
        "--model", tiny_model, "--n-cells", "1024", "--ctx-per-seq", "512", "--drain-grace", "3"
    )
    try:
        body = {"prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        server.terminate()
        t0 = time.monotonic()
        health = 200
        while health == 200 and time.monotonic() < t0 + 2:
            health = httpx.get(f"{server.url}/health", timeout=5).status_code
        assert health == 503
        inside = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert time.monotonic() < t0 + 3, "the check ran past the grace"
        assert inside.status_code == 200, inside.text
        time.sleep(max(0.0, t0 + 3.5 - time.monotonic()))
        try:
            after = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
            assert after.status_code == 503, after.text
        except httpx.TransportError:
            pass  # already exited: refusing is fine too
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        server.stop()
