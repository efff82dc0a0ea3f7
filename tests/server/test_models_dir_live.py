"""Two real (tiny, random) models in one process with --models-max 1 (server/model_router.py):
alternating requests all succeed with each model's own answer, /metrics counts the loads, and
an unloaded model's engine thread, cache and weights are gone."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.live_server import LiveServer
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
