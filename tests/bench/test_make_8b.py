"""bench/make_8b.py's Hugging Face folder at a small width: what llama.cpp's converter reads must be
a Llama that transformers loads with SmolLM2's tokenizer (the same ids as cellserve's own reading of
the embedded GGUF), and shaped like Llama-3.1-8B at full size."""

from __future__ import annotations

import json

import pytest
import torch

from bench.make_8b import LLAMA_31_8B, ROPE_SCALING, Shape, _layer_shapes, write_hf_folder
from bench.run import n_cells
from model.load.loader import default_model_path, load_model

SMALL = Shape(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
TEXTS = [
    "Hello world! How are you today?",
    "def fib(n):\n    return 12345 + 6789  # digits one by one",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("make_8b") / "hf"
    write_hf_folder(folder, SMALL, seed=3)
    return folder


def test_the_folder_is_a_llama_transformers_loads_with_random_weights(folder) -> None:
    import transformers

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # what convert_hf_to_gguf detects
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    q = model.model.layers[1].self_attn.q_proj.weight
    assert q.shape == (64, 64) and 0.01 < q.std().item() < 0.03
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == SMALL.num_hidden_layers + 1  # a shard a layer
    rope = transformers.AutoConfig.from_pretrained(folder)
    scaling = getattr(rope, "rope_parameters", None) or rope.rope_scaling
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == ROPE_SCALING["factor"]


def test_the_tokenizer_is_smollm2s(folder) -> None:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_model(default_model_path()).tokenizer
    for text in TEXTS:
        assert tok(text)["input_ids"] == ours.encode(text), text
    assert tok.decode(tok(TEXTS[1])["input_ids"]) == TEXTS[1]
    assert tok.eos_token == "<|im_end|>" and tok.chat_template


def test_the_full_shape_is_llama_31_8bs() -> None:
    shapes = _layer_shapes(LLAMA_31_8B)
    per_layer = sum(torch.Size(d).numel() for d in shapes.values())
    assert shapes["self_attn.k_proj.weight"] == (1024, 4096)  # 8 KV heads of 128
    assert shapes["mlp.down_proj.weight"] == (4096, 14336)
    assert 6.9e9 < per_layer * LLAMA_31_8B.num_hidden_layers < 7.0e9  # + 2 x 49152 x 4096


def test_llamacpp_gets_cellserves_cache_size() -> None:
    assert n_cells(["--n-cells", "16384"]) == 16384
    assert n_cells(["--foo", "--n-cells=4096"]) == 4096
    assert n_cells([]) == 32768
