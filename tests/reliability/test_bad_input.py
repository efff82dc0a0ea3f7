"""Hand-written bad input: each gets a 4xx in OpenAI's error shape whose message names the
problem, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.reliability.harness import assert_openai_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def post_raw(url: str, path: str, content: bytes) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120.0)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return post_raw(url, path, json.dumps(body).encode())


# (path, body, status, words the message must contain)
JSON_CASES = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "many"}, 400, ["max_tokens"]),
    (COMPLETIONS, {"prompt": 12, "max_tokens": 4}, 400, ["prompt"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**9}, 400, ["max_tokens"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, 400, ["max_tokens"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "n": 10_000}, 400, ["n"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "temperature": -1.0}, 400, ["temperature"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "top_p": 7}, 400, ["top_p"]),
    (COMPLETIONS, {"prompt": [10**7, 5], "max_tokens": 4}, 400, ["token"]),
    (COMPLETIONS, {"prompt": [-1, 5], "max_tokens": 4}, 400, ["token"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 4, "model": "gpt-17"}, 404, ["gpt-17"]),
    (COMPLETIONS, {"max_tokens": 4}, 400, ["prompt"]),
    (CHAT, {"messages": [], "max_tokens": 4}, 400, ["messages"]),
    (CHAT, {"messages": "hello", "max_tokens": 4}, 400, ["messages"]),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, 400, ["wizard"]),
    (CHAT, {"messages": [{"content": "hi"}], "max_tokens": 4}, 400, ["role"]),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, ["nope"]),
    ("/detokenize", {"tokens": [10**7]}, 400, ["token"]),
    ("/tokenize", {"prompt": 5}, 400, ["prompt"]),
]


@pytest.mark.model
@pytest.mark.parametrize(("path", "body", "status", "words"), JSON_CASES)
def test_bad_json_body_is_a_named_4xx(default_server, path, body, status, words):
    assert_openai_error(post(default_server.url, path, body), status, *words)


@pytest.mark.model
@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty"])
def test_nan_and_infinity_are_rejected(default_server, field):
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        content = b'{"prompt": "hi", "max_tokens": 4, "%s": %s}' % (field.encode(), literal)
        assert_openai_error(post_raw(default_server.url, COMPLETIONS, content), 400, field)


@pytest.mark.model
def test_malformed_json_is_a_400(default_server):
    resp = post_raw(default_server.url, COMPLETIONS, b'{"prompt": "hi", "max_tokens": ')
    assert_openai_error(resp, 400, "json")


@pytest.mark.model
def test_invalid_utf8_is_a_400(default_server):
    resp = post_raw(default_server.url, COMPLETIONS, b'{"prompt": "caf\xe9 \xff", "max_tokens": 4}')
    err = assert_openai_error(resp, 400)
    assert any(w in err["message"].lower() for w in ("utf-8", "json", "decode")), err


@pytest.mark.model
def test_ten_megabyte_body_is_a_413(default_server):
    content = json.dumps({"prompt": "a" * (10 * 2**20), "max_tokens": 4}).encode()
    assert_openai_error(post_raw(default_server.url, COMPLETIONS, content), 413, "body")


@pytest.mark.model
def test_ten_megabyte_body_without_content_length_is_a_413(default_server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"a" * 2**20
        yield b'", "max_tokens": 4}'

    resp = httpx.post(
        f"{default_server.url}{COMPLETIONS}",
        content=chunks(),
        headers={"content-type": "application/json"},
        timeout=60.0,
    )
    assert_openai_error(resp, 413, "body")


@pytest.mark.model
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_prompt_of_a_million_characters_is_a_400(default_server, path):
    text = "lorem ipsum " * 83_334
    chat = {"messages": [{"role": "user", "content": text}]}
    body = {"prompt": text} if path == COMPLETIONS else chat
    err = assert_openai_error(post(default_server.url, path, {**body, "max_tokens": 4}), 400)
    assert any(w in err["message"].lower() for w in ("prompt", "context", "tokens")), err


@pytest.mark.model
@pytest.mark.parametrize("interval", ["1", "100000", "soon"])
def test_bad_cell_map_stream_interval_is_a_400(default_server, interval):
    url = f"{default_server.url}/v1/cache/cells/stream?interval_ms={interval}"
    assert_openai_error(httpx.get(url, timeout=30.0), 400, "interval_ms")


@pytest.mark.model
def test_server_still_serves_after_bad_input(default_server):
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    resp = post(default_server.url, COMPLETIONS, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
