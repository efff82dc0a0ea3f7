"""The real SmolLM2 behind a real uvicorn, driven by the official openai client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture
def model(client):
    return client.models.list().data[0].id


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()))
            out[key] = s.value
    return out


def wait_idle(url: str, timeout: float = 20.0) -> dict[str, float]:
    """Poll until no live sequence is left; -> the metrics at that moment."""
    deadline = time.monotonic() + timeout
    while True:
        slots = httpx.get(f"{url}/slots").json()
        metrics = scrape(url)
        if not slots and metrics["cellserve_requests_running"] == 0:
            return metrics
        assert time.monotonic() < deadline, f"still live: {slots}"
        time.sleep(0.05)


def test_chat_answers_paris_streamed_equals_plain(client, model, live_server):
    # the same cache state for both compared requests: see test_completions_streamed_equals_plain
    client.chat.completions.create(model=model, messages=FRANCE, temperature=0, max_tokens=1)
    plain = client.chat.completions.create(
        model=model, messages=FRANCE, temperature=0, max_tokens=24
    )
    text = plain.choices[0].message.content
    assert "Paris" in text
    count = httpx.post(f"{live_server.url}/tokenize", json={"messages": FRANCE}).json()["count"]
    assert plain.usage.prompt_tokens == count
    assert plain.usage.total_tokens == count + plain.usage.completion_tokens
    stream = client.chat.completions.create(
        model=model,
        messages=FRANCE,
        temperature=0,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_completions_streamed_equals_plain(client, model):
    args = {"model": model, "prompt": "The three primary colors are", "temperature": 0}
    # NOTE: the first request fills the prefix cache; the two compared below both re-read it
    # (their last prompt token computed alone). With quantized weights (the server default
    # for a quantized GGUF) a 1-row step and a many-row step take different kernels, so only
    # requests that see the same cache state are bit-for-bit comparable.
    client.completions.create(**args, max_tokens=1)
    plain = client.completions.create(**args, max_tokens=20)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**args, max_tokens=20, stream=True)
    )
    assert streamed == plain.choices[0].text
    assert plain.usage.completion_tokens == 20 and plain.choices[0].finish_reason == "length"


def test_n_choices_and_seeded_sampling(client, model):
    args = {"model": model, "messages": FRANCE, "max_tokens": 8, "temperature": 1.0, "seed": 1234}
    first = client.chat.completions.create(**args, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2]
    again = client.chat.completions.create(**args, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    other = client.chat.completions.create(**{**args, "seed": 99}, n=3)
    assert [c.message.content for c in other.choices] != [c.message.content for c in first.choices]


def test_stop_string_ends_the_text(client, model):
    args = {"model": model, "prompt": "One, two, three, four, five,", "temperature": 0}
    full = client.completions.create(**args, max_tokens=24).choices[0].text
    stop = full.strip().split()[2]  # a word from the middle of the greedy text
    cut = client.completions.create(**args, max_tokens=24, stop=[stop, "zzzz"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    assert stop not in cut.text
    streamed = client.completions.create(**args, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_logprobs_are_sensible(client, model):
    resp = client.chat.completions.create(
        model=model, messages=FRANCE, temperature=0, max_tokens=8, logprobs=True, top_logprobs=5
    )
    content = resp.choices[0].logprobs.content
    assert len(content) >= 1
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for entry in content:
        tops = [t.logprob for t in entry.top_logprobs]
        assert entry.logprob <= 0 and len(tops) == 5
        assert tops == sorted(tops, reverse=True)
        assert entry.token in [t.token for t in entry.top_logprobs]
        assert entry.logprob == pytest.approx(max(tops), abs=1e-4)  # greedy: the top token
    comp = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, logprobs=3, temperature=0
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    # vLLM's return_tokens_as_token_ids: the same tokens, named by id
    by_id = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=4,
        logprobs=3,
        temperature=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    ids = by_id.choices[0].logprobs.tokens
    assert (
        all(t.startswith("token_id:") for t in ids)
        and by_id.choices[0].text == comp.choices[0].text
    )
    decoded = httpx.post(
        f"{client.base_url}".removesuffix("/v1/") + "/detokenize",
        json={"tokens": [int(t.split(":")[1]) for t in ids]},
    ).json()
    assert decoded["prompt"] == comp.choices[0].text
    chat = client.chat.completions.create(
        model=model,
        messages=FRANCE,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)


def test_sixteen_concurrent_streams_then_cells_back(live_server, model):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
            max_tokens=12,
            temperature=0,
            stream=True,
        )
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    results = asyncio.run(run())
    assert all(text and reason in ("stop", "length") for text, reason in results)
    metrics = wait_idle(live_server.url)
    assert metrics["cellserve_kv_cells_used"] == metrics["cellserve_kv_cells_cached"]


def test_client_disconnect_aborts_and_frees_cells(live_server, model):
    before = scrape(live_server.url)
    body = {
        "model": model,
        "prompt": "Write a long story about a dragon.",
        "max_tokens": 400,
        "ignore_eos": True,  # only the disconnect can end it early
        "stream": True,
    }
    with httpx.stream("POST", f"{live_server.url}/v1/completions", json=body, timeout=60) as resp:
        chunks = 0
        for line in resp.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 3:
                break
    after = wait_idle(live_server.url, timeout=10)
    assert after["cellserve_kv_cells_used"] == after["cellserve_kv_cells_cached"]
    generated = (
        after["cellserve_generation_tokens_total"] - before["cellserve_generation_tokens_total"]
    )
    assert generated < 400  # aborted long before max_tokens
    abort = "cellserve_requests_total{finish_reason=abort}"
    assert after[abort] - before.get(abort, 0.0) == 1


def test_metrics_counters_move_by_usage(live_server, client, model):
    wait_idle(live_server.url)
    before = scrape(live_server.url)
    resp = client.completions.create(
        model=model,
        prompt="A fact about the moon: it",
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = wait_idle(live_server.url)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    cached = resp.usage.prompt_tokens_details.cached_tokens
    assert delta["cellserve_prompt_tokens_total"] == resp.usage.prompt_tokens - cached
    assert delta["cellserve_generation_tokens_total"] == resp.usage.completion_tokens == 7
    assert delta["cellserve_requests_total{finish_reason=length}"] == 1
    assert delta["cellserve_e2e_request_latency_seconds_count"] == 1
    assert after["vllm:num_requests_waiting"] == 0
    assert after["vllm:gpu_cache_usage_perc"] == after["cellserve_kv_cache_usage_ratio"]
    assert after["cellserve_kv_cells_total"] == live_server.settings.n_cells
    mem = {k.split("=")[1][:-1]: v for k, v in after.items() if k.startswith("cellserve_memory")}
    assert mem["kv_cache"] > 0 and mem["weights_mapped"] + mem["weights_owned"] > 10e6
    # the cache's pages are mapped in as cells are written: after a request some are resident
    assert 0 < mem["kv_cache_resident"] <= mem["kv_cache"]
    assert mem["state_slots"] == mem["state_slots_resident"] == 0
    assert 0 < mem["weights_owned"] + mem["kv_cache_resident"] + mem["other"] <= mem["rss"]


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def test_real_errors(live_server, model):
    url = live_server.url
    long_prompt = "hello " * 600  # > ctx_per_seq = 512 tokens
    err = error_of(
        httpx.post(f"{url}/v1/completions", json={"prompt": long_prompt, "context_shift": False}),
        400,
    )
    assert err["code"] == "context_length_exceeded"
    # context shift on: past the context is fine, past the whole cache is not
    ok = httpx.post(
        f"{url}/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}, timeout=120
    )
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] > 512
    huge = "hello " * (live_server.settings.n_cells + 100)
    err = error_of(httpx.post(f"{url}/v1/completions", json={"prompt": huge}), 400)
    assert err["code"] == "context_length_exceeded" and "KV cache" in err["message"]
    err = error_of(httpx.post(f"{url}/v1/completions", json={"prompt": [1, 10**7]}), 400)
    assert err["param"] == "prompt"
    error_of(httpx.post(f"{url}/v1/chat/completions", json={"messages": []}), 400)
    error_of(
        httpx.post(f"{url}/v1/chat/completions", json={"model": "nope", "messages": FRANCE}), 404
    )
    error_of(httpx.post(f"{url}/v1/completions", json={"prompt": "x", "temperature": -1}), 400)


def test_tokenize_detokenize_round_trip(live_server):
    url = live_server.url
    tok = httpx.post(f"{url}/tokenize", json={"prompt": "Hello, wörld!"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    text = httpx.post(f"{url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("Hello, wörld!")


def test_sse_wire_format(live_server, model):
    body = {"model": model, "messages": FRANCE, "max_tokens": 3, "stream": True}
    resp = httpx.post(f"{live_server.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.headers["content-type"].startswith("text/event-stream")
    data = [line[5:].strip() for line in resp.text.splitlines() if line.startswith("data:")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
