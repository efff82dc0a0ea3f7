"""Streaming clients for the reliability tests: well-behaved, disconnecting, and stalled."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass

import httpx


@dataclass
class StreamResult:
    status: int
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    saw_done: bool = False
    num_chunks: int = 0
    disconnected: bool = False
    body: str = ""  # the JSON error body of a non-200 answer

    @property
    def ok(self) -> bool:
        return (
            self.status == 200
            and self.saw_done
            and self.error is None
            and self.finish_reason in ("stop", "length")
        )


def _delta_text(choice: dict) -> str:
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def stream_request(
    client: httpx.AsyncClient,
    body: dict,
    *,
    path: str = "/v1/completions",
    disconnect_after: int | None = None,
    headers: dict[str, str] | None = None,
) -> StreamResult:
    """POST a streaming request and read its SSE events; with `disconnect_after`, close the
    connection after that many data events (0: right after the headers)."""
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as r:
        result = StreamResult(status=r.status_code)
        if r.status_code != 200:
            result.body = (await r.aread()).decode(errors="replace")
            return result
        if disconnect_after == 0:
            result.disconnected = True
            return result
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result.saw_done = True
                break
            event = json.loads(data)
            result.num_chunks += 1
            if "error" in event:
                result.error = event["error"]
                continue
            for choice in event.get("choices", []):
                result.text += _delta_text(choice)
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            if disconnect_after is not None and result.num_chunks >= disconnect_after:
                result.disconnected = True
                return result
    return result


async def complete(client: httpx.AsyncClient, body: dict, path: str = "/v1/completions") -> dict:
    """A non-streaming request; raises on a non-200 answer."""
    resp = await client.post(path, json={**body, "stream": False})
    if resp.status_code != 200:
        raise AssertionError(f"{resp.status_code}: {resp.text[:500]}")
    return resp.json()


async def run_alone(url: str, bodies: list[dict]) -> list[str]:
    """Each body streamed on its own, one after the other: the reference outputs."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        for body in bodies:
            res = await stream_request(client, body)
            assert res.ok, res
            out.append(res.text)
    return out


async def run_concurrently(
    url: str,
    bodies: list[dict],
    num_clients: int,
    disconnect_at: list[int | None] | None = None,
) -> list[StreamResult]:
    """`num_clients` workers take bodies from a shared queue; results in body order."""
    results: list[StreamResult | None] = [None] * len(bodies)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=num_clients, max_keepalive_connections=num_clients)

    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                cut = disconnect_at[i] if disconnect_at else None
                results[i] = await stream_request(client, bodies[i], disconnect_after=cut)

        await asyncio.gather(*(worker() for _ in range(num_clients)))
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def mixed_bodies(
    corpus_ids: list[int],
    num_requests: int,
    num_distinct: int,
    seed: int,
    prompt_len: tuple[int, int] = (8, 64),
    max_tokens: tuple[int, int] = (4, 24),
) -> tuple[list[dict], list[int]]:
    """`num_distinct` greedy completion bodies (token-id prompts cut from `corpus_ids`), and
    for each of `num_requests` requests the index of its body (each body used at least once)."""
    rng = random.Random(seed)
    bodies = []
    for _ in range(num_distinct):
        n = rng.randint(*prompt_len)
        start = rng.randrange(0, len(corpus_ids) - n)
        bodies.append(
            {
                "prompt": corpus_ids[start : start + n],
                "max_tokens": rng.randint(*max_tokens),
                "temperature": 0.0,
                "ignore_eos": True,
            }
        )
    order = list(range(num_distinct)) + [
        rng.randrange(num_distinct) for _ in range(num_requests - num_distinct)
    ]
    rng.shuffle(order)
    return bodies, order
