"""A tiny EmbeddingGemma (tests/tiny_embgemma.py) served over HTTP: /v1/embeddings against
sentence-transformers' vectors, several inputs in one request and concurrent requests, no cells
left behind; chat refused as for any embedding model; an input past the context a 400; the GGUF
llama.cpp's converter writes served the same."""

from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

from tests.live_server import start_server
from tests.server.test_embedding_model_live import cells_used, cosines
from tests.tiny_embgemma import reference_vectors, write_tiny_embgemma

pytest.importorskip("sentence_transformers")

TEXTS = [
    "task: search result | query: Hello world",
    "title: none | text: The quick brown fox jumps over the lazy dog. " * 2,  # past the window
    "a",
    "How are you today?",
]
MIN_COSINE = 0.9999


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_embgemma(tmp_path_factory.mktemp("embgemma") / "tiny-embgemma")


@pytest.fixture(scope="module")
def server(folder):
    live = start_server(model=str(folder), n_cells=512, n_batch=128, ctx_per_seq=128, threads=1)
    yield live
    live.stop()


def embed(url: str, inputs: list[str] | str) -> np.ndarray:
    r = httpx.post(f"{url}/v1/embeddings", json={"input": inputs}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)


def test_vectors_match_sentence_transformers(server, folder):
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == [
        "tiny-embgemma"
    ]
    want = reference_vectors(folder, TEXTS)
    got = embed(server.url, TEXTS)
    assert got.shape == (len(TEXTS), 32)  # the last Dense layer's width
    assert cosines(got, want).min() >= MIN_COSINE
    with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
        alone = np.concatenate(list(pool.map(lambda t: embed(server.url, t), TEXTS)))
    assert cosines(alone, want).min() >= MIN_COSINE
    assert cells_used(server.url) == 0  # an encoder keeps no cells


def test_chat_is_refused_and_a_long_input_is_a_400(server):
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "model_not_supported"
    assert "embedding model" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "word " * 200})
    assert r.status_code == 400
    assert "96" in r.json()["error"]["message"]  # the tokenizer's model_max_length


def test_the_llama_cpp_gguf_serves_the_same_vectors(folder, tmp_path):
    from tests.llamacpp_convert import convert_with_llamacpp

    flags = ("--sentence-transformers-dense-modules",)
    path = convert_with_llamacpp(folder, tmp_path / "tiny.gguf", flags=flags)
    live = start_server(model=str(path), n_cells=512, n_batch=128, ctx_per_seq=128, threads=1)
    try:
        got = embed(live.url, TEXTS)
    finally:
        live.stop()
    assert cosines(got, reference_vectors(folder, TEXTS)).min() >= MIN_COSINE


def test_dimensions_other_than_the_models_are_refused(server):
    """EmbeddingGemma is trained for shortened vectors, but cellserve does not truncate them."""
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi", "dimensions": 16})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "dimensions"
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi", "dimensions": 32})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 32
