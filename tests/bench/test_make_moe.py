"""bench/make_moe.py's Hugging Face folder at a small width: a Granite-MoE that transformers loads
and runs, shaped like Granite-3.1-3B-A800M at full size, which llama.cpp's converter (where
bench/build_llamacpp.sh kept it) turns into a granitemoe GGUF that cellserve serves as the same
model; and `--model granite-3b-a800m-shape` names the made file."""

from __future__ import annotations

import json

import pytest
import torch

from bench import make_8b
from bench.make_moe import GRANITE_3B_A800M, NAME, Shape, _layer_shapes, write_hf_folder
from bench.models import decode_read_bytes, resolve_model
from model.load.gguf_file import GGUFFile
from model.load.loader import load_model
from model.runner.worker import make_worker
from tests.llamacpp_convert import converter, require_llamacpp
from tests.model.factories import make_plan, prefill_chunk

SMALL = Shape(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
)
TEXT = "Hello world! How are you today? The quick brown fox"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("make_moe") / "hf"
    write_hf_folder(folder, SMALL, seed=3)
    return folder


@pytest.fixture(scope="module")
def hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gguf(folder, tmp_path_factory):
    """The folder as `make` converts it: bf16, by llama.cpp's own converter."""
    convert = require_llamacpp(converter())
    out = tmp_path_factory.mktemp("make_moe_gguf") / f"{NAME}-bf16.gguf"
    make_8b.convert_to_bf16(convert, folder, out, NAME)
    return out


def test_the_folder_is_a_granite_moe_transformers_runs(folder, hf_model) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GraniteMoeForCausalLM"]  # what convert_hf_to_gguf detects
    assert config["model_type"] == "granitemoe" and config["tie_word_embeddings"]
    assert config["embedding_multiplier"] == 12.0 and config["logits_scaling"] == 6.0
    moe = hf_model.model.layers[1].block_sparse_moe
    assert moe.experts.gate_up_proj.shape == (4, 2 * 32, 64)
    assert moe.experts.down_proj.shape == (4, 64, 32)
    assert moe.router.weight.shape == (4, 64) and 0.01 < moe.router.weight.std().item() < 0.03
    assert torch.equal(hf_model.model.norm.weight, torch.ones(64))
    assert torch.equal(hf_model.lm_head.weight, hf_model.model.embed_tokens.weight)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == SMALL.num_hidden_layers + 1  # a shard a layer
    assert "lm_head.weight" not in index["weight_map"]
    with torch.inference_mode():
        logits = hf_model(torch.tensor([[1, 200, 3000, 40000]])).logits
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()


def test_the_full_shape_is_granite_3b_a800ms() -> None:
    shapes = _layer_shapes(GRANITE_3B_A800M)
    assert shapes["self_attn.k_proj.weight"] == (512, 1536)  # 8 KV heads of 64
    assert shapes["block_sparse_moe.input_linear.weight"] == (40, 1024, 1536)
    assert shapes["block_sparse_moe.output_linear.weight"] == (40, 1536, 512)
    experts = ("input_linear", "output_linear")
    layer = {k: torch.Size(d).numel() for k, d in shapes.items()}
    total = sum(layer.values()) * GRANITE_3B_A800M.num_hidden_layers + 49152 * 1536
    routed = sum(n for k, n in layer.items() if k.split(".")[1] in experts)
    active = total - GRANITE_3B_A800M.num_hidden_layers * routed * (40 - 8) // 40
    assert 3.2e9 < total < 3.4e9 and 0.8e9 < active < 0.9e9


def test_llamacpps_converter_makes_a_granitemoe_gguf_cellserve_serves(gguf, hf_model) -> None:
    fields = GGUFFile(gguf).fields
    assert fields["general.architecture"] == "granitemoe"
    assert fields["granitemoe.expert_count"] == 4 and fields["granitemoe.expert_used_count"] == 2
    assert fields["tokenizer.ggml.pre"] == "smollm"
    loaded = load_model(gguf)
    ids = loaded.tokenizer.encode(TEXT)
    with torch.inference_mode():
        want = hf_model(torch.tensor([ids])).logits[0]
    got = make_worker(loaded, n_cells=128).forward(
        make_plan([prefill_chunk(0, ids, 0, all_rows=True)])
    )
    assert float((got - want).abs().max()) < 1e-3 * float(want.abs().max())


def test_a_decode_token_reads_only_its_experts(gguf) -> None:
    f = GGUFFile(gguf)
    blocks = [t for t in f.tensors if t.name.startswith("blk.")]
    experts = sum(t.n_bytes for t in blocks if "_exps." in t.name)
    others = sum(t.n_bytes for t in blocks if "_exps." not in t.name)
    head = f.tensor("token_embd.weight").n_bytes  # tied: the head
    assert experts and decode_read_bytes(gguf) == others + experts // 2 + head


def test_the_model_name_resolves_once_made(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CELLSERVE_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="python -m bench.make_moe"):
        resolve_model(NAME)
    made = tmp_path / NAME / f"{NAME}-Q4_K_M.gguf"
    made.parent.mkdir()
    made.touch()
    assert resolve_model(NAME) == made
