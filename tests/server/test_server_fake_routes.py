"""Routes, SSE, errors and metrics against a real uvicorn with a fake engine (no model)."""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import start_server
from tests.server.fake_engine import EOS, REPLY, FakeEngine, FakeTokenizer, fake_backend_factory

KEY = "test-key"


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    server = start_server(fake_backend_factory(engine), api_key=KEY, max_body_bytes=4096)
    yield server, engine
    server.stop()


@pytest.fixture
def url(fake):
    return fake[0].url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def post(url: str, path: str, body, key: str | None = KEY, timeout=30) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=timeout)


def sse_chunks(resp: httpx.Response) -> list:
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_chat_non_streamed_and_streamed_agree(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=200)
    assert full.choices[0].message.content == REPLY
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(REPLY.encode()) + 1  # + EOS
    stream = client.chat.completions.create(
        model="fake-model",
        messages=msgs,
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == REPLY
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_usage_matches_tokenize(url, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    count = post(url, "/tokenize", {"messages": msgs}).json()["count"]
    resp = client.chat.completions.create(model="fake-model", messages=msgs, max_tokens=3)
    assert resp.usage.prompt_tokens == count
    assert resp.choices[0].finish_reason == "length"


def test_stop_string_is_not_emitted_and_aborts(url, client):
    resp = client.completions.create(model="fake-model", prompt="x", max_tokens=100, stop=["Paris"])
    assert resp.choices[0].text == "The capital of France is "
    assert resp.choices[0].finish_reason == "stop"
    stream = post(
        url, "/v1/completions", {"prompt": "x", "max_tokens": 100, "stop": "😀", "stream": True}
    )
    chunks = sse_chunks(stream)
    assert chunks[-1] == "[DONE]"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == "The capital of France is Paris. Ünïcødé "
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_completion_batch_echo_and_token_prompts(client):
    resp = client.completions.create(
        model="fake-model", prompt=["a", "b"], n=2, max_tokens=4, echo=True
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == ["aThe ", "aThe ", "bThe ", "bThe "]
    assert resp.usage.prompt_tokens == 4  # two prompts of BOS + 1 byte, counted once each
    assert resp.usage.completion_tokens == 16
    ids = client.completions.create(model="fake-model", prompt=[[65, 66]], max_tokens=2)
    assert ids.usage.prompt_tokens == 2 and ids.choices[0].text == "Th"


def test_logprobs_shapes(client):
    chat = client.chat.completions.create(
        model="fake-model",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == ["T", "h", "e"]
    assert all(c.logprob <= 0 and len(c.top_logprobs) == 2 for c in content)
    comp = client.completions.create(model="fake-model", prompt="x", max_tokens=3, logprobs=2)
    assert comp.choices[0].logprobs.tokens == ["T", "h", "e"]
    assert comp.choices[0].logprobs.text_offset == [0, 1, 2]


def test_seeded_sampling_repeats(client):
    def sample(seed):
        return (
            client.completions.create(
                model="fake-model", prompt="x", max_tokens=20, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_models_and_detokenize(url):
    models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == "fake-model"
    assert post(url, "/detokenize", {"tokens": [72, 105]}).json() == {"prompt": "Hi"}


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [], "max_tokens": 1}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, "n"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 200}}, "logit_bias"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
        # the engine's admission check (scheduler/intake.check_request), mapped by field
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "min_tokens": 3},
            "min_tokens",
        ),
    ],
)
def test_bad_chat_bodies_are_400(url, body, param):
    assert error_of(post(url, "/v1/chat/completions", body), 400)["param"] == param


def test_nan_temperature_and_bad_json_are_400(url):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = b'{"prompt": "x", "temperature": NaN}'
    err = error_of(httpx.post(f"{url}/v1/completions", content=body, headers=headers), 400)
    assert err["param"] == "temperature"
    error_of(httpx.post(f"{url}/v1/completions", content=b"{not json", headers=headers), 400)


def test_token_ids_outside_vocab_are_400(url):
    err = error_of(post(url, "/v1/completions", {"prompt": [1, 99999]}), 400)
    assert err["param"] == "prompt"


def test_auth(url):
    body = {"prompt": "x", "max_tokens": 1}
    assert (
        error_of(post(url, "/v1/completions", body, key=None), 401)["type"]
        == "authentication_error"
    )
    error_of(post(url, "/v1/completions", body, key="wrong"), 401)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200


def test_unknown_model_and_route_are_404(url):
    err = error_of(post(url, "/v1/completions", {"model": "gpt-9", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found"
    error_of(httpx.get(f"{url}/v1/nothing"), 404)
    error_of(httpx.post(f"{url}/v1/nothing", json={}), 404)  # not a 405 from the static page


def test_body_too_large_is_413(url):
    error_of(post(url, "/v1/completions", {"prompt": "x" * 5000}), 413)

    def chunks():  # no Content-Length: the streamed size is what counts
        for _ in range(10):
            yield b" " * 1000

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    error_of(httpx.post(f"{url}/v1/completions", content=chunks(), headers=headers), 413)


def test_queue_full_is_429_with_retry_after(fake):
    server, engine = fake
    engine.max_running = 0
    try:
        resp = post(server.url, "/v1/completions", {"prompt": "x"})
    finally:
        engine.max_running = 64
    error_of(resp, 429)
    assert resp.headers["Retry-After"] == "1"


def test_disconnect_aborts_the_request(fake):
    server, engine = fake
    engine.token_delay = 0.02
    try:
        body = {"prompt": "x", "max_tokens": 60, "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    break
        slots = []
        for _ in range(100):
            slots = httpx.get(f"{server.url}/slots", headers=headers).json()
            if not slots:
                break
            time.sleep(0.02)
        assert slots == []
    finally:
        engine.token_delay = 0.002


def test_metrics_parse_and_count(url, client):
    def scrape():
        text = httpx.get(f"{url}/metrics").text
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.labels or s.labels.get("finish_reason") == "length"
        }

    before = scrape()
    resp = client.completions.create(model="fake-model", prompt="hello", max_tokens=5)
    after = scrape()
    for name in (
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "cellserve_kv_cells_total",
    ):
        assert name in after
    assert after["cellserve_prompt_tokens_total"] - before["cellserve_prompt_tokens_total"] == (
        resp.usage.prompt_tokens - resp.usage.prompt_tokens_details.cached_tokens
    )
    gen = after["cellserve_generation_tokens_total"] - before["cellserve_generation_tokens_total"]
    assert gen == resp.usage.completion_tokens == 5
    assert after["cellserve_requests_total"] - before.get("cellserve_requests_total", 0) == 1
    assert after["cellserve_time_to_first_token_seconds_count"] > before.get(
        "cellserve_time_to_first_token_seconds_count", 0
    )


def test_default_n_keep_is_the_system_segment(fake, url):
    _, engine = fake
    system = {"role": "system", "content": "You are terse."}
    msgs = [system, {"role": "user", "content": "Hi"}]
    post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})
    request = engine.submitted[-1]
    sys_len = len(FakeTokenizer().encode("<|system|>You are terse.\n"))
    assert request.n_keep == sys_len
    assert request.stop_token_ids == frozenset({EOS})
    post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "n_keep": 3})
    assert engine.submitted[-1].n_keep == 3
    post(url, "/v1/chat/completions", {"messages": msgs[1:], "max_tokens": 1})
    assert engine.submitted[-1].n_keep == 0


def test_prompts_are_not_logged_by_default(url, caplog):
    caplog.set_level(logging.DEBUG)
    secret = "my-secret-prompt-4711"
    post(url, "/v1/completions", {"prompt": secret, "max_tokens": 2})
    post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": secret}]})
    assert caplog.records  # the requests were logged ...
    assert all(secret not in r.getMessage() for r in caplog.records)  # ... without the prompt


def test_non_streamed_client_gone_aborts(fake):
    server, engine = fake
    engine.token_delay = 0.05
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(server.url, "/v1/completions", {"prompt": "x", "max_tokens": 60}, timeout=0.4)
        deadline = time.monotonic() + 5
        while engine.live and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not engine.live
    finally:
        engine.token_delay = 0.002


def test_a_client_closing_after_the_last_event_is_not_an_abort(caplog):
    """sse-starlette calls the close handler when the client hangs up, also after a stream that
    ended: only an unfinished generation is cancelled and logged as an abort."""
    import asyncio
    from types import SimpleNamespace

    from server.deps import on_client_gone

    class Gen:
        def __init__(self, finished: bool) -> None:
            self.finished = finished
            self.requests = [SimpleNamespace(req_id="cmpl-x")]
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    done, running = Gen(finished=True), Gen(finished=False)
    with caplog.at_level(logging.INFO, logger="cellserve.server"):
        asyncio.run(on_client_gone(done)(None))
        assert not done.cancelled and "client gone" not in caplog.text
        asyncio.run(on_client_gone(running)(None))
        assert running.cancelled and "client gone: aborting cmpl-x" in caplog.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_text_with_unicode_line_separators_keeps_each_event_on_one_line(fake, path):
    """U+0085, U+2028 and U+2029 are line ends to str.splitlines and httpx's aiter_lines: sent
    raw inside an event's JSON they cut its data line in two (a reliability test saw it when
    SmolLM2 sampled one). Escaped, every data line parses and the text comes back whole."""
    server, engine = fake
    reply = "one\u2028two\x85three\u2029four"
    engine.reply = reply
    try:
        body = {
            "/v1/completions": {"prompt": "x", "max_tokens": 100},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}]},
            "/v1/responses": {"input": "x", "max_output_tokens": 100},
        }[path]
        body = {**body, "stream": True}
        resp = post(server.url, path, body)
        assert resp.status_code == 200
        events = [e for e in sse_chunks(resp) if e != "[DONE]"]  # json.loads of every data line
        if path == "/v1/completions":
            text = "".join(c["text"] for e in events for c in e["choices"])
        elif path == "/v1/chat/completions":
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        else:
            deltas = [e for e in events if e["type"] == "response.output_text.delta"]
            text = "".join(e["delta"] for e in deltas)
        assert text == reply
    finally:
        engine.reply = REPLY
