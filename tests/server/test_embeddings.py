"""POST /v1/embeddings over the fake engine (a real uvicorn, the official client): shapes,
normalisation, base64, token-id inputs, errors, and that every engine request is released."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.live_server import start_server
from tests.server.fake_engine import EMBEDDING_DIM, FakeEngine, fake_backend_factory

MODEL = "fake-model"


@pytest.fixture(scope="module")
def fake():
    engine = FakeEngine()
    server = start_server(fake_backend_factory(engine))
    yield server.url, engine
    server.stop()


@pytest.fixture
def client(fake):
    return openai.OpenAI(base_url=f"{fake[0]}/v1", api_key="x", max_retries=0)


def vectors(resp) -> np.ndarray:
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def test_strings_give_unit_vectors_in_order(client, fake):
    texts = ["alpha", "beta", "gamma", "alpha"]
    resp = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1, 2, 3]
    v = vectors(resp)
    assert v.shape == (4, EMBEDDING_DIM)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    assert np.array_equal(v[0], v[3]) and not np.allclose(v[0], v[1])
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(1 + len(t) for t in texts)
    assert not fake[1].live  # every engine request finished and was released


def test_base64_decodes_to_the_float_vector(fake):
    url = fake[0]
    body = {"input": ["one", "two"]}
    floats = httpx.post(f"{url}/v1/embeddings", json=body).json()
    b64 = httpx.post(f"{url}/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], b64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == pytest.approx(f["embedding"], abs=0)


def test_the_official_client_default_base64_path(client):
    resp = client.embeddings.create(model=MODEL, input="hello")  # the SDK asks for base64
    assert len(resp.data[0].embedding) == EMBEDDING_DIM


def test_token_ids_and_the_same_text_agree(client):
    text = client.embeddings.create(model=MODEL, input="hi", encoding_format="float")
    ids = client.embeddings.create(model=MODEL, input=[256, 104, 105], encoding_format="float")
    many = client.embeddings.create(
        model=MODEL, input=[[256, 104, 105], [256, 120]], encoding_format="float"
    )
    assert vectors(text)[0].tolist() == vectors(ids)[0].tolist() == vectors(many)[0].tolist()
    assert ids.usage.prompt_tokens == 3 and many.usage.prompt_tokens == 5


def test_dimensions_only_at_the_model_size(fake):
    url = fake[0]
    same = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "dimensions": EMBEDDING_DIM})
    assert same.status_code == 200
    short = httpx.post(f"{url}/v1/embeddings", json={"input": "x", "dimensions": 4})
    assert short.status_code == 400
    err = short.json()["error"]
    assert err["param"] == "dimensions" and "Matryoshka" in err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input.1"),
        ({"input": [[1, 2], []]}, "input.1"),
        ({"input": [1, 10**6]}, "input"),
        ({"input": [[1], [2, -1]]}, "input.1"),
        ({"input": 5}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
        ({"input": "x" * 5000}, "input"),  # the fake engine's context: 4000 tokens
    ],
)
def test_bad_input_is_a_named_error(fake, body, param):
    resp = httpx.post(f"{fake[0]}/v1/embeddings", json=body)
    assert resp.status_code in (400, 404), resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    assert not fake[1].live


def test_a_batch_larger_than_the_queue_is_served_in_turns(server_factory):
    engine = FakeEngine(max_running=4)  # more at once would be a 429
    server = server_factory(fake_backend_factory(engine), max_queue=8)
    texts = [f"text {i}" for i in range(40)]
    resp = httpx.post(f"{server.url}/v1/embeddings", json={"input": texts}, timeout=30)
    assert resp.status_code == 200, resp.text
    assert [d["index"] for d in resp.json()["data"]] == list(range(40))
    assert not engine.live
