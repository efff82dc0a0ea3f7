"""EmbeddingGemma: a tiny random Gemma3TextModel with bidirectional attention, saved by
sentence-transformers as its folder (mean Pooling, two Dense layers, Normalize), against
sentence-transformers' own vectors, from the folder and from the GGUF that llama.cpp's
convert_hf_to_gguf.py writes (arch gemma-embedding, dense_2 / dense_3); llama.cpp's server on
that GGUF; a batch equal to each input alone; what is refused."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from model.errors import ModelLoadError
from model.layers.gemma_encoder import GemmaEncoder
from model.load.encoder import LoadedEncoder, is_encoder, load_encoder
from model.load.gguf import open_gguf
from tests.llamacpp_convert import convert_with_llamacpp
from tests.tiny_embgemma import WINDOW, module_types, reference_vectors, write_tiny_embgemma

pytest.importorskip("sentence_transformers")

TEXTS = [
    "Hello world",
    "a",
    # EmbeddingGemma's callers write the task prefix themselves; it is plain text to the model
    "task: search result | query: how are you today?",
    "The quick brown fox jumps over the lazy dog. " * 3,  # 86 tokens: far past the window
    "I am a tiny language model used in tests. 0123456789 + - * / =",
]
MIN_COSINE = 0.99999  # float32 throughout: measured >= 0.9999999


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_embgemma(tmp_path_factory.mktemp("embgemma") / "st")


@pytest.fixture(scope="module")
def reference(folder) -> np.ndarray:
    return reference_vectors(folder, TEXTS)


@pytest.fixture(scope="module")
def loaded(folder) -> LoadedEncoder:
    return load_encoder(folder)


def token_lists(loaded: LoadedEncoder) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def test_the_folder_is_sentence_transformers_layout(folder, loaded):
    assert module_types(folder) == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert is_encoder(folder)
    args = loaded.config
    assert (args.arch, args.pooling, args.normalize, args.dim) == (
        "gemma-embedding",
        "mean",
        True,
        32,
    )
    assert args.dense == ((32, 128), (128, 32))
    assert args.model.windows == (WINDOW,) * 5 + (0,)
    assert args.n_ctx == 96  # sentence_bert_config.json's max_seq_length


def test_folder_matches_sentence_transformers(loaded, reference):
    inputs = token_lists(loaded)
    assert inputs[1][0] == loaded.tokenizer.bos_id and inputs[1][-1] == loaded.tokenizer.eos_id
    assert max(len(ids) for ids in inputs) > 8 * WINDOW
    got = loaded.encoder.embed(inputs)
    assert cosines(got, reference).min() >= MIN_COSINE
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_the_symmetric_half_window_is_what_matches(loaded, reference):
    """The sliding layers see |q - k| <= W // 2: reading every key, or W each side, moves the
    long input's vector off sentence-transformers' (the test above would catch either)."""
    inputs = token_lists(loaded)
    long = max(range(len(inputs)), key=lambda i: len(inputs[i]))
    for windows in [(256,) * 5 + (0,), (2 * WINDOW,) * 5 + (0,)]:  # local RoPE kept
        args = loaded.config
        model = dataclasses.replace(args.model, windows=windows)
        wrong = GemmaEncoder(dataclasses.replace(args, model=model), _weights(loaded.encoder))
        cos = cosines(wrong.embed([inputs[long]]), reference[long : long + 1])[0]
        assert cos < 0.999, (windows, cos)


def _weights(encoder: GemmaEncoder) -> dict:
    w = {"tok_embeddings": encoder.tok_embd, "norm": encoder.norm}
    for name, t in encoder.named_buffers():
        if name.startswith("l"):
            i, key = name[1:].split("_", 1)
            w[f"layers.{i}.{key}"] = t
        elif name.startswith("dense"):
            w[f"dense.{name[5:]}"] = t
    return w


def test_a_batch_equals_each_input_alone(loaded):
    inputs = token_lists(loaded)
    together = loaded.encoder.embed(inputs)
    alone = np.concatenate([loaded.encoder.embed([ids]) for ids in inputs])
    np.testing.assert_allclose(together, alone, atol=1e-5)


@pytest.fixture(scope="module")
def gguf_path(folder):
    flags = ("--sentence-transformers-dense-modules",)
    return convert_with_llamacpp(folder, folder.parent / "embgemma.gguf", flags=flags)


def test_llama_cpp_converter_gguf_matches_sentence_transformers(gguf_path, loaded, reference):
    reader = open_gguf(gguf_path)
    assert reader.fields["general.architecture"] == "gemma-embedding"
    assert reader.fields["gemma-embedding.pooling_type"] == 1  # mean
    assert reader.fields["gemma-embedding.attention.sliding_window"] == WINDOW  # config.json's
    names = {t.name for t in reader.tensors}
    assert {"dense_2.weight", "dense_3.weight", "blk.5.post_ffw_norm.weight"} <= names
    gg = load_encoder(gguf_path)
    assert is_encoder(gguf_path)
    assert gg.config.dense == loaded.config.dense and gg.config.model.windows == (WINDOW,) * 5 + (
        0,
    )
    inputs = token_lists(loaded)
    assert [gg.tokenizer.encode(t) for t in TEXTS] == inputs  # <bos> ... <eos> from the GGUF
    got = gg.encoder.embed(inputs)
    assert cosines(got, reference).min() >= MIN_COSINE


def test_llama_server_embeds_the_gguf_as_we_do(gguf_path, tmp_path):
    from tests.model.test_bert_llamacpp import llama_embed

    ours = load_encoder(gguf_path)
    vectors, ids = llama_embed(gguf_path, tmp_path / "llama.log", TEXTS)
    assert ids == [ours.tokenizer.encode(t) for t in TEXTS]
    assert cosines(vectors, ours.encoder.embed(ids)).min() >= MIN_COSINE


def test_unsupported_modules_are_refused(tmp_path):
    folder = write_tiny_embgemma(tmp_path / "st")
    dense = folder / "2_Dense" / "config.json"
    cfg = json.loads(dense.read_text())
    dense.write_text(json.dumps({**cfg, "activation_function": "torch.nn.modules.activation.Tanh"}))
    with pytest.raises(ModelLoadError, match="activation"):
        load_encoder(folder)
    dense.write_text(json.dumps(cfg))
    load_encoder(folder)  # as written, it loads
    pooling = folder / "1_Pooling" / "config.json"
    pool = json.loads(pooling.read_text())
    for bad in ({"pooling_mode": "cls"}, {"pooling_mode_cls_token": True}):
        # sentence-transformers 5's "pooling_mode", and the older flags
        without = {k: v for k, v in pool.items() if not k.startswith("pooling_mode")}
        pooling.write_text(json.dumps({**without, **bad}))
        with pytest.raises(ModelLoadError, match="mean only"):
            load_encoder(folder)
    pooling.write_text(json.dumps({**without, "pooling_mode_mean_tokens": True}))
    assert load_encoder(folder).config.pooling == "mean"


def test_a_gguf_without_the_dense_layers_serves_the_pooled_vectors(folder, tmp_path):
    """convert_hf_to_gguf.py without --sentence-transformers-dense-modules leaves the Dense
    layers out: the model's own width, mean-pooled and normalised, as llama-server gives them."""
    from tests.model.test_bert_llamacpp import llama_embed

    path = convert_with_llamacpp(folder, tmp_path / "no-dense.gguf")
    assert not any(t.name.startswith("dense_") for t in open_gguf(path).tensors)
    ours = load_encoder(path)
    assert ours.config.dense == () and ours.config.dim == 32
    vectors, ids = llama_embed(path, tmp_path / "llama.log", TEXTS)
    assert cosines(vectors, ours.encoder.embed(ids)).min() >= MIN_COSINE


def test_bfloat16_weights_stay_close(folder, reference):
    loaded = load_encoder(folder, dtype="bfloat16")
    got = loaded.encoder.embed(token_lists(loaded))
    assert got.dtype == np.float32
    assert cosines(got, reference).min() > 0.99


def test_the_generative_loader_refuses_it(folder):
    from model import load_model

    with pytest.raises(ModelLoadError, match="embedding model"):
        load_model(folder)
