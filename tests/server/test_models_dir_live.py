"""Two real (tiny, random) models in one process with --models-max 1 (server/model_router.py):
alternating requests all succeed with each model's own answer, /metrics counts the loads, and
an unloaded model's engine thread, cache and weights are gone; a GGUF that passes the file
check but fails to load leaves the other model serving."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from server.model_check import check_model_path
from tests.live_server import LiveServer
from tests.server.test_models_dir import wait_status
from tests.tiny_gguf import write_tiny_gguf
from tests.tiny_models import write_tiny_llama

SETTINGS = {"n_cells": 256, "n_seq_max": 4, "ctx_per_seq": 128, "dtype": "float32", "quant": "none"}


def complete(server: LiveServer, model: str) -> str:
    body = {"model": model, "prompt": "Hello world", "max_tokens": 8, "temperature": 0}
    resp = httpx.post(f"{server.url}/v1/completions", json=body | {"ignore_eos": True}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == model
    return resp.json()["choices"][0]["text"]


def engine_threads() -> int:
    return sum(t.name == "cellserve-engine" and t.is_alive() for t in threading.enumerate())


def test_two_models_alternate_under_models_max_1(server_factory, tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_tiny_llama(root / "tiny-a", seed=1)
    write_tiny_llama(root / "tiny-b", seed=2)
    before = engine_threads()
    server = server_factory(models_dir=str(root), models_max=1, **SETTINGS)
    router = server.app.state.router  # type: ignore[attr-defined]
    texts: dict[str, list[str]] = {"tiny-a": [], "tiny-b": []}
    first = None
    for model in ["tiny-a", "tiny-b", "tiny-a", "tiny-b"]:
        texts[model].append(complete(server, model))
        if first is None:
            backend = router.entries["tiny-a"].backend
            first = weakref.ref(backend.engine), weakref.ref(backend.engine.worker)
            del backend
        assert engine_threads() == before + 1  # one model's engine at a time
    # each model answers as itself, the same after a reload
    assert texts["tiny-a"][0] == texts["tiny-a"][1]
    assert texts["tiny-b"][0] == texts["tiny-b"][1]
    assert texts["tiny-a"][0] != texts["tiny-b"][0]
    gc.collect()
    assert first is not None and first[0]() is None and first[1]() is None
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    assert {m["id"]: m["status"]["value"] for m in listed} == {
        "tiny-a": "unloaded",
        "tiny-b": "loaded",
    }
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    loads = {
        s.labels["model"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "cellserve_model_loads_total"
    }
    assert loads == {"tiny-a": 2.0, "tiny-b": 2.0}


def test_a_gguf_that_fails_after_the_check_leaves_the_other_model_serving(
    server_factory, tmp_path: Path
) -> None:
    root = tmp_path / "models"
    write_tiny_llama(root / "tiny-a", seed=1)
    hf = write_tiny_llama(tmp_path / "hf", seed=2)
    broken = write_tiny_gguf(root / "broken.gguf", hf, skip=("blk.1.ffn_down.weight",))
    check_model_path(str(broken))  # a sound file: only the load finds the missing tensor
    before = engine_threads()
    server = server_factory(models_dir=str(root), models_max=1, models_autoload=False, **SETTINGS)
    assert httpx.post(f"{server.url}/models/load", json={"model": "tiny-a"}).status_code == 200
    wait_status(server.url, "tiny-a", "loaded", timeout=60)
    text = complete(server, "tiny-a")
    body = {"model": "broken", "prompt": "Hello", "max_tokens": 4}
    url = f"{server.url}/v1/completions"
    resp = httpx.post(url, params={"autoload": "true"}, json=body, timeout=120)
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "model_load_failed" and "blk.1.ffn_down.weight" in error["message"]
    wait_status(server.url, "tiny-a", "loaded", timeout=60)  # by itself: no autoload
    assert complete(server, "tiny-a") == text  # the same model
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    status = {m["id"]: m["status"]["value"] for m in listed}
    assert status == {"tiny-a": "loaded", "broken": "unloaded"}
    assert engine_threads() == before + 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
