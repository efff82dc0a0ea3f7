"""/v1/embeddings with the real model (SmolLM2-135M) and the official client: shape, unit
norm, text vs token ids, alone vs in a batch, and no cells left behind."""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.model

TEXTS = [
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b",
    "Ünïcødé and emoji 😀 in one sentence.",
    "A much longer input that spans more than one prompt chunk of the engine step, " * 8,
]
# NOTE: without --batch-invariant a row's numbers depend slightly on how many rows share its
# matmuls (CPU GEMM kernels pick paths by shape, see model/runner/worker.py MIN_ROWS), so the same
# text alone and in a batch agree to rounding, not bit for bit: with bfloat16 activations (the
# default on AVX-512 BF16 CPUs) 2.3e-4 to 3.3e-4 on an Intel Xeon (2026-12-06; components of
# ~0.04, a bfloat16 step there is 1.2e-4), where dropping the last token
# moves them by 0.27 (below)
ATOL = 1e-3


@pytest.fixture(scope="module")
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0)


def embed(client, inputs) -> np.ndarray:
    model = client.models.list().data[0].id
    resp = client.embeddings.create(model=model, input=inputs, encoding_format="float")
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def cells_used(url: str) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snap = httpx.get(f"{url}/v1/cache/cells").json()
        if not snap["slots"] and not snap["num_waiting"]:
            return snap["totals"]["used"]
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def test_embeddings_of_strings_and_token_ids(live_server, client):
    dim = 576  # SmolLM2-135M's hidden size
    before = cells_used(live_server.url)
    batch = embed(client, TEXTS)
    assert batch.shape == (len(TEXTS), dim)
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    assert cells_used(live_server.url) == before  # prompt-only sequences leave no cells

    for i, text in enumerate(TEXTS):
        alone = embed(client, text)[0]
        assert np.abs(alone - batch[i]).max() < ATOL, i
    ids = httpx.post(f"{live_server.url}/tokenize", json={"prompt": TEXTS[0]}).json()["tokens"]
    by_ids = embed(client, [ids, ids[:-1]])
    assert np.abs(by_ids[0] - batch[0]).max() < ATOL
    assert np.abs(by_ids[1] - batch[0]).max() > 10 * ATOL  # the last token matters
    sims = batch @ batch.T
    assert (sims[~np.eye(len(TEXTS), dtype=bool)] < 0.999).all()  # different texts differ
    assert cells_used(live_server.url) == before


def test_embeddings_alongside_generation(live_server, client):
    model = client.models.list().data[0].id
    chat = dict(model=model, messages=[{"role": "user", "content": "Count to five."}])
    first = client.chat.completions.create(**chat, max_tokens=12, temperature=0)
    vec = embed(client, TEXTS[:2])
    again = client.chat.completions.create(**chat, max_tokens=12, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert vec.shape[0] == 2


def test_an_input_past_the_context_is_a_400(live_server):
    long = "hello " * 600  # ctx_per_seq = 512 in the live settings
    resp = httpx.post(f"{live_server.url}/v1/embeddings", json={"input": ["ok", long]})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "input.1" and err["code"] == "context_length_exceeded"


def test_langchain_openai_embeddings(live_server, client):
    lc = pytest.importorskip("langchain_openai")
    model = client.models.list().data[0].id
    # NOTE: check_embedding_ctx_length=False: otherwise LangChain tokenizes with tiktoken,
    # whose vocabularies are downloaded (and are not this model's)
    emb = lc.OpenAIEmbeddings(
        model=model,
        base_url=f"{live_server.url}/v1",
        api_key="x",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    docs = np.array(emb.embed_documents(TEXTS[:2]))
    query = np.array(emb.embed_query(TEXTS[0]))
    assert docs.shape == (2, 576) and np.allclose(np.linalg.norm(docs, axis=1), 1.0, atol=1e-5)
    assert np.abs(query - docs[0]).max() < ATOL
    assert np.abs(docs - embed(client, TEXTS[:2])).max() < ATOL
