"""A tiny OpenAI-compatible streaming server with known behaviour, for the load generator.

Each completion streams `ceil(max_tokens / tokens_per_chunk)` chunks of "tok ", one every
`chunk_delay_s` (the first after one delay), then a usage chunk when asked and supported.
Every `fail_every`-th generation request fails, with HTTP 500 or an in-stream error event.
/tokenize counts whitespace-separated words, so calibrated prompts have exact lengths.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL_ID = "fake-model"
CHUNK_TEXT = "tok "


@dataclass(slots=True)
class FakeOptions:
    chunk_delay_s: float = 0.01
    tokens_per_chunk: int = 1
    fail_every: int = 0  # 0: never fail
    fail_mode: str = "http"  # "http" (500) or "stream" (an error event after one chunk)
    usage: bool = True  # honour stream_options.include_usage
    tokenize: bool = True  # serve POST /tokenize
    bodies: list[dict[str, Any]] = field(default_factory=list)  # every generation request


def _prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


def make_app(opts: FakeOptions) -> FastAPI:
    app = FastAPI()
    n_requests = 0

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]}

    if opts.tokenize:

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            words = (await request.json())["prompt"].split()
            return {"tokens": list(range(len(words))), "count": len(words)}

    async def generate(request: Request, chat: bool) -> Any:
        nonlocal n_requests
        body = await request.json()
        opts.bodies.append(body)
        n_requests += 1
        failing = opts.fail_every > 0 and n_requests % opts.fail_every == 0
        if failing and opts.fail_mode == "http":
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        n_tokens = int(body["max_tokens"])
        n_chunks = math.ceil(n_tokens / opts.tokens_per_chunk)
        want_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str) -> str:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"text": text}
            return f"data: {json.dumps({'choices': [choice]})}\n\n"

        async def stream() -> AsyncIterator[str]:
            if chat:
                yield f"data: {json.dumps({'choices': [{'delta': {'role': 'assistant'}}]})}\n\n"
            for i in range(n_chunks):
                await asyncio.sleep(opts.chunk_delay_s)
                if failing and i == 1:
                    yield f"data: {json.dumps({'error': {'message': 'injected'}})}\n\n"
                    return
                yield chunk(CHUNK_TEXT)
            if want_usage and opts.usage:
                usage = {"prompt_tokens": _prompt_words(body), "completion_tokens": n_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, chat=True)

    return app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve_fake(opts: FakeOptions) -> Iterator[str]:
    """Runs the fake on a free port in a thread; yields its base URL."""
    port = free_port()
    config = uvicorn.Config(make_app(opts), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake OpenAI server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
