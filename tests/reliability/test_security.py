"""Isolation between concurrent requests, the API key, what is logged, and the limits."""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import uuid

import httpx
import pytest

import server.auth
from server.settings import Settings
from tests.reliability.clients import stream_request
from tests.reliability.harness import (
    REPO_ROOT,
    ServerProcess,
    assert_api_error,
    assert_openai_error,
)

KEY = "sk-test-" + "7" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
PUBLIC = {"/health", "/metrics", "/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"}


def secret_prompt(secret: str) -> str:
    return (
        f"Confidential note. The secret code is {secret}. Never forget it.\n"
        f"Question: what is the secret code?\nAnswer: the secret code is"
    )


@pytest.fixture(scope="module")
def guarded_server():
    """API key on, prompts logged (to prove the log capture sees them), a queue of 2."""
    flags = ["--n-cells", "512", "--n-seq-max", "4", "--ctx-per-seq", "256"]
    flags += ["--api-key", KEY, "--log-prompts", "--max-queue", "2"]
    with ServerProcess(flags) as srv:
        yield srv


@pytest.mark.model
def test_concurrent_secrets_never_cross(default_server):
    secrets = ("QX7-ZEBRA-4821", "MV2-OTTER-9305")

    async def pair(seed: int) -> tuple[str, str]:
        async with httpx.AsyncClient(base_url=default_server.url, timeout=120.0) as client:
            bodies = [
                {"prompt": secret_prompt(s), "max_tokens": 16, "temperature": 0.9, "seed": seed}
                for s in secrets
            ]
            a, b = await asyncio.gather(*(stream_request(client, body) for body in bodies))
        assert a.ok and b.ok, (a, b)
        return a.text, b.text

    async def greedy() -> list[str]:
        async with httpx.AsyncClient(base_url=default_server.url, timeout=120.0) as client:
            bodies = [
                {"prompt": secret_prompt(s), "max_tokens": 12, "temperature": 0} for s in secrets
            ]
            results = await asyncio.gather(*(stream_request(client, body) for body in bodies))
        return [r.text for r in results]

    outputs = [asyncio.run(greedy())] + [list(asyncio.run(pair(seed))) for seed in range(6)]
    for out_a, out_b in outputs:
        for secret in secrets:
            fragments = secret.split("-")
            other = out_b if secret == secrets[0] else out_a
            assert not any(f in other for f in fragments), (secret, other)
    # the prompts do get the model to repeat its own secret: the test could see a leak
    repeated = sum(secrets[0].split("-")[1] in a for a, _ in outputs)
    assert repeated >= 1, outputs


def openapi_routes(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(f"{url}/openapi.json").json()
    return [(m.upper(), p) for p, item in spec["paths"].items() for m in item if "{" not in p]


@pytest.mark.model
def test_api_key_guards_every_endpoint_but_health_and_metrics(guarded_server):
    url = guarded_server.url
    routes = openapi_routes(url)
    guarded = [(m, p) for m, p in routes if p not in PUBLIC]
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/slots"} <= {
        p for _, p in guarded
    }, routes
    for method, path in guarded:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = httpx.request(method, f"{url}{path}", json={}, headers=headers)
            assert_api_error(resp, path, 401, "key")
        # headers only: some routes (the cell map's event stream) never end
        with httpx.stream(method, f"{url}{path}", json={}, headers=AUTH) as resp:
            assert resp.status_code != 401, (method, path)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    body = {"model": None, "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{url}/v1/completions", json=body, headers=AUTH).status_code == 200


@pytest.mark.model
def test_near_miss_keys_are_refused(guarded_server):
    url = f"{guarded_server.url}/v1/models"
    for key in (KEY[:-1], KEY + "7", KEY[:-1] + "8", KEY.upper(), " " + KEY + "x", "x" * 4096):
        resp = httpx.get(url, headers={"Authorization": f"Bearer {key}"})
        assert_openai_error(resp, 401, "key")
    for header in ("Bearer", KEY, f"Basic {KEY}", f"Token {KEY}"):
        assert_openai_error(httpx.get(url, headers={"Authorization": header}), 401, "key")
    assert httpx.get(url, headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_key_comparison_is_constant_time():
    source = inspect.getsource(server.auth)
    assert "compare_digest(" in source
    assert "== expected" not in source and "expected ==" not in source
    assert "get_secret_value() ==" not in source


@pytest.mark.model
def test_protect_metrics_guards_metrics_too():
    flags = ["--n-cells", "256", "--n-seq-max", "2", "--ctx-per-seq", "128"]
    with ServerProcess([*flags, "--api-key", KEY, "--protect-metrics"]) as srv:
        assert_openai_error(httpx.get(f"{srv.url}/metrics"), 401, "key")
        assert httpx.get(f"{srv.url}/metrics", headers=AUTH).status_code == 200
        assert httpx.get(f"{srv.url}/health").status_code == 200


@pytest.mark.model
def test_prompts_are_not_logged_at_the_default_level(default_server, guarded_server):
    def send(srv: ServerProcess, headers: dict[str, str]) -> str:
        marker = f"MARKER-{uuid.uuid4().hex}"
        ok = {"prompt": f"Say {marker} twice.", "max_tokens": 2}
        bad = {"prompt": f"Say {marker}", "max_tokens": 2, "temperature": "hot"}
        chat = {"messages": [{"role": "user", "content": marker}], "max_tokens": 2}
        assert httpx.post(f"{srv.url}/v1/completions", json=ok, headers=headers).is_success
        assert httpx.post(f"{srv.url}/v1/completions", json=bad, headers=headers).status_code == 400
        chat_url = f"{srv.url}/v1/chat/completions"
        assert httpx.post(chat_url, json=chat, headers=headers).is_success
        return marker

    hidden = send(default_server, {})
    shown = send(guarded_server, AUTH)
    assert hidden not in default_server.log()
    assert shown in guarded_server.log()  # --log-prompts: the capture does see prompts


@pytest.mark.model
def test_full_queue_is_a_429_with_retry_after(guarded_server):
    body = {"prompt": "Count slowly:", "max_tokens": 48, "ignore_eos": True}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=guarded_server.url, timeout=120.0) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body, headers=AUTH) for _ in range(16))
            )

    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    for resp in responses:
        if resp.status_code == 429:
            assert_openai_error(resp, 429, "queue")
            assert int(resp.headers["retry-after"]) >= 1


def test_limits_are_settings_with_safe_defaults():
    s = Settings()
    assert 1024 <= s.max_body_bytes <= 16 * 2**20
    assert 1 <= s.max_tokens_limit <= 32768
    assert 1 <= s.max_n <= 16
    assert 1 <= s.max_queue <= 4096
    assert 0 < s.request_timeout <= 3600
    assert 1 <= s.stream_buffer <= s.max_tokens_limit * s.max_n
    assert s.api_key is None and not s.log_prompts
    help_text = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "serve", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flags = ["--max-body-bytes", "--max-tokens-limit", "--max-n", "--max-queue"]
    flags += ["--request-timeout", "--api-key", "--protect-metrics", "--log-prompts"]
    flags += ["--stream-buffer"]
    for flag in flags:
        assert flag in help_text, flag
