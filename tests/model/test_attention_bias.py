"""transformers' `attention_bias` gives Llama (and Granite, Qwen3, OLMo 2, ...) a bias on all
four attention projections, o_proj too; cellserve read the q/k/v biases and dropped o_proj's,
from the folder and from the GGUF. Whether there is one is read from the file."""

from __future__ import annotations

import pytest
import torch

from model import load_model
from tests.llamacpp_convert import convert_with_llamacpp
from tests.model.test_gemma3_tiny import assert_close, prompt
from tests.model.test_rope_linear import all_logits
from tests.tiny_dense import write_tiny_dense


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    folder = write_tiny_dense(
        tmp_path_factory.mktemp("bias") / "hf", "llama", n_layers=2, attention_bias=True
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert hf.model.layers[0].self_attn.o_proj.bias is not None
    ids = prompt(24, seed=6)
    with torch.inference_mode():
        return folder, ids, hf(torch.tensor([ids])).logits[0]


def test_hf_folder_with_attention_bias_matches_transformers(biased):
    folder, ids, ref = biased
    loaded = load_model(folder)
    assert loaded.config.qkv_bias and loaded.config.out_bias
    assert_close(all_logits(folder, ids), ref)


def test_llamacpp_gguf_with_attention_bias_matches_transformers(biased, tmp_path):
    folder, ids, ref = biased
    path = convert_with_llamacpp(folder, tmp_path / "biased.gguf")
    assert load_model(path).config.out_bias
    assert_close(all_logits(path, ids), ref)
