"""What routers ask a replica: SGLang's server/model info, the router's "no model" sentinel,
and vLLM's render endpoints (the ids generation would submit, nothing run)."""

from __future__ import annotations

import httpx
import pytest

from tests.live_server import start_server
from tests.server.fake_engine import BOS, EOS, FakeEngine, fake_backend_factory

KEY = "k"
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    server = start_server(
        fake_backend_factory(engine), api_key=KEY, served_model_name="tiny", n_seq_max=7
    )
    yield server, engine
    server.stop()


def get(url: str, path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{url}{path}", headers=headers, timeout=10)


def post(url: str, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers=HEADERS, timeout=30)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_names_the_model_and_its_limits(fake, path):
    server, _ = fake
    info = get(server.url, path).json()
    assert info["served_model_name"] == "tiny"
    assert info["model_path"] == "tiny"  # no --model: the served name
    assert info["max_total_tokens"] == 4096  # the fake backend's cells
    assert info["max_running_requests"] == 7
    assert info["context_length"] == server.settings.ctx_per_seq


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_is_a_generation_model(fake, path):
    info = get(fake[0].url, path).json()
    assert info == {
        "model_path": "tiny",
        "tokenizer_path": "tiny",
        "served_model_name": "tiny",
        "is_generation": True,
    }


def test_discovery_needs_the_api_key(fake):
    assert get(fake[0].url, "/server_info", key=None).status_code == 401


def test_the_sglang_router_sentinel_means_no_model(fake):
    url = fake[0].url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(url, "/v1/chat/completions", {**body, "model": "unknown"}).status_code == 200
    wrong = post(url, "/v1/chat/completions", {**body, "model": "other"})
    assert wrong.status_code == 404
    assert wrong.json()["error"]["code"] == "model_not_found"


def test_chat_render_returns_what_generation_submits(fake):
    url, engine = fake[0].url, fake[1]
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "temperature": 0.5,
        "top_k": 3,
        "seed": 11,
        "stop": ["\n"],
    }
    before = len(engine.submitted)
    rendered = post(url, "/v1/chat/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    assert len(engine.submitted) == before  # nothing ran
    out = rendered.json()
    text = "<|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert out["token_ids"] == [BOS, *text.encode()]
    assert out["model"] == "tiny" and out["features"] is None
    sp = out["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["top_k"], sp["seed"]) == (5, 0.5, 3, 11)
    assert sp["stop"] == ["\n"] and sp["stop_token_ids"] == [EOS] and sp["n"] == 1

    assert post(url, "/v1/chat/completions", body).status_code == 200
    assert engine.submitted[-1].prompt_ids == out["token_ids"]


def test_completion_render_returns_one_request_per_prompt(fake):
    url, engine = fake[0].url, fake[1]
    body = {"prompt": [[7, 8], [5, 6, 7]], "max_tokens": 4, "logprobs": 2}
    rendered = post(url, "/v1/completions/render", body)
    assert rendered.status_code == 200, rendered.text
    out = rendered.json()
    assert [r["token_ids"] for r in out] == [[7, 8], [5, 6, 7]]
    assert all(r["sampling_params"]["logprobs"] == 2 for r in out)
    assert len({r["request_id"] for r in out}) == 2
    assert post(url, "/v1/completions", body).status_code == 200
    assert post(url, "/v1/completions/render", {"prompt": "ab"}).json()[0]["token_ids"] == [
        BOS,
        ord("a"),
        ord("b"),
    ]
    assert [r.prompt_ids for r in engine.submitted[-2:]] == [r["token_ids"] for r in out]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions/render", {"prompt": [1, 999]}, "prompt"),
        ("/v1/completions/render", {"prompt": "x", "model": "other"}, "model"),
        ("/v1/chat/completions/render", {"messages": []}, "messages"),
        ("/v1/chat/completions/render", {"messages": [{"role": "x", "content": "y"}]}, None),
        # the engine's admission rule, asked by make_request too (render submits nothing)
        ("/v1/completions/render", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ],
)
def test_render_rejects_what_generation_rejects(fake, path, body, param):
    url = fake[0].url
    gen_path = path.removesuffix("/render")
    rendered, generated = post(url, path, body), post(url, gen_path, body)
    assert rendered.status_code == generated.status_code
    assert rendered.status_code in (400, 404)
    assert rendered.json()["error"]["message"] == generated.json()["error"]["message"]
    if param is not None:
        assert rendered.json()["error"]["param"] == param


def test_cache_config_info_gives_virtual_blocks_over_cells(fake):
    from prometheus_client.parser import text_string_to_metric_families

    text = get(fake[0].url, "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1.0
    assert sample.labels["block_size"] == "16"  # the default --kv-events-block-size
    assert sample.labels["num_gpu_blocks"] == str(4096 // 16)
    assert sample.labels["n_cells"] == "4096"
    assert sample.labels["enable_prefix_caching"] == "True"
