"""llama.cpp reads the BERT GGUF that model/load/bert_to_gguf.py writes as cellserve does: an
independent check of the layout (tensor names, `bert.*` metadata, pooling type) and of the
WordPiece vocabulary (its tokenizer against ours). Needs the llama-server that
bench/build_llamacpp.sh builds; skips without it."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from bench.server_proc import served
from model.load.encoder import load_encoder
from model.load.hf_to_gguf import convert
from model.load.packaged import ALL_MINILM_L6_V2
from tests.llamacpp_server import llama_server_or_skip
from tests.tiny_bert import write_tiny_bert

TEXTS = [
    "Hello world",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 5,
    "unaffable tokenization of words!!",
    "Éléphant café naïve résumé UPPER",
]


def llama_embed(gguf_path, log_path, inputs) -> tuple[np.ndarray, list[list[int]]]:
    """llama-server --embedding: /v1/embeddings of `inputs` (texts or token lists), and the
    token ids its tokenizer gives each text (with [CLS] / [SEP])."""
    binary = llama_server_or_skip()

    def command(port: int) -> list[str]:
        return [
            str(binary), "-m", str(gguf_path), "--embedding", "-t", "1", "-c", "512",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip

    with served(command, log_path, 120.0) as s:
        r = httpx.post(f"{s.url}/v1/embeddings", json={"input": inputs}, timeout=120)
        assert r.status_code == 200, r.text
        vectors = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)
        ids = [
            httpx.post(f"{s.url}/tokenize", json={"content": x, "add_special": True}).json()[
                "tokens"
            ]
            for x in inputs
            if isinstance(x, str)
        ]
    return vectors, ids


def test_llama_cpp_embeds_all_minilm_from_our_gguf_as_we_do(tmp_path):
    path = convert(ALL_MINILM_L6_V2.path(), tmp_path / "minilm.gguf", "f32")
    ours = load_encoder(path)
    want_ids = [ours.tokenizer.encode(t) for t in TEXTS]
    vectors, ids = llama_embed(path, tmp_path / "llama.log", TEXTS)
    assert ids == want_ids
    got = ours.encoder.embed(want_ids)
    cos = (vectors * got).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() > 0.9999, cos


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_llama_cpp_pools_a_tiny_bert_as_we_do(tmp_path, pooling):
    path = convert(write_tiny_bert(tmp_path / "bert", pooling, True), tmp_path / "tiny.gguf")
    ours = load_encoder(path)
    inputs = [ours.tokenizer.encode(t) for t in TEXTS]
    vectors, _ = llama_embed(path, tmp_path / "llama.log", inputs)
    got = ours.encoder.embed(inputs)
    cos = (vectors * got).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(got, axis=1)
    assert cos.min() > 0.9999, cos
