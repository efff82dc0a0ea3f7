"""Honesty at the edges, against a real uvicorn over the fake engine: finish_reason is always an
OpenAI value, CORS preflight, unsupported fields are refused by name (accepted no-ops are not),
and tokenizing never blocks the event loop."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from scheduler.request import FinishEvent, Request, TokenEvent
from server.backend import Backend
from tests.live_server import start_server
from tests.server.fake_engine import FakeEngine, FakeTemplate, FakeTokenizer, fake_backend_factory

OPENAI_REASONS = {"stop", "length", "tool_calls", "content_filter", "function_call"}
MODEL = "fake-model"
CHAT = [{"role": "user", "content": "hi"}]


class AbortingEngine(FakeEngine):
    """Ends every request with the engine's internal "abort" (as a shutdown past the drain
    timeout does), after two tokens."""

    def submit(self, request: Request) -> AsyncIterator[TokenEvent | FinishEvent]:
        async def events() -> AsyncIterator[TokenEvent | FinishEvent]:
            yield TokenEvent(0, ord("o"))
            yield TokenEvent(0, ord("k"))
            yield FinishEvent(0, "abort", len(request.prompt_ids), 0, 2)

        return events()


@pytest.fixture(scope="module")
def url():
    server = start_server(fake_backend_factory(), cors_allow_origins="http://app.example")
    yield server.url
    server.stop()


def sse_events(resp: httpx.Response) -> list:
    lines = [x[5:].strip() for x in resp.text.splitlines() if x.startswith("data:")]
    return [x if x == "[DONE]" else json.loads(x) for x in lines]


def test_finish_reasons_are_openai_values(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    for max_tokens in (3, 500):
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=max_tokens)
        comp = client.completions.create(model=MODEL, prompt="x", max_tokens=max_tokens, n=2)
        reasons = {chat.choices[0].finish_reason, *(c.finish_reason for c in comp.choices)}
        assert reasons <= OPENAI_REASONS and reasons == (
            {"length"} if max_tokens == 3 else {"stop"}
        )


def test_an_aborted_request_ends_with_an_error_not_a_finish_reason(server_factory):
    server = server_factory(fake_backend_factory(AbortingEngine()))
    plain = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT})
    assert plain.status_code == 503, plain.text
    assert plain.json()["error"]["code"] == "aborted"
    body = {"messages": CHAT, "stream": True}
    events = sse_events(httpx.post(f"{server.url}/v1/chat/completions", json=body))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "aborted"
    chunks = [e for e in events[:-2] if "choices" in e]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ok"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)


def test_cors_preflight_allows_the_configured_origin_only(url):
    def preflight(origin: str) -> httpx.Response:
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        return httpx.options(f"{url}/v1/chat/completions", headers=headers)

    ok = preflight("http://app.example")
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    bad = preflight("http://evil.example")
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    resp = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers={"Origin": "http://app.example"},
    )
    assert resp.headers["access-control-allow-origin"] == "http://app.example"


def test_no_cors_headers_by_default(server_factory):
    server = server_factory(fake_backend_factory())
    headers = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers=headers)
    assert "access-control-allow-origin" not in pre.headers
    resp = httpx.get(f"{server.url}/health", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in resp.headers


def test_cors_preflight_needs_no_api_key(server_factory):
    server = server_factory(fake_backend_factory(), api_key="k", cors_allow_origins="*")
    headers = {"Origin": "http://a.example", "Access-Control-Request-Method": "POST"}
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers=headers)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    denied = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": CHAT})
    assert denied.status_code == 401


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
REFUSED = [
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"web_search_options": {}}, None),  # {} asks for nothing
    ("/v1/chat/completions", {"web_search_options": {"search_context_size": "low"}}, "w"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"logits_processors": ["m.P"]}, "logits_processors"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED)
def test_fields_that_would_change_the_output_are_refused_by_name(url, path, extra, param):
    base = {"messages": CHAT} if "chat" in path else {"prompt": "x"}
    resp = httpx.post(f"{url}{path}", json={**base, "max_tokens": 2, **extra})
    if param is None:
        assert resp.status_code == 200, resp.text
        return
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    name = next(iter(extra))
    assert err["param"] == name and name in err["message"]
    assert err["code"] == "unsupported_parameter"


def test_images_in_message_content_are_refused(url):
    content = [{"type": "text", "text": "what is this?"}, IMAGE]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    for path in ("/v1/chat/completions", "/tokenize"):
        resp = httpx.post(f"{url}{path}", json=body)
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["param"] == "messages.0.content.1.type" and "image_url" in err["message"]
    text_parts = {"messages": [{"role": "user", "content": content[:1]}], "max_tokens": 2}
    assert httpx.post(f"{url}/v1/chat/completions", json=text_parts).status_code == 200


def test_fields_that_do_not_change_the_output_are_accepted(url):
    noops = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "modalities": ["text"],
        "best_of": 1,
    }
    chat = {k: v for k, v in noops.items() if k != "best_of"}
    resp = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, **chat})
    assert resp.status_code == 200, resp.text
    comp = {k: v for k, v in noops.items() if k != "modalities"}
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, **comp})
    assert resp.status_code == 200, resp.text


class BlockingTokenizer(FakeTokenizer):
    """encode() of text holding "SLOW" blocks its thread until `release` is set."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if "SLOW" in text:
            self.entered.set()
            self.release.wait(30)
        return super().encode(text, add_special, parse_special)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW"}]}),
        ("/v1/completions", {"prompt": "SLOW"}),
        ("/tokenize", {"prompt": "SLOW"}),
    ],
)
def test_tokenizing_does_not_block_the_event_loop(server_factory, path, body):
    tok = BlockingTokenizer()

    def factory(settings, on_step) -> Backend:
        return Backend(FakeEngine(), tok, FakeTemplate(), "m", 512, 4096, 0)

    server = server_factory(factory)
    result: list[httpx.Response] = []
    slow = threading.Thread(
        target=lambda: result.append(httpx.post(f"{server.url}{path}", json=body, timeout=60))
    )
    slow.start()
    try:
        assert tok.entered.wait(10)
        # the loop serves others while a tokenization is under way (it would hang otherwise)
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert not tok.release.is_set() and slow.is_alive()
    finally:
        tok.release.set()
        slow.join(60)
    assert result and result[0].status_code == 200, result


def test_a_vanishing_repetition_penalty_is_a_400_not_a_nan(url):
    body = {"prompt": "x", "max_tokens": 2, "repetition_penalty": 5e-324}
    resp = httpx.post(f"{url}/v1/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "repetition_penalty"
