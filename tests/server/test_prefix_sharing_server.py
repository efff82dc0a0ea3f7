"""Six concurrent chats with the same new ~400-token system prompt, through the real server on
a tiny random Llama: the system prompt is computed once, whatever the order in which they
reach the engine (scheduler/sharing.py), and /metrics and the usage say so."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import start_server
from tests.tiny_models import write_tiny_llama

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world"]
QUESTIONS = ["Hello?", "How are you?", "Why a fox?", "1 + 2 = ?", "What is a dog?", "Today?"]


def scrape(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out[s.name] = s.value
    return out


def common_prefix(token_lists: list[list[int]]) -> int:
    n = 0
    while all(len(t) > n and t[n] == token_lists[0][n] for t in token_lists):
        n += 1
    return n


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    # n_batch 128: the system prompt takes several steps, so requests that reach the engine
    # while it is computed wait for it
    live = start_server(model=str(folder), n_cells=4096, n_seq_max=8, n_batch=128)
    yield live
    live.stop()


def system_prompt(url: str, n_tokens: int) -> str:
    words: list[str] = []
    while True:
        words += [WORDS[(len(words) * 7) % len(WORDS)], str(len(words))]
        text = " ".join(words)
        count = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["count"]
        if count >= n_tokens:
            return text


def test_six_concurrent_requests_compute_a_new_system_prompt_once(server) -> None:  # noqa: ANN001
    url = server.url
    system = system_prompt(url, 400)
    chats = [
        [{"role": "system", "content": system}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    prompts = [httpx.post(f"{url}/tokenize", json={"messages": m}).json()["tokens"] for m in chats]
    n_shared = common_prefix(prompts)
    assert n_shared >= 400

    async def one(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> dict:
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        resp = await client.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    async def burst() -> list[dict]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, m) for m in chats))

    before = scrape(url)
    usages = asyncio.run(burst())
    after = scrape(url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}

    cached = sorted(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached[0] < n_shared <= cached[1]  # one computed it; five took it
    total = sum(u["prompt_tokens"] for u in usages)
    assert [u["prompt_tokens"] for u in usages] == [len(p) for p in prompts]
    computed = delta["cellserve_prompt_tokens_total"]
    assert computed == total - sum(cached)
    assert computed <= total - 5 * n_shared  # the shared prompt was computed once
    assert delta["cellserve_prefix_cache_hit_tokens_total"] == sum(cached)
    # taken from a running sequence (the first, still generating), not only from finished ones
    running = delta["cellserve_prefix_cache_running_hit_tokens_total"]
    assert n_shared <= running <= sum(cached)
    print(f"burst: {total} prompt tokens, {computed:.0f} computed, {n_shared} shared")
