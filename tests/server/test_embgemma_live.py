"""A tiny EmbeddingGemma (tests/tiny_embgemma.py) served over HTTP: /v1/embeddings against
sentence-transformers' vectors, several inputs in one request and concurrent requests, no cells
left behind; chat refused as for any embedding model; an input past the context a 400; the GGUF
llama.cpp's converter writes served the same; `dimensions` (Matryoshka) as config.json lists them,
against sentence-transformers' truncate_dim."""

from __future__ import annotations

import base64
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
MATRYOSHKA = [32, 16, 8]  # as google/embeddinggemma-300m's 768, 512, 256, 128 (config.json's)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    where = tmp_path_factory.mktemp("embgemma") / "tiny-embgemma"
    return write_tiny_embgemma(where, matryoshka=MATRYOSHKA)


@pytest.fixture(scope="module")
def server(folder):
    live = start_server(model=str(folder), n_cells=512, n_batch=128, ctx_per_seq=128, threads=1)
    yield live
    live.stop()


def embed(url: str, inputs: list[str] | str, **body) -> np.ndarray:
    r = httpx.post(f"{url}/v1/embeddings", json={"input": inputs, **body}, timeout=60)
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
        # NOTE: the converter writes no Matryoshka key, so the GGUF of the same folder declares none
        short = httpx.post(f"{live.url}/v1/embeddings", json={"input": "hi", "dimensions": 16})
    finally:
        live.stop()
    assert cosines(got, reference_vectors(folder, TEXTS)).min() >= MIN_COSINE
    assert short.status_code == 400
    assert short.json()["error"]["param"] == "dimensions"
    assert "declares no shortened" in short.json()["error"]["message"]


@pytest.mark.parametrize("dimensions", [16, 8])
def test_dimensions_cut_as_sentence_transformers_truncate_dim(server, folder, dimensions):
    """The first `dimensions` values of the vector, normalised again (the model normalises):
    sentence-transformers' truncate_dim cuts after its Normalize module, so only the direction is
    compared with it, and the length is checked apart."""
    got = embed(server.url, TEXTS, dimensions=dimensions)
    assert got.shape == (len(TEXTS), dimensions)
    want = reference_vectors(folder, TEXTS, truncate_dim=dimensions)
    assert cosines(got, want).min() >= MIN_COSINE
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    full = embed(server.url, TEXTS)
    assert cosines(got, full[:, :dimensions]).min() >= MIN_COSINE
    body = {"input": TEXTS, "dimensions": dimensions, "encoding_format": "base64"}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    decoded = [
        np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]
    ]
    np.testing.assert_array_equal(np.array(decoded, dtype=np.float64), got)


def test_dimensions_the_model_was_not_trained_for_are_a_400(server):
    for dimensions in (12, 31, 64):  # not listed, not listed, past the full 32
        body = {"input": "hi", "dimensions": dimensions}
        r = httpx.post(f"{server.url}/v1/embeddings", json=body)
        assert r.status_code == 400, dimensions
        err = r.json()["error"]
        assert err["param"] == "dimensions" and err["type"] == "invalid_request_error"
        assert err["code"] == "invalid_value" and "8, 16, 32" in err["message"]
    r = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hi", "dimensions": 32})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 32
