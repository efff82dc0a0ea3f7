"""LoRA adapters through the real server on a tiny random Llama (server/lora.py): adapters as
models (vLLM) and by id (llama.cpp), /lora-adapters, concurrent requests under different
adapters, bad input, the metric and the start-up errors."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.main import build_settings, make_parser
from tests.live_server import LiveServer, start_server
from tests.tiny_lora import write_peft_adapter
from tests.tiny_models import write_tiny_llama

pytest.importorskip("peft")

ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "The quick brown fox jumps over the lazy dog. Hello world!"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    base = write_tiny_llama(root / "tiny")
    a = write_peft_adapter(base, root / "pirate", seed=1, targets=ALL_PROJ)
    b = write_peft_adapter(base, root / "poet", seed=2, targets=["q_proj", "v_proj"], r=8)
    return base, a, b


@pytest.fixture(scope="module")
def server(folders: tuple[Path, Path, Path]) -> LiveServer:
    base, a, b = folders
    live = start_server(
        model=str(base),
        served_model_name="tiny",
        lora=[str(a)],
        lora_scaled=[(f"verse={b}", 0.5)],
        lora_init_without_apply=True,
        n_cells=2048,
        n_seq_max=8,
        n_batch=256,
        dtype="float32",
        quant="none",
    )
    yield live
    live.stop()


def complete(url: str, **body: object) -> httpx.Response:
    payload = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True} | body
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=120)


def text(url: str, **body: object) -> str:
    resp = complete(url, **body)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_models_and_adapters_are_listed(server: LiveServer) -> None:
    models = httpx.get(f"{server.url}/v1/models").json()["data"]
    by_id = {m["id"]: m for m in models}
    assert set(by_id) == {"tiny", "pirate", "verse"}
    assert by_id["pirate"]["parent"] == "tiny" and by_id["pirate"]["root"].endswith("pirate")
    assert by_id["tiny"]["parent"] is None
    assert httpx.get(f"{server.url}/v1/models/tiny:verse").json()["id"] == "verse"
    adapters = httpx.get(f"{server.url}/lora-adapters").json()
    assert [(a["id"], a["name"], a["scale"]) for a in adapters] == [
        (0, "pirate", 0.0),
        (1, "verse", 0.0),
    ]


def test_an_adapter_by_name_by_base_name_and_by_id_are_one(server: LiveServer) -> None:
    url = server.url
    plain = text(url, model="tiny")
    pirate = text(url, model="pirate")
    assert pirate != plain
    assert text(url, model="tiny:pirate") == pirate
    assert text(url, lora=[{"id": 0, "scale": 1.0}]) == pirate
    assert text(url, model="pirate", lora=[]) == plain  # an explicit list wins, as llama.cpp
    chat = {"messages": [{"role": "user", "content": "Hello?"}], "max_tokens": 8}
    chat |= {"temperature": 0, "ignore_eos": True}
    replies = [
        httpx.post(f"{url}/v1/chat/completions", json=chat | {"model": m}, timeout=120).json()
        for m in ("tiny", "verse")
    ]
    contents = [r["choices"][0]["message"]["content"] for r in replies]
    assert contents[0] != contents[1]
    assert [r["model"] for r in replies] == ["tiny", "verse"]  # vLLM's: the adapter's name
    resp = complete(url, model="tiny:pirate", stream=True)
    assert '"model":"pirate"' in resp.text


def test_concurrent_requests_under_different_adapters_equal_each_alone(
    server: LiveServer,
) -> None:
    url = server.url
    bodies = [
        {"model": "tiny"},
        {"model": "pirate"},
        {"model": "verse"},
        {"lora": [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 1.0}]},
    ]
    alone = [text(url, **b) for b in bodies]

    async def together() -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(body: dict) -> str:
                payload = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
                payload |= {"ignore_eos": True} | body
                resp = await client.post(f"{url}/v1/completions", json=payload)
                assert resp.status_code == 200, resp.text
                return resp.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(b) for b in bodies * 2))

    assert asyncio.run(together()) == alone * 2
    assert len(set(alone)) == 4


def test_global_scales_apply_to_requests_without_lora(server: LiveServer) -> None:
    url = server.url
    plain, pirate = text(url), text(url, model="pirate")
    resp = httpx.post(f"{url}/lora-adapters", json=[{"id": 0, "scale": 1.0}])
    assert resp.status_code == 200, resp.text
    try:
        assert [a["scale"] for a in httpx.get(f"{url}/lora-adapters").json()] == [1.0, 0.0]
        assert text(url) == pirate
        assert text(url, lora=[]) == plain
    finally:
        httpx.post(f"{url}/lora-adapters", json=[])
    assert text(url) == plain


def test_bad_adapter_requests_get_openai_errors(server: LiveServer) -> None:
    url = server.url
    resp = complete(url, lora=[{"id": 7, "scale": 1.0}])
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "lora" and "no LoRA adapter with id 7" in err["message"]
    assert complete(url, lora=[{"scale": 1.0}]).status_code == 400
    assert complete(url, lora=[{"id": 0, "scale": "big"}]).status_code == 400
    assert complete(url, lora={"id": 0}).status_code == 400
    resp = complete(url, model="tiny:nobody")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    resp = httpx.post(f"{url}/lora-adapters", json=[{"id": 2, "scale": 1.0}])
    assert resp.status_code == 400 and "error" in resp.json()


def test_lora_requests_info_metric(server: LiveServer) -> None:
    families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    samples = [s for f in families for s in f.samples if s.name == "vllm:lora_requests_info"]
    assert len(samples) == 1
    labels = samples[0].labels
    assert labels["max_lora"] == "2"
    assert labels["running_lora_adapters"] == labels["waiting_lora_adapters"] == ""


def test_an_adapter_for_another_model_stops_the_start(tmp_path: Path, folders: tuple) -> None:
    base, a, _ = folders
    other = write_tiny_llama(tmp_path / "wide", dim=96, hidden_dim=160)
    wide = write_peft_adapter(other, tmp_path / "wide-lora", seed=3, targets=["q_proj"])
    with pytest.raises(RuntimeError, match="do not fit the base weight"):
        start_server(model=str(base), lora=[str(wide)], n_cells=256, dtype="float32")
    with pytest.raises(RuntimeError, match="names must be unique"):
        start_server(model=str(base), lora=[f"x={a}", f"x={a}"], n_cells=256)


def test_cli_flags() -> None:
    args = make_parser().parse_args(
        ["serve", "--lora", "a.gguf", "--lora", "p=b", "--lora-scaled", "c", "0.25"]
    )
    settings = build_settings(args)
    assert settings.lora_specs == [(None, "a.gguf", 1.0), ("p", "b", 1.0), (None, "c", 0.25)]
    args = make_parser().parse_args(["serve", "--lora", "a", "--lora-init-without-apply"])
    assert build_settings(args).lora_specs == [(None, "a", 0.0)]
