"""SIGTERM on a `cellserve serve` process: running streams finish, new requests get 503, exit 0."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.live_server import start_server_process

pytestmark = pytest.mark.model


def test_sigterm_drains_running_stream_then_exits_zero():
    server = start_server_process(
        "--n-cells", "1024", "--ctx-per-seq", "256", "--drain-timeout", "60", "--log-level", "info"
    )
    try:
        first_chunk = threading.Event()
        data: list[str] = []

        def stream() -> None:
            body = {
                "prompt": "Once upon a time",
                "max_tokens": 30,
                "stream": True,
                "ignore_eos": True,
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
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert len([c for c in chunks if c["choices"][0]["text"]]) >= 20  # the whole answer came
        assert server.process.wait(timeout=60) == 0, server.output()
    finally:
        server.stop()
